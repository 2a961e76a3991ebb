"""pd: prefill/decode pairs. The prefill replica by prefix affinity against queued prefill (prefix_aware's
ranking), the decode replica by when it could start, counting its own cached prefix, and its sequences;
mixed replicas beside them; what an empty or partial pool leaves."""

from __future__ import annotations

from collections import Counter

import pytest

from policies import Pair, PdConfig, PrefillDecode, ReplicaView, RouteRequest
from policies.prefix_aware import PrefixAware, PrefixAwareConfig

PROMPT = RouteRequest(prompt_tokens=4000, prefix_key=7)


def prefill(rid: str, **fields: object) -> ReplicaView:
    return ReplicaView(id=rid, role="prefill", **fields)  # type: ignore[arg-type]


def decode(rid: str, **fields: object) -> ReplicaView:
    return ReplicaView(id=rid, role="decode", **fields)  # type: ignore[arg-type]


def test_the_prefill_replica_is_the_one_holding_the_prefix() -> None:
    fleet = [prefill("p1"), prefill("p2", matched_blocks=200), decode("d")]
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("d", "p2")]


def test_a_long_prefill_queue_outweighs_a_short_cached_prefix() -> None:
    fleet = [prefill("p1", matched_blocks=20, queued_prefill_tokens=60_000), prefill("p2"), decode("d")]
    assert PrefillDecode().choose(PROMPT, fleet)[0].prefill == "p2"


def test_among_decode_replicas_that_all_need_a_transfer_the_fewest_sequences_win() -> None:
    fleet = [
        prefill("p"),
        decode("d1", running=12),
        decode("d2", running=3, waiting=1),
        decode("d3", running=9),
    ]
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("d2", "p"), Pair("d3", "p"), Pair("d1", "p")]


def test_a_prompt_mostly_on_a_decode_replica_needs_no_prefill_replica() -> None:
    # 3,904 of 4,000 tokens cached on d1: it computes the 96 left itself, though it runs more.
    fleet = [prefill("p"), decode("d1", matched_blocks=244, running=5), decode("d2")]
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("d1", None), Pair("d2", "p")]


def test_a_decode_replica_far_busier_than_the_others_does_not_keep_its_prefix() -> None:
    # Holding the prompt saves 0.4 s of prefill; 60 more sequences cost 0.6 s.
    fleet = [prefill("p"), decode("d1", matched_blocks=244, running=60), decode("d2")]
    assert PrefillDecode().choose(PROMPT, fleet)[0] == Pair("d2", "p")


@pytest.mark.parametrize(("cached_blocks", "paired"), [(235, None), (234, "p")])
def test_below_min_transfer_tokens_uncached_the_decode_replica_computes_them(
    cached_blocks: int, paired: str | None
) -> None:
    # 4,000 - 235 * 16 = 240 tokens uncached: below 256, computed there; 256 are worth a transfer.
    fleet = [prefill("p"), decode("d", matched_blocks=cached_blocks)]
    assert PrefillDecode(PdConfig(min_transfer_tokens=256)).choose(PROMPT, fleet) == [Pair("d", paired)]


def test_a_decode_replica_without_kv_room_for_the_prompt_ranks_last() -> None:
    # The prompt needs 250 blocks on a decode replica that holds none of it.
    fleet = [prefill("p"), decode("idle", free_blocks=249), decode("busy", running=30, free_blocks=5000)]
    assert [pair.decode for pair in PrefillDecode().choose(PROMPT, fleet)] == ["busy", "idle"]


def test_a_decode_replica_at_its_queue_limit_ranks_last() -> None:
    fleet = [prefill("p"), decode("full", waiting=8, max_waiting=8), decode("busy", running=40)]
    assert [pair.decode for pair in PrefillDecode().choose(PROMPT, fleet)] == ["busy", "full"]


def test_mixed_replicas_compete_with_pairs_on_when_they_would_start() -> None:
    # An idle mixed replica computes the prompt itself (0.4 s); the pair's prefill replica has 2 s queued.
    fleet = [prefill("p", queued_prefill_tokens=20_000), decode("d"), ReplicaView(id="m")]
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("m", None), Pair("d", "p")]
    # Once the mixed replica holds a long queue of its own, the pair starts sooner.
    fleet[2] = ReplicaView(id="m", queued_prefill_tokens=40_000)
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("d", "p"), Pair("m", None)]


def test_a_retry_goes_to_the_next_pair() -> None:
    fleet = [prefill("p1", matched_blocks=100), prefill("p2"), decode("d1"), decode("d2", running=1)]
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("d1", "p1"), Pair("d2", "p2")]


def test_without_a_prefill_pool_decode_replicas_compute_prompts_themselves() -> None:
    fleet = [prefill("p", healthy=False), decode("d1"), decode("d2", running=1)]
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("d1", None), Pair("d2", None)]


def test_a_route_that_cannot_name_a_prefill_replica_is_not_paired() -> None:
    fleet = [prefill("p"), decode("d")]
    assert PrefillDecode().choose(PROMPT, fleet, transfer=False) == [Pair("d", None)]


def test_a_prefill_pool_alone_answers_no_client() -> None:
    assert PrefillDecode().choose(PROMPT, [prefill("p1"), prefill("p2"), decode("d", healthy=False)]) == []


def test_a_decode_replica_that_cannot_prefill_is_always_paired_and_left_out_without_a_prefill() -> None:
    sglang = {"pd_protocol": "sglang"}
    short = RouteRequest(prompt_tokens=32)
    fleet = [prefill("p", **sglang), decode("d", local_prefill=False, **sglang)]
    assert PrefillDecode().choose(short, fleet) == [Pair("d", "p")]
    assert PrefillDecode().choose(short, fleet, transfer=False) == []


def test_replicas_pair_only_within_their_transfer_protocol() -> None:
    fleet = [
        prefill("ours", matched_blocks=200),
        prefill("vllm-p", pd_protocol="vllm"),
        decode("vllm-d", pd_protocol="vllm", running=1),
        decode("our-d", running=2),
    ]
    # Our decode worker starts soonest (its prefill worker holds most of the prompt), but the vLLM
    # decode instance is paired with the vLLM prefill instance all the same.
    assert PrefillDecode().choose(PROMPT, fleet) == [Pair("our-d", "ours"), Pair("vllm-d", "vllm-p")]


def test_ties_between_decode_replicas_spread_by_prefix_and_stay_with_it() -> None:
    fleet = [prefill("p"), *(decode(f"d{i}") for i in range(4))]
    pd = PrefillDecode()
    firsts = Counter(pd.choose(RouteRequest(4000, prefix_key=key), fleet)[0].decode for key in range(400))
    assert set(firsts) == {"d0", "d1", "d2", "d3"} and min(firsts.values()) >= 60
    again = {pd.choose(RouteRequest(4000, prefix_key=11), fleet)[0].decode for _ in range(5)}
    assert len(again) == 1


def test_the_prefill_ranking_takes_prefix_aware_knobs() -> None:
    # Without the recompute penalty, a 1,000-token queue outweighs 1,600 cached tokens.
    fleet = [prefill("holder", matched_blocks=100, queued_prefill_tokens=3_000), prefill("idle"), decode("d")]
    lenient = PrefillDecode(prefill=PrefixAware(PrefixAwareConfig(recompute_penalty=0.0)))
    assert lenient.choose(RouteRequest(2000), fleet)[0].prefill == "idle"
    assert PrefillDecode().choose(RouteRequest(2000), fleet)[0].prefill == "holder"
