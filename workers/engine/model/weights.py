"""HF checkpoint names onto the engine's parameters, strictly: a missing or unknown tensor is an error.

A silently skipped tensor would leave uninitialised memory in the model and produce fluent nonsense,
so loading accounts for every parameter row.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from workers.engine.model.llama import LlamaForCausalLM

# Buffers some checkpoints carry that the engine derives itself.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


@dataclass(frozen=True, slots=True)
class _Target:
    param: str
    offset: int
    rows: int


def _targets(model: LlamaForCausalLM) -> dict[str, _Target]:
    """checkpoint name -> rows of one of our parameters."""
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[str, _Target] = {}
    for name, param in params.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        targets[name] = _Target(name, 0, param.shape[0])
    q, kv, inter = config.q_size, config.kv_size, config.intermediate_size
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            fused = targets.pop(f"{attn}.qkv_proj.{kind}").param
            targets[f"{attn}.q_proj.{kind}"] = _Target(fused, 0, q)
            targets[f"{attn}.k_proj.{kind}"] = _Target(fused, q, kv)
            targets[f"{attn}.v_proj.{kind}"] = _Target(fused, q + kv, kv)
        for kind in ("weight", "bias") if config.mlp_bias else ("weight",):
            fused = targets.pop(f"{mlp}.gate_up_proj.{kind}").param
            targets[f"{mlp}.gate_proj.{kind}"] = _Target(fused, 0, inter)
            targets[f"{mlp}.up_proj.{kind}"] = _Target(fused, inter, inter)
    return targets


def load_hf_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs from a HF-layout checkpoint into `model`, casting to its dtype.

    With tied embeddings an `lm_head.weight` in the checkpoint is the embedding again and is skipped.
    """
    targets = _targets(model)
    params = dict(model.named_parameters())
    missing = set(targets)
    for name, tensor in tensors:
        if _IGNORED.match(name) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {model.config.model_type} model")
        dest = params[target.param].data.narrow(0, target.offset, target.rows)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
