"""Hardware + model profiles for simulated replicas: a cost model and the serving limits that go with it.

Each profile says where its numbers come from. `cpu-smollm2` is measured on this project's machine
by `python -m workers.sim.calibrate`; `h100-8b` is derived from first principles and public figures,
each named next to the value it sets. A profile written by calibrate (JSON) loads by its path, so a
fresh calibration can be used before its numbers are copied here; one written before profiles had a
KV size per token and a link still loads (`profile_from_json`). MoE models, laid out as
expert-parallel groups of GPUs, are moe_profiles'.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workers.sim.cost_model import CostModel, StepCost
from workers.sim.link import KvLink


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    # The served model name: it roots the block hashes (docs/design.md §3), so a simulated replica and a real
    # one of the same model hash identically.
    model_name: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_context_len: int
    # A CostModel for one GPU; an ExpertParallelCost for an expert-parallel group (moe_profiles),
    # which JSON does not hold: calibrate measures one GPU.
    cost: StepCost
    block_size: int
    # KV pool size in tokens; kept in tokens so that overriding block_size keeps the memory the same.
    kv_capacity_tokens: int
    # Bytes of K and V one token takes over all layers: what a prompt's KV weighs when it moves to a
    # decode replica (prefill/decode disaggregation).
    kv_bytes_per_token: int
    max_num_batched_tokens: int
    max_num_seqs: int
    # The link a replica sends KV to another replica over.
    link: KvLink
    # How the numbers were obtained.
    source: str
    # Longest prefill chunk of one sequence per step (None: the step's budget). An expert-parallel
    # group's budget is all its ranks', but a sequence's chunk runs on its own rank (ep_cost).
    max_prefill_chunk: int | None = None

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"{self.kv_capacity_tokens} KV tokens make no block of {self.block_size}")

    @property
    def num_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size


# -- cpu-smollm2: the real engine on this machine ---------------------------------------------------

SMOLLM2_KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # K,V x layers x KV heads x head_dim x fp32
SMOLLM2_KV_MEMORY_BYTES = 256 * 2**20  # EngineConfig's default kv_memory_bytes

CPU_SMOLLM2 = Profile(
    name="cpu-smollm2",
    model_name="SmolLM2-135M-Instruct",
    vocab_size=49152,
    eos_token_ids=(2,),
    max_context_len=8192,
    # Measured 2026-11-29 by `python -m workers.sim.calibrate --json OUT --repeats 5` on this project's
    # machine (AMD EPYC, 2 shared cores), SmolLM2 fp32 with the SDPA backend on one torch thread,
    # median thread CPU time per shape: RMS error 6.1% (max 16.4%) over the 22 grid shapes, max 7.6%
    # on 3 held-out mixed steps, decode batches within this pool's 5.8k KV tokens. The fit put the
    # ridge at one token, i.e. no weight floor: on one CPU thread the per-step constant (63 ms, much
    # of it streaming 540 MB of weights) and the per-token FLOPs (6.7 ms) add rather than overlap.
    cost=CostModel(
        step_s=0.0629,
        sample_s=0.00430,
        token_s=0.00672,
        weights_s=0.00672,
        attn_pair_s=4.74e-6,
        kv_token_s=1.70e-5,
    ),
    block_size=16,
    # The real engine's default pool: 256 MiB / (46080 B x 16) = 364 blocks.
    kv_capacity_tokens=SMOLLM2_KV_MEMORY_BYTES // (SMOLLM2_KV_BYTES_PER_TOKEN * 16) * 16,
    kv_bytes_per_token=SMOLLM2_KV_BYTES_PER_TOKEN,
    # EngineConfig's defaults.
    max_num_batched_tokens=2048,
    max_num_seqs=64,
    # An estimate, not a measurement: TCP over loopback between two worker processes sharing this
    # machine's 2 cores, about 1 GB/s once the bytes are copied in and out of the tensors.
    link=KvLink(bytes_per_s=1e9, latency_s=1e-3),
    source=(
        "calibrated 2026-11-29 on AMD EPYC with 1 torch thread, fp32, SDPA; median thread CPU time of "
        "5 runs per shape; fit RMS error 6.1% (max 16.4%), holdout max 7.6%"
    ),
)


# -- h100-8b: Llama-3-8B in bf16 on one H100 SXM, from first principles ---------------------------

# NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS dense BF16 (1979 is with sparsity),
# 3.35 TB/s HBM3, 80 GB.
H100_BF16_FLOPS = 989e12
H100_HBM_BYTES_PER_S = 3.35e12
# Streaming kernels (GEMV-shaped decode GEMMs, paged KV reads) reach about 80% of peak bandwidth.
HBM_EFFICIENCY = 0.8
# Model FLOPs utilisation of large prefill GEMMs: 40-60% is what tuned engines reach; the middle.
PREFILL_MFU = 0.5
# FlashAttention-2 forward on H100, bf16, head_dim 128: about 350 TFLOPS (FlashAttention-3 paper,
# Shah et al. 2024, baseline measurements), counting only the unmasked half of a causal square.
FLASH_ATTN_FLOPS = 350e12

# Meta-Llama-3-8B(-Instruct) config.json: 32 layers, hidden 4096, 32 heads, 8 KV heads, head_dim 128,
# intermediate 14336, vocab 128256, untied embeddings, max_position_embeddings 8192; EOS ids 128001
# (<|end_of_text|>) and 128009 (<|eot_id|>, the instruct turn end) from generation_config.json.
LLAMA3_LAYERS, LLAMA3_HIDDEN, LLAMA3_HEADS, LLAMA3_KV_HEADS, LLAMA3_HEAD_DIM = 32, 4096, 32, 8, 128
LLAMA3_INTERMEDIATE, LLAMA3_VOCAB = 14336, 128256
# Per layer: Q and O (hidden x hidden), K and V (hidden x 1024), gate/up/down (hidden x intermediate):
# 218.1M; x32 = 6.98e9 of the model's 8.03e9 parameters, the rest being the embedding and the LM head.
LLAMA3_BLOCK_PARAMS = LLAMA3_LAYERS * (
    2 * LLAMA3_HIDDEN * LLAMA3_HIDDEN
    + 2 * LLAMA3_HIDDEN * LLAMA3_KV_HEADS * LLAMA3_HEAD_DIM
    + 3 * LLAMA3_HIDDEN * LLAMA3_INTERMEDIATE
)
LLAMA3_HEAD_PARAMS = LLAMA3_VOCAB * LLAMA3_HIDDEN
BF16_BYTES = 2
# K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131072 B = 128 KiB per token.
LLAMA3_KV_BYTES_PER_TOKEN = 2 * LLAMA3_LAYERS * LLAMA3_KV_HEADS * LLAMA3_HEAD_DIM * BF16_BYTES
# 80 GB x 0.9 (vLLM's default gpu_memory_utilization) - 16 GB of weights - activations and CUDA
# graphs leaves about 60 GB, about 450k tokens: the order of the KV cache vLLM logs for this setup.
H100_KV_FREE_BYTES = 60 * 10**9
# DGX H100: one ConnectX-7 at 400 Gb/s (50 GB/s) per GPU for the fabric between nodes; RDMA writes of
# large contiguous KV blocks sustain about 90% of line rate. About 1 ms more per transfer for its
# control messages (the decode side naming its blocks, the prefill side's completion notice).
H100_LINK = KvLink(bytes_per_s=0.9 * 400e9 / 8, latency_s=1e-3)
# A few ms of per-step host work (scheduling, input preparation, launches) at decode batch sizes.
H100_STEP_OVERHEAD_S = 2e-3
# Per-sequence host work per step (input rows, output processing, streaming), an estimate that puts a
# 256-sequence decode step in the 30-40 ms TPOT published for this model and GPU at high batch.
H100_HOST_PER_SEQ_S = 10e-6


def h100_cost(
    block_params: int, head_params: int, layers: int, heads: int, head_dim: int, kv_bytes: int
) -> CostModel:
    """A bf16 transformer's coefficients on one H100 from the figures above: `block_params` are the
    parameters every token goes through in the blocks, `head_params` the LM head's.

    For Llama-3-8B (h100-8b) these are what published numbers say:
    - one decode alone: 2 ms + 5.6 ms of weights = ~7.7 ms TPOT (~130 tokens/s single stream);
    - 256 decodes at 1.5k context: ~31 ms TPOT (vLLM/SGLang ballpark at high batch: 30-40 ms);
    - a 2048-token prefill: ~63 ms, ~32k tokens/s of pure prefill. Served prompt throughput in
      published benchmarks (~10-15k tokens/s) is lower because decodes share those steps, which
      the simulator models by running the same scheduler, not by a lower rate here.
    """
    effective_flops = H100_BF16_FLOPS * PREFILL_MFU
    bandwidth = H100_HBM_BYTES_PER_S * HBM_EFFICIENCY
    # Two FLOPs (multiply, add) per parameter per token; the embedding is a lookup, no FLOPs.
    token_s = 2 * block_params / effective_flops
    # Every step streams the blocks and the LM head; the embedding rows it gathers are negligible.
    weights_s = (block_params + head_params) * BF16_BYTES / bandwidth
    # The LM head's GEMM row for each sampled sequence, plus its host-side work.
    sample_s = 2 * head_params / effective_flops + H100_HOST_PER_SEQ_S
    # QK^T and PV: 2 x 2 FLOPs per head dim, per head, per layer, for each causal (query, key) pair.
    attn_pair_s = 4 * layers * heads * head_dim / FLASH_ATTN_FLOPS
    kv_token_s = kv_bytes / bandwidth
    return CostModel(
        step_s=H100_STEP_OVERHEAD_S,
        sample_s=sample_s,
        token_s=token_s,
        weights_s=weights_s,
        attn_pair_s=attn_pair_s,
        kv_token_s=kv_token_s,
    )


H100_8B = Profile(
    name="h100-8b",
    # Llama-3.1-8B: Llama-3-8B's architecture (every figure above holds) with a 128k context, which
    # the Mooncake traces' long prompts (up to 126k tokens) need.
    model_name="Llama-3.1-8B-Instruct",
    vocab_size=LLAMA3_VOCAB,
    eos_token_ids=(128001, 128009),
    max_context_len=131072,
    cost=h100_cost(
        LLAMA3_BLOCK_PARAMS,
        LLAMA3_HEAD_PARAMS,
        LLAMA3_LAYERS,
        LLAMA3_HEADS,
        LLAMA3_HEAD_DIM,
        LLAMA3_KV_BYTES_PER_TOKEN,
    ),
    # This engine's flash-attn paged KV needs a multiple of 256 (docs/design.md §3).
    block_size=256,
    # 60e9 / 131072 = 457,763 tokens (1788 blocks of 256).
    kv_capacity_tokens=H100_KV_FREE_BYTES // LLAMA3_KV_BYTES_PER_TOKEN,
    kv_bytes_per_token=LLAMA3_KV_BYTES_PER_TOKEN,
    # vLLM's token budget for online serving on 80 GB-class GPUs, and its classic max_num_seqs.
    max_num_batched_tokens=8192,
    max_num_seqs=256,
    link=H100_LINK,
    source="derived: NVIDIA H100 SXM datasheet, Llama-3-8B config, FlashAttention-3 paper; see profiles.py",
)

PROFILES: dict[str, Profile] = {p.name: p for p in (CPU_SMOLLM2, H100_8B)}

# For a JSON profile from before these fields. KV bytes per token follow from the model's shape, which
# the built-in profile of the same model knows; for another model, Llama-3-8B's 128 KiB (the common
# 8B shape with grouped-query attention). The link: the loopback estimate, since calibrate measures
# a model on this machine, where workers send KV to one another over loopback.
KV_BYTES_PER_TOKEN_BY_MODEL: dict[str, int] = {p.model_name: p.kv_bytes_per_token for p in PROFILES.values()}
DEFAULT_KV_BYTES_PER_TOKEN = LLAMA3_KV_BYTES_PER_TOKEN
DEFAULT_LINK = CPU_SMOLLM2.link


def get_profile(name_or_path: str) -> Profile:
    """A built-in profile by name, or one written by calibrate, by its JSON path."""
    if name_or_path in PROFILES:
        return PROFILES[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" and path.is_file():
        return profile_from_json(json.loads(path.read_text()))
    raise ValueError(
        f"unknown sim profile {name_or_path!r}: choose one of {', '.join(PROFILES)} or a .json file"
    )


def profile_to_json(profile: Profile) -> dict[str, Any]:
    return dataclasses.asdict(profile)


def profile_from_json(data: dict[str, Any]) -> Profile:
    """A profile from `profile_to_json`'s dict, with the defaults above for the fields that older
    JSON lacks."""
    fields = dict(data)
    fields["cost"] = CostModel(**fields["cost"])
    known = KV_BYTES_PER_TOKEN_BY_MODEL.get(fields["model_name"], DEFAULT_KV_BYTES_PER_TOKEN)
    fields.setdefault("kv_bytes_per_token", known)
    fields["link"] = KvLink(**fields["link"]) if "link" in fields else DEFAULT_LINK
    fields["eos_token_ids"] = tuple(fields["eos_token_ids"])
    return Profile(**fields)
