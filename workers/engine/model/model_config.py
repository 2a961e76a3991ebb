"""The model shape the engine needs, read once from a HF `config.json` (Llama, Mistral, Qwen2, and the
mixture-of-experts Mixtral and Qwen2-MoE).

Both spellings of RoPE settings exist in the wild: older files carry `rope_theta` + `rope_scaling`,
transformers 5 writes `rope_parameters`. Everything is normalised here so that the model code never
looks at a raw dict, and anything the engine cannot run exactly fails here, loudly, at load time.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint needs something this engine does not implement (so it would compute wrong)."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float = 10000.0
    # "default" (no scaling), "linear" or "llama3".
    type: str = "default"
    factor: float = 1.0
    # llama3 only: the frequency band that is interpolated, and the pre-training context length.
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model; `layers` are the decoder layers that have it (the
    rest keep the dense MLP, as Qwen2-MoE's `mlp_only_layers` and `decoder_sparse_step` say)."""

    num_experts: int
    top_k: int
    # Hidden width of each routed expert.
    intermediate_size: int
    # Renormalise the top-k probabilities to sum to 1 (Mixtral always; Qwen2-MoE per `norm_topk_prob`).
    norm_topk_prob: bool
    layers: tuple[int, ...]
    # Qwen2-MoE's shared expert, which every token visits, scaled by a sigmoid gate; 0: none.
    shared_expert_intermediate_size: int = 0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 has biases on q/k/v only; Llama's `attention_bias` puts them on q/k/v and o.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Sliding-window attention is not implemented: the context is capped at the window instead, where
    # a windowed model and full attention give the same result.
    sliding_window: int | None = None
    moe: MoeConfig | None = None

    @property
    def max_context_len(self) -> int:
        """The longest sequence (prompt + output) this engine serves exactly."""
        if self.sliding_window is None:
            return self.max_position_embeddings
        return min(self.max_position_embeddings, self.sliding_window)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(
        cls, hf: Mapping[str, Any], generation_config: Mapping[str, Any] | None = None
    ) -> ModelConfig:
        """Parse a `config.json` dict (plus `generation_config.json`, whose eos ids take part in stopping)."""
        model_type = hf.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise UnsupportedModelError(f"model_type {model_type!r} is not supported; supported: {supported}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported; the MLP is SwiGLU (silu)")
        num_heads = int(hf["num_attention_heads"])
        hidden_size = int(hf["hidden_size"])
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=parse_rope(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_qkv_bias(hf, attention_bias),
            o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
            mlp_bias=bool(hf.get("mlp_bias", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_eos_ids(hf, generation_config or {}),
            sliding_window=_sliding_window(hf),
            moe=parse_moe(hf),
        )


def _qkv_bias(hf: Mapping[str, Any], attention_bias: bool) -> bool:
    """Qwen2 always has q/k/v biases, Qwen2-MoE per `qkv_bias` (default on), Llama per `attention_bias`."""
    model_type = hf.get("model_type")
    if model_type == "qwen2":
        return True
    if model_type == "qwen2_moe":
        return bool(hf.get("qkv_bias", True))
    return attention_bias


def parse_moe(hf: Mapping[str, Any]) -> MoeConfig | None:
    """The MoE shape of a Mixtral or Qwen2-MoE config (None for dense models)."""
    model_type = hf.get("model_type")
    num_layers = int(hf["num_hidden_layers"])
    if model_type == "mixtral":
        return MoeConfig(
            num_experts=int(hf["num_local_experts"]),
            top_k=int(hf["num_experts_per_tok"]),
            intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            layers=tuple(range(num_layers)),
        )
    if model_type != "qwen2_moe":
        return None
    num_experts = int(hf["num_experts"])
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(num_layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    if not layers:
        raise UnsupportedModelError("a qwen2_moe config without MoE layers: serve it as the dense model")
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(hf["num_experts_per_tok"]),
        intermediate_size=int(hf["moe_intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        layers=layers,
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
    )


def parse_rope(hf: Mapping[str, Any]) -> RopeConfig:
    """RoPE settings from either spelling; unknown scaling types are refused rather than ignored."""
    params: dict[str, Any] = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {partial} is not supported (only 1.0)")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    if rope_type == "linear":
        return RopeConfig(theta=theta, type="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=theta,
        type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 8192))
        ),
    )


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _eos_ids(hf: Mapping[str, Any], generation_config: Mapping[str, Any]) -> tuple[int, ...]:
    ids = _as_ids(hf.get("eos_token_id")) + _as_ids(generation_config.get("eos_token_id"))
    return tuple(dict.fromkeys(ids))


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    window = hf.get("sliding_window")
    if window is None:
        return None
    # Qwen2 (and Qwen2-MoE) carries a window it only uses when use_sliding_window is set.
    if hf.get("model_type") in ("qwen2", "qwen2_moe") and not hf.get("use_sliding_window", False):
        return None
    return int(window)
