"""MoE models on H100s, as replicas of one expert-parallel group each: what `bench fleet --ep` runs.

`ep_profile(name, group)` lays a model out over `group` GPUs (ep_cost's layout) and derives the
replica's profile from first principles, with profiles.py's H100 figures (datasheet FLOPS and HBM
bandwidth, the same MFU and bandwidth efficiencies, step and per-sequence host costs) and these:
- memory: 80 GB of HBM per GPU (H100 SXM datasheet), of which vLLM's default
  gpu_memory_utilization takes 90%; 4 GB of that for activations, CUDA graphs and the all-to-all
  buffers (an estimate). Each rank holds the dense weights whole and 1/G of the experts, in bf16;
  the rest is its KV, for the sequences that live on it, so a replica's pool is G ranks' worth.
- the all-to-all's link: NVLink 4, 450 GB/s each way per H100 SXM. DeepEP (docs/legacy.md) moves
  153 GB/s (dispatch) and 158 GB/s (combine) per GPU within an 8-GPU H800 node, whose NVLink peaks
  at about 160 GB/s of its 200 nominal: 77% of nominal, which is taken here, about 346 GB/s. About
  10 us per collective beside it (launch and the ranks' handshake; an estimate).
- budgets: per rank, vLLM's 8192 tokens a step and 256 sequences, as h100-8b; G ranks' worth per
  replica, one rank's tokens at most for one sequence's prefill chunk.
"""

from __future__ import annotations

from workers.sim.ep_cost import ExpertParallelCost
from workers.sim.link import KvLink
from workers.sim.moe_routing import ExpertLayout, Gate, MoeModel
from workers.sim.profiles import (
    BF16_BYTES,
    H100_BF16_FLOPS,
    H100_HBM_BYTES_PER_S,
    H100_LINK,
    HBM_EFFICIENCY,
    PREFILL_MFU,
    Profile,
    h100_cost,
)

H100_HBM_BYTES = 80e9
GPU_MEMORY_UTILIZATION = 0.9
RESERVED_BYTES = 4e9
H100_NVLINK = KvLink(bytes_per_s=0.77 * 450e9, latency_s=10e-6)
RANK_BATCHED_TOKENS, RANK_SEQS = 8192, 256
BLOCK_SIZE = 256

# mistralai/Mixtral-8x7B-Instruct-v0.1 config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads,
# head_dim 128, 8 experts of intermediate 14336, top-2, vocab 32000, untied, 32768 positions, EOS 2.
# 46.7B parameters, 12.9B active (Mistral's announcement); 128 KiB of bf16 KV per token. 93 GB of
# weights: two H100s at least.
MIXTRAL_8X7B = MoeModel(
    model_name="Mixtral-8x7B-Instruct-v0.1",
    layers=32,
    hidden=4096,
    heads=32,
    kv_heads=8,
    head_dim=128,
    vocab=32000,
    experts=8,
    top_k=2,
    expert_intermediate=14336,
    max_context_len=32768,
    eos_token_ids=(2,),
)

# Qwen/Qwen3-30B-A3B config.json: 48 layers, hidden 2048, 32 heads, 4 KV heads, head_dim 128, 128
# experts of intermediate 768, top-8, vocab 151936, untied, 40960 positions; EOS <|im_end|> 151645
# and <|endoftext|> 151643. 30.5B parameters, 3.3B active (the model card); 96 KiB of KV per token.
# 61 GB of weights: one H100 holds it, with little room for KV.
QWEN3_30B_A3B = MoeModel(
    model_name="Qwen3-30B-A3B",
    layers=48,
    hidden=2048,
    heads=32,
    kv_heads=4,
    head_dim=128,
    vocab=151936,
    experts=128,
    top_k=8,
    expert_intermediate=768,
    max_context_len=40960,
    eos_token_ids=(151645, 151643),
)

MOE_MODELS: dict[str, MoeModel] = {"mixtral-8x7b-h100": MIXTRAL_8X7B, "qwen3-30b-a3b-h100": QWEN3_30B_A3B}


def get_moe_model(name: str) -> MoeModel:
    if name not in MOE_MODELS:
        raise ValueError(f"unknown MoE profile {name!r}: choose one of {', '.join(MOE_MODELS)}")
    return MOE_MODELS[name]


def weight_bytes_per_gpu(model: MoeModel, group: int) -> float:
    """A rank's weights: the dense ones whole, its slice of the experts."""
    experts = model.layers * model.experts * model.expert_params
    return (model.dense_params + experts / group) * BF16_BYTES


def kv_tokens_per_gpu(model: MoeModel, group: int) -> int:
    """KV tokens one rank of a `group`-GPU replica holds, after its weights."""
    free = H100_HBM_BYTES * GPU_MEMORY_UTILIZATION - RESERVED_BYTES - weight_bytes_per_gpu(model, group)
    return max(int(free // model.kv_bytes_per_token(BF16_BYTES)), 0)


def min_group(model: MoeModel) -> int:
    """The fewest GPUs (a divisor of the expert count) that hold the model with room for a block of KV."""
    for group in range(1, model.experts + 1):
        if model.experts % group == 0 and kv_tokens_per_gpu(model, group) >= BLOCK_SIZE:
            return group
    raise ValueError(f"{model.model_name} fits no expert-parallel group of H100s")


def ep_profile(name: str, group: int, gate: Gate | None = None) -> Profile:
    """The MoE profile `name` as one replica of `group` GPUs, its gate spreading tokens as `gate`
    says (uniform by default)."""
    model = get_moe_model(name)
    if group < min_group(model):
        raise ValueError(f"{name} needs at least {min_group(model)} GPUs a replica, not {group}")
    layout = ExpertLayout(model.experts, model.top_k, group, gate or Gate())
    kv_bytes = model.kv_bytes_per_token(BF16_BYTES)
    dense = h100_cost(
        model.layers * (model.attention_params + model.gate_params),
        model.head_params,
        model.layers,
        model.heads,
        model.head_dim,
        kv_bytes,
    )
    effective_flops = H100_BF16_FLOPS * PREFILL_MFU
    bandwidth = H100_HBM_BYTES_PER_S * HBM_EFFICIENCY
    cost = ExpertParallelCost(
        dense=dense,
        layout=layout,
        layers=model.layers,
        hidden=model.hidden,
        dtype_bytes=BF16_BYTES,
        expert_pair_s=model.layers * 2 * model.expert_params / effective_flops,
        expert_read_s=model.layers * model.expert_params * BF16_BYTES / bandwidth,
        link=H100_NVLINK,
    )
    return Profile(
        name=f"{name}-ep{group}",
        model_name=model.model_name,
        vocab_size=model.vocab,
        eos_token_ids=model.eos_token_ids,
        max_context_len=model.max_context_len,
        cost=cost,
        block_size=BLOCK_SIZE,
        kv_capacity_tokens=group * kv_tokens_per_gpu(model, group),
        kv_bytes_per_token=kv_bytes,
        max_num_batched_tokens=group * RANK_BATCHED_TOKENS,
        max_num_seqs=group * RANK_SEQS,
        link=H100_LINK,
        source=f"derived: {model.model_name} config, H100 SXM datasheet, DeepEP; see moe_profiles.py",
        max_prefill_chunk=RANK_BATCHED_TOKENS,
    )
