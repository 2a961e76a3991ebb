"""The expert-parallel step cost and the MoE profiles: all-to-all bytes, weight reads by distinct
experts, the busiest rank, a skewed gate, and KV room as the group grows."""

from __future__ import annotations

import pytest

from workers.engine.batch import ScheduledChunk
from workers.engine.sampling_params import SamplingParams
from workers.sim.cost_model import CostModel, StepShape, chunk_shape
from workers.sim.ep_cost import ExpertParallelCost, all_to_all_bytes
from workers.sim.link import KvLink
from workers.sim.moe_profiles import (
    GPU_MEMORY_UTILIZATION,
    H100_HBM_BYTES,
    MIXTRAL_8X7B,
    QWEN3_30B_A3B,
    RESERVED_BYTES,
    ep_profile,
    kv_tokens_per_gpu,
    min_group,
    weight_bytes_per_gpu,
)
from workers.sim.moe_routing import ExpertLayout, Gate

MIXTRAL = "mixtral-8x7b-h100"
QWEN3 = "qwen3-30b-a3b-h100"
DENSE = CostModel(step_s=2e-3, sample_s=1e-5, token_s=3e-6, weights_s=1e-3, attn_pair_s=1e-9, kv_token_s=5e-8)
LINK = KvLink(bytes_per_s=1e11, latency_s=1e-5)


def group_cost(group: int, gate: Gate | None = None) -> ExpertParallelCost:
    return ExpertParallelCost(
        dense=DENSE,
        layout=ExpertLayout(8, 2, group, gate or Gate()),
        layers=32,
        hidden=4096,
        dtype_bytes=2,
        expert_pair_s=2e-5,
        expert_read_s=4e-3,
        link=LINK,
    )


