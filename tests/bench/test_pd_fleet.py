"""The prefill/decode simulator: KV that really moves between the replicas' block pools, at the link's
speed, decode replicas spared the long prefills, and every block back in its pool at the end."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.latency import RequestLatency
from bench.pd_fleet import PdFleet, Split, parse_splits
from bench.workloads import LongMixParams, Session, Turn, longmix_sessions
from radix import block_hashes
from workers.sim.cost_model import chunk_shape
from workers.sim.profiles import H100_8B, Profile

BS = 16
# The 8B model on an H100 with blocks of 16 and a pool of 4096 blocks: small prompts still span many
# blocks, and a small pool is quick to fill where a test wants it full.
PROFILE = replace(H100_8B, block_size=BS, kv_capacity_tokens=4096 * BS)


def ids(start: int, n: int) -> list[int]:
    return list(range(1000 + start, 1000 + start + n))


def one_turn(start_s: float, prompt: list[int], max_tokens: int) -> Session:
    return Session(start_s, (Turn(tuple(prompt), max_tokens),))


def usable_hashes(profile: Profile, prompt: list[int]) -> list[int]:
    usable = (len(prompt) - 1) // profile.block_size
    return block_hashes(prompt, profile.block_size, profile.model_name)[:usable]


def pools_all_free(fleet: PdFleet) -> bool:
    for r in fleet.replicas:
        bm = r.engine.block_manager
        if bm.num_used_blocks or any(bm.ref_count(b) for b in range(bm.num_blocks)):
            return False
    return True


def test_transferred_prompt_serves_later_prefix_hits_on_the_decode_replica() -> None:
    doc = ids(0, 1000)
    longer = doc + ids(5000, 500)
    sessions = [one_turn(0.0, doc, 4), one_turn(100.0, longer, 4), one_turn(200.0, doc, 4)]
    fleet = PdFleet(sessions, PROFILE, Split(1, 1))
    result = fleet.run()
    assert result.routes == {"transfer": 2, "decode_cached": 1}
    first, second, third = result.latencies
    per_block = BS * PROFILE.kv_bytes_per_token
    assert first.transfer_bytes == len(usable_hashes(PROFILE, doc)) * per_block
    # Only the blocks past what the decode replica got the first time move.
    moved = len(usable_hashes(PROFILE, longer)) - len(usable_hashes(PROFILE, doc))
    assert second.transfer_bytes == moved * per_block
    # The same prompt again: all of it is there, nothing moves, no prefill replica is asked.
    assert third.transfer_bytes == 0 and third.transfer_s == 0.0
    decode = fleet.decode[0].engine.block_manager
    assert set(usable_hashes(PROFILE, longer)) <= decode.cached_hashes()
    assert pools_all_free(fleet)


def test_transfer_time_is_the_bytes_over_the_link_bandwidth_and_adds_to_ttft() -> None:
    prompt = ids(0, 2000)
    sessions = [one_turn(0.0, prompt, 8)]
    fast = PdFleet(sessions, PROFILE, Split(1, 1)).run().latencies[0]
    slow_link = replace(PROFILE.link, bytes_per_s=PROFILE.link.bytes_per_s / 10)
    slow = PdFleet(sessions, replace(PROFILE, link=slow_link), Split(1, 1)).run().latencies[0]
    assert fast.transfer_bytes == slow.transfer_bytes == len(usable_hashes(PROFILE, prompt)) * BS * 128 * 1024
    assert fast.transfer_s == pytest.approx(PROFILE.link.time(fast.transfer_bytes))
    assert slow.transfer_s == pytest.approx(slow_link.time(slow.transfer_bytes))
    assert slow.ttft_s - fast.ttft_s == pytest.approx(slow.transfer_s - fast.transfer_s)
    # On an idle fleet: the prefill of the reusable blocks, the transfer, then one step on the decode
    # replica computing only the tail past them (the transferred blocks are its prefix-cache hit).
    reusable = len(usable_hashes(PROFILE, prompt)) * BS
    prefill = PROFILE.cost.time(chunk_shape(0, reusable))
    tail = PROFILE.cost.time(chunk_shape(reusable, len(prompt) - reusable))
    assert fast.ttft_s == pytest.approx(prefill + fast.transfer_s + tail)


def test_a_transfer_waits_while_the_link_is_busy_with_the_one_before() -> None:
    """Two prompts prefilled one after the other, on a link slower than their prefills: the second
    transfer starts when the first ends, not when its own prefill does."""
    prompt_a, prompt_b = ids(0, 2000), ids(9000, 2000)
    slow = replace(PROFILE, link=replace(PROFILE.link, bytes_per_s=PROFILE.link.bytes_per_s / 100))
    a, b = (
        PdFleet([one_turn(0.0, prompt_a, 4), one_turn(0.01, prompt_b, 4)], slow, Split(1, 1)).run().latencies
    )
    send = slow.link.time(a.transfer_bytes)
    prefill = slow.cost.time(chunk_shape(0, len(usable_hashes(slow, prompt_a)) * BS))
    assert send > prefill
    assert a.transfer_s == pytest.approx(send)
    # a's transfer ends at prefill + send; b's prefill ends at 2 * prefill and waits for it.
    assert b.transfer_s == pytest.approx(2 * send - prefill)


def test_long_prefills_stall_the_decodes_of_a_mixed_replica_not_those_of_a_decode_replica() -> None:
    decoders = [one_turn(0.0, ids(100 * i, 300), 400) for i in range(2)]
    long_prompts = [one_turn(0.5 + 0.25 * i, ids(10_000 * (i + 1), 8000), 2) for i in range(16)]
    sessions = decoders + long_prompts
    mixed = PdFleet(sessions, PROFILE, Split(2, 0))
    split = PdFleet(sessions, PROFILE, Split(1, 1))
    mixed_result, split_result = mixed.run(), split.run()
    assert split_result.routes["transfer"] == len(sessions)
    assert split_result.summary.itl_p99_s < mixed_result.summary.itl_p99_s
    # No gap on the decode replica is as long as one step computing a long prompt; on the mixed
    # replicas some are.
    long_prefill = PROFILE.cost.time(chunk_shape(0, 8000))
    assert max(split.gaps) < long_prefill <= max(mixed.gaps)


# 160 blocks: a first request of 320 + 2000 tokens grows to 145 blocks as it decodes on the decode
# replica; a 1600-token prompt arriving at 10 s needs 99 more, which it cannot reserve until the first
# request ends (about 16 s in).
TIGHT = replace(PROFILE, kv_capacity_tokens=160 * BS)
LONG_DECODE = one_turn(0.0, ids(0, 320), 2000)
BLOCKED = ids(50_000, 1600)


def last_token_s(latency: RequestLatency, arrival_s: float, tokens: int) -> float:
    assert latency.mean_itl_s is not None
    return arrival_s + latency.ttft_s + (tokens - 1) * latency.mean_itl_s


def test_a_decode_replica_without_room_waits_for_its_steps_to_free_blocks_then_receives() -> None:
    fleet = PdFleet([LONG_DECODE, one_turn(10.0, BLOCKED, 4)], TIGHT, Split(1, 1))
    result = fleet.run()
    assert result.routes == {"transfer": 2}
    first, second = result.latencies
    # It reserves right after the step that ends the first request, and only then is prefilled.
    freed_s = last_token_s(first, 0.0, 2000)
    assert freed_s > 10.0 + 5.0
    assert second.reserve_wait_s == pytest.approx(freed_s - 10.0)
    assert second.ttft_s > second.reserve_wait_s + second.transfer_s > second.reserve_wait_s
    assert second.transfer_bytes == len(usable_hashes(TIGHT, BLOCKED)) * BS * TIGHT.kv_bytes_per_token
    assert set(usable_hashes(TIGHT, BLOCKED)) <= fleet.prefill[0].engine.block_manager.cached_hashes()
    assert result.summary.reserve_wait_share > 0
    assert pools_all_free(fleet)


@pytest.mark.parametrize("bound_s", [0.0, 2.0])
def test_past_the_bound_the_decode_replica_computes_the_prompt_itself(bound_s: float) -> None:
    fleet = PdFleet([LONG_DECODE, one_turn(10.0, BLOCKED, 4)], TIGHT, Split(1, 1), reserve_wait_s=bound_s)
    result = fleet.run()
    assert result.routes == {"transfer": 1, "no_room": 1}
    second = result.latencies[1]
    # It gives up at its deadline, not at the next step after it; the wait is part of its TTFT.
    assert second.reserve_wait_s == pytest.approx(bound_s)
    assert second.ttft_s > bound_s and second.transfer_bytes == 0
    hashes = set(usable_hashes(TIGHT, BLOCKED))
    assert hashes <= fleet.decode[0].engine.block_manager.cached_hashes()
    assert hashes.isdisjoint(fleet.prefill[0].engine.block_manager.cached_hashes())
    assert pools_all_free(fleet)


def test_waiting_reservations_are_first_come_first_served() -> None:
    """A smaller prompt that would fit waits behind the blocked one that came first."""
    small = ids(90_000, 640)
    sessions = [LONG_DECODE, one_turn(10.0, BLOCKED, 4), one_turn(11.0, small, 4)]
    result = PdFleet(sessions, TIGHT, Split(1, 1)).run()
    assert result.routes == {"transfer": 3}
    first = result.latencies[0]
    blocked, late = sorted(result.latencies[1:], key=lambda r: -r.transfer_bytes)
    freed_s = last_token_s(first, 0.0, 2000)
    assert blocked.reserve_wait_s == pytest.approx(freed_s - 10.0)
    assert late.reserve_wait_s == pytest.approx(freed_s - 11.0)
    # Alone, it finds room at once.
    (_, alone) = PdFleet([LONG_DECODE, one_turn(11.0, small, 4)], TIGHT, Split(1, 1)).run().latencies
    assert alone.reserve_wait_s == 0.0


def test_the_bound_is_a_non_negative_number_of_seconds() -> None:
    with pytest.raises(ValueError, match="reserve_wait_s"):
        PdFleet([LONG_DECODE], TIGHT, Split(1, 1), reserve_wait_s=-1.0)


@pytest.mark.parametrize("split", ["2:0", "1:1"])
def test_every_pool_is_all_free_after_a_run_and_the_index_agrees_with_the_pools(split: str) -> None:
    params = LongMixParams(
        requests=24,
        min_prompt_tokens=600,
        max_prompt_tokens=2400,
        documents=2,
        document_tokens=400,
        min_output_tokens=20,
        max_output_tokens=80,
        rate=8.0,
    )
    (parsed,) = parse_splits([split])
    fleet = PdFleet(longmix_sessions(params), replace(PROFILE, kv_capacity_tokens=400 * BS), parsed)
    result = fleet.run()
    assert result.summary.completed == params.requests
    assert pools_all_free(fleet)
    for r in fleet.replicas:
        cached = r.engine.block_manager.cached_hashes()
        assert all(fleet.index.holds(r.id, h) for h in cached)
        assert fleet.index.blocks_of(r.id) == len(cached)


def test_refused_requests_count_against_goodput() -> None:
    too_long = ids(0, PROFILE.max_context_len)
    sessions = [one_turn(0.0, ids(0, 300), 4), one_turn(0.0, too_long, 4)]
    result = PdFleet(sessions, PROFILE, Split(1, 1)).run()
    assert result.routes["rejected"] == 1
    assert result.summary.completed == 1 and result.summary.goodput_share == 0.5


def test_splits_parse_from_lists_and_repeats() -> None:
    splits = parse_splits(["4:0,3:1", "2:2"])
    assert [s.name for s in splits] == ["4 mixed", "3P:1D", "2P:2D"]
    assert {s.replicas for s in splits} == {4}
    for bad in ("4", "a:b", "0:4", "3:-1"):
        with pytest.raises(ValueError):
            parse_splits([bad])
