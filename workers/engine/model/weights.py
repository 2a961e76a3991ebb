"""HF checkpoint names onto the engine's parameters, strictly: a missing or unknown tensor is an error.

A silently skipped tensor would leave uninitialised memory in the model and produce fluent nonsense,
so loading accounts for every parameter row. A process holding a share of the experts (expert
parallelism) accepts the other ranks' experts and skips them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from workers.engine.model.llama import LlamaForCausalLM

# Buffers some checkpoints carry that the engine derives itself.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# Each expert's (gate, up, down) checkpoint names, and where its MoE block sits in the layer.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen2_moe": ("gate_proj", "up_proj", "down_proj")}
_MOE_BLOCK_NAMES = {"mixtral": "block_sparse_moe", "qwen2_moe": "mlp"}


@dataclass(frozen=True, slots=True)
class _Target:
    param: str
    offset: int
    rows: int
    # Stacked expert weights: the expert's index in this process's share.
    expert: int | None = None


def _targets(model: LlamaForCausalLM) -> tuple[dict[str, _Target], set[str]]:
    """checkpoint name -> rows of one of our parameters, and the names of other ranks' experts."""
    config = model.config
    params = dict(model.named_parameters(remove_duplicate=False))
    targets: dict[str, _Target] = {}
    for name, param in params.items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        targets[name] = _Target(name, 0, param.shape[0])
    q, kv = config.q_size, config.kv_size
    for i in range(config.num_layers):
        attn = f"model.layers.{i}.self_attn"
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            fused = targets.pop(f"{attn}.qkv_proj.{kind}").param
            targets[f"{attn}.q_proj.{kind}"] = _Target(fused, 0, q)
            targets[f"{attn}.k_proj.{kind}"] = _Target(fused, q, kv)
            targets[f"{attn}.v_proj.{kind}"] = _Target(fused, q + kv, kv)
    # Stacked experts' gate_up_proj has no ".weight": only the dense MLPs and shared experts match.
    for fused in [name for name in targets if name.endswith(".gate_up_proj.weight")]:
        _split_gate_up(targets, fused, params[fused].shape[0] // 2)
    skipped: set[str] = set()
    if config.moe is not None:
        for i in config.moe.layers:
            skipped |= _expert_targets(model, targets, i)
    return targets, skipped


def _split_gate_up(targets: dict[str, _Target], fused: str, inter: int) -> None:
    """A fused SwiGLU projection takes the checkpoint's separate gate and up tensors (and biases)."""
    prefix = fused.removesuffix(".gate_up_proj.weight")
    for kind in ("weight", "bias") if f"{prefix}.gate_up_proj.bias" in targets else ("weight",):
        param = targets.pop(f"{prefix}.gate_up_proj.{kind}").param
        targets[f"{prefix}.gate_proj.{kind}"] = _Target(param, 0, inter)
        targets[f"{prefix}.up_proj.{kind}"] = _Target(param, inter, inter)


def _expert_targets(model: LlamaForCausalLM, targets: dict[str, _Target], layer: int) -> set[str]:
    """Layer `layer`'s experts under their checkpoint names (this process's share; the others' names are
    returned, to be skipped), and Mixtral's block name in place of ours."""
    config = model.config
    assert config.moe is not None
    ours, theirs = f"model.layers.{layer}.mlp", f"model.layers.{layer}.{_MOE_BLOCK_NAMES[config.model_type]}"
    for name in [n for n in targets if n.startswith(f"{ours}.")]:
        targets[theirs + name.removeprefix(ours)] = targets.pop(name)
    gate_up, down = f"{ours}.experts.gate_up_proj", f"{ours}.experts.down_proj"
    targets.pop(f"{theirs}.experts.gate_up_proj")
    targets.pop(f"{theirs}.experts.down_proj")
    gate_name, up_name, down_name = _EXPERT_NAMES[config.model_type]
    inter, hidden = config.moe.intermediate_size, config.hidden_size
    local = model.shard.experts(config.moe.num_experts)
    skipped = set()
    for expert in range(config.moe.num_experts):
        names = [f"{theirs}.experts.{expert}.{kind}.weight" for kind in (gate_name, up_name, down_name)]
        if expert not in local:
            skipped.update(names)
            continue
        index = expert - local.start
        targets[names[0]] = _Target(gate_up, 0, inter, index)
        targets[names[1]] = _Target(gate_up, inter, inter, index)
        targets[names[2]] = _Target(down, 0, hidden, index)
    return skipped


def load_hf_weights(model: LlamaForCausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy (name, tensor) pairs from a HF-layout checkpoint into `model`, casting to its dtype.

    With tied embeddings an `lm_head.weight` in the checkpoint is the embedding again and is skipped.
    """
    targets, skipped = _targets(model)
    params = dict(model.named_parameters())
    missing = set(targets)
    for name, tensor in tensors:
        if _IGNORED.match(name) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
            continue
        if name in skipped:
            continue
        target = targets.get(name)
        if target is None:
            raise ValueError(f"checkpoint tensor {name!r} has no place in a {model.config.model_type} model")
        dest = params[target.param].data
        if target.expert is not None:
            dest = dest[target.expert]
        dest = dest.narrow(0, target.offset, target.rows)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:5]}")