def chunk(seq_id: int, start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(seq_id, [1] * n, start, [], True, SamplingParams())


def decodes(n: int, context: int) -> StepShape:
    return StepShape(decode_seqs=n, decode_kv_tokens=n * context, sampled=n)


def test_all_to_all_bytes_follow_the_formula_and_vanish_in_a_group_of_one() -> None:
    # tokens x hidden x dtype bytes x top-k x 2 (dispatch + combine) x (G-1)/G
    assert all_to_all_bytes(100, 4096, 2, 2, 8) == 100 * 4096 * 2 * 2 * 2 * 7 / 8
    assert all_to_all_bytes(100, 4096, 2, 2, 2) == 100 * 4096 * 2 * 2
    assert all_to_all_bytes(100, 4096, 2, 2, 1) == 0
    # Per layer, two collectives over the link: their latencies and the busiest sender's bytes.
    ranks = [chunk_shape(0, 100), chunk_shape(0, 40), StepShape()]
    sent = 100 * 4096 * 2 * 2 * 2 * 7 / 8
    assert group_cost(8).terms(ranks).all_to_all_s == pytest.approx(32 * (2 * 1e-5 + sent / 1e11))
    assert group_cost(1).terms([chunk_shape(0, 100)]).all_to_all_s == 0.0
    assert ep_profile(QWEN3, 1).cost.time(chunk_shape(0, 8192)) > 0


def test_a_decode_reads_the_weights_of_the_experts_its_batch_touches() -> None:
    cost = group_cost(1)
    # Weight-bound: every touched expert's weights once, E(1 - (1 - k/E)^b) of them.
    for batch in (1, 2, 4):
        terms = cost.terms([decodes(batch, 1000)])
        assert terms.experts_s == pytest.approx(8 * (1 - 0.75**batch) * 4e-3)
    # Past the ridge (every expert touched, 1600 picks), the FLOPs take over: 2 picks a token.
    assert cost.terms([decodes(2000, 1000)]).experts_s == pytest.approx(4000 * 2e-5)


def test_the_group_waits_for_its_busiest_rank() -> None:
    cost = group_cost(2)
    apart = cost.step_time([chunk(0, 0, 2000), chunk(1, 0, 2000)])
    together = cost.step_time([chunk(0, 0, 2000), chunk(2, 0, 2000)])
    assert together > apart
    # The same tokens meet the same experts either way: only the busiest rank's dense work and
    # all-to-all differ.
    one_rank = cost.terms([chunk_shape(0, 2000) + chunk_shape(0, 2000)])
    two_ranks = cost.terms([chunk_shape(0, 2000), chunk_shape(0, 2000)])
    assert together == pytest.approx(one_rank.total_s) and apart == pytest.approx(two_ranks.total_s)
    assert one_rank.experts_s == two_ranks.experts_s


@pytest.mark.parametrize("group", [2, 4, 8])
def test_a_skewed_gate_is_slower_than_a_uniform_one(group: int) -> None:
    busy = [chunk_shape(0, 8192)] * group
    uniform = ep_profile(MIXTRAL, group).cost.terms(busy)
    skewed = ep_profile(MIXTRAL, group, Gate(zipf=1.0)).cost.terms(busy)
    assert skewed.total_s > 1.2 * uniform.total_s
    assert skewed.imbalance > 1.5 > 1.05 > uniform.imbalance
    assert skewed.dense_s == uniform.dense_s and skewed.all_to_all_s == uniform.all_to_all_s


def test_on_one_gpu_a_skewed_gate_costs_no_more() -> None:
    """With every expert on one rank there is no rank to wait for; the popular experts' tokens even
    touch fewer distinct experts, so a decode reads less."""
    busy, small = [chunk_shape(0, 8192)], [decodes(16, 2048)]
    uniform, skewed = ep_profile(QWEN3, 1).cost, ep_profile(QWEN3, 1, Gate(zipf=1.0)).cost
    assert skewed.terms(busy).total_s == pytest.approx(uniform.terms(busy).total_s)
    assert skewed.terms(small).total_s < uniform.terms(small).total_s


def test_more_gpus_per_group_hold_more_kv_per_replica_and_in_all() -> None:
    groups = (2, 4, 8)
    per_gpu = [kv_tokens_per_gpu(MIXTRAL_8X7B, g) for g in groups]
    per_replica = [ep_profile(MIXTRAL, g).kv_capacity_tokens for g in groups]
    assert per_gpu == sorted(set(per_gpu))
    assert per_replica == sorted(set(per_replica))
    assert per_replica == [g * n for g, n in zip(groups, per_gpu, strict=True)]
    # On 8 GPUs: experts held once over more GPUs leave more of them for KV.
    in_all = [8 // g * n for g, n in zip(groups, per_replica, strict=True)]
    assert in_all == sorted(set(in_all))
    # Mixtral EP2: 72 GB usable - 4 GB reserved - 3.2 GB dense - 45.1 GB of experts, at 128 KiB a token.
    free = H100_HBM_BYTES * GPU_MEMORY_UTILIZATION - RESERVED_BYTES - weight_bytes_per_gpu(MIXTRAL_8X7B, 2)
    assert per_gpu[0] == int(free // (128 * 1024))
    assert 140_000 < per_gpu[0] < 160_000


def test_the_smallest_group_holds_the_weights() -> None:
    # Mixtral's 93 GB of bf16 weights need two H100s; Qwen3-30B-A3B's 61 GB fit on one.
    assert min_group(MIXTRAL_8X7B) == 2 and min_group(QWEN3_30B_A3B) == 1
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        ep_profile(MIXTRAL, 1)
    with pytest.raises(ValueError, match="evenly"):
        ep_profile(MIXTRAL, 3)
    with pytest.raises(ValueError, match="unknown MoE profile"):
        ep_profile("h100-8b", 2)


def test_larger_groups_decode_faster_per_gpu_and_pay_more_all_to_all() -> None:
    """Decodes are bound by reading expert weights, which a larger group splits over more GPUs; the
    all-to-all grows with the share of copies that leave their rank, (G-1)/G."""
    steps = [ep_profile(MIXTRAL, g).cost.terms([decodes(32, 2048)] * g) for g in (2, 4, 8)]
    totals = [t.total_s for t in steps]
    assert totals == sorted(totals, reverse=True)
    assert steps[0].experts_s > steps[0].dense_s
    a2a = [t.all_to_all_s for t in steps]
    assert a2a == sorted(set(a2a))


def test_an_ep_profile_has_its_ranks_budgets() -> None:
    profile = ep_profile(MIXTRAL, 4)
    assert profile.name == "mixtral-8x7b-h100-ep4"
    assert (profile.max_num_batched_tokens, profile.max_num_seqs, profile.max_prefill_chunk) == (
        4 * 8192,
        4 * 256,
        8192,
    )
    assert (
        profile.kv_bytes_per_token == 128 * 1024 and profile.num_blocks == profile.kv_capacity_tokens // 256
    )
