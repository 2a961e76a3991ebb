"""The Llama family (Llama, Mistral, Qwen2; SmolLM2 is a Llama; Mixtral and Qwen2-MoE with the sparse
MLP of moe.py in their MoE layers) over a paged KV cache.

The forward pass takes one flattened step: every scheduled sequence's new tokens concatenated, with
their positions, and the attention that was planned for the step. Each layer writes its K/V into its
own cache and attends through the block tables, so prefill chunks and decodes share one pass.
q/k/v and gate/up are fused into single matmuls (fewer kernel launches and passes over x);
`weights.py` maps HF checkpoint names onto the fused parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workers.engine.attention.backend import StepAttention
from workers.engine.model.linear import Linear
from workers.engine.model.mlp import MLP
from workers.engine.model.model_config import ModelConfig
from workers.engine.model.moe import ExpertShard, RoutingCounts, SparseMoeBlock
from workers.engine.model.rope import RotaryEmbedding, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32 and cast back before the weight, as HF does, so half precision matches.
        xf = x.to(torch.float32)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.q_size
        self.kv_size = config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: StepAttention,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        out = attention(q, k, v, k_cache, v_cache)
        return self.o_proj(out.reshape(n, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: StepAttention,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaBackbone(nn.Module):
    """Named `model` inside LlamaForCausalLM so that parameter names follow HF checkpoints."""

    def __init__(self, config: ModelConfig, shard: ExpertShard, routing: RoutingCounts | None) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, _mlp(config, i, shard, routing)) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


def _mlp(config: ModelConfig, layer: int, shard: ExpertShard, routing: RoutingCounts | None) -> nn.Module:
    if config.moe is not None and routing is not None and layer in config.moe.layers:
        return SparseMoeBlock(config, shard, routing)
    return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias)


class LlamaForCausalLM(nn.Module):
    """shard: the experts this process holds (all of them unless expert parallelism splits them)."""

    def __init__(self, config: ModelConfig, shard: ExpertShard | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard or ExpertShard()
        # Tokens per expert, shared by every MoE layer; None for a dense model.
        self.routing = RoutingCounts(config.moe.num_experts) if config.moe is not None else None
        self.model = LlamaBackbone(config, self.shard, self.routing)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    @classmethod
    def empty(
        cls,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: ExpertShard | None = None,
    ) -> LlamaForCausalLM:
        """Allocated but uninitialised: skips random init of weights the checkpoint overwrites anyway."""
        with torch.device("meta"):
            model = cls(config, shard)
        model = model.to(dtype=dtype).to_empty(device=device)
        if config.tie_word_embeddings:
            # to_empty gives every parameter its own storage, so the tie is made again.
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: StepAttention,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Final hidden states [num_tokens, hidden] of a flattened step; logits are left to the caller,
        which needs them only for the rows it samples."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, (k_cache, v_cache) in zip(self.model.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, attention, k_cache, v_cache)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits, whatever the model dtype, so sampling and logprobs never round in half."""
        return self.lm_head(hidden).float()

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
