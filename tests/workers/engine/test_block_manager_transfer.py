"""The block pool's side of prefill/decode disaggregation: blocks held for export, room reserved for
KV arriving from another worker, installed as if computed here, and nothing leaked on failure."""

from __future__ import annotations

from radix.hashing import block_hashes
from tests.support.block_managers import MODEL, make_manager, make_seq, prefill
from workers.engine.block_manager import BlockManager


def all_free(bm: BlockManager) -> bool:
    return bm.num_used_blocks == 0 and all(bm.ref_count(b) == 0 for b in range(bm.num_blocks))


def test_prompt_hashes_leave_the_last_token_to_compute() -> None:
    bm, _ = make_manager(8)
    assert bm.prompt_hashes(list(range(8))) == block_hashes(list(range(4)), 4, MODEL)
    assert bm.prompt_hashes(list(range(9))) == block_hashes(list(range(8)), 4, MODEL)
    assert bm.prompt_hashes([1, 2, 3]) == []


def test_hold_pins_the_cached_prefix_against_eviction_until_unhold() -> None:
    bm, _ = make_manager(4)
    seq = make_seq(1, list(range(9)))
    prefill(bm, seq)
    bm.free(seq)
    hashes = block_hashes(list(range(8)), 4, MODEL)
    held = bm.hold([*hashes, 12345])
    assert len(held) == 2 and bm.num_free_blocks == 2
    other = make_seq(2, [50 + i for i in range(15)])
    assert not bm.admit(other, 15)  # 4 blocks needed, the 2 held cannot be evicted
    bm.unhold(held)
    assert bm.admit(other, 15)
    assert bm.cached_hashes().isdisjoint(hashes)


def test_installed_blocks_serve_a_prefix_hit_with_their_events() -> None:
    bm, events = make_manager(8)
    tokens = list(range(11))
    res = bm.reserve(tokens)
    assert res is not None and res.parent is None and res.held == []
    assert res.hashes == block_hashes(tokens[:8], 4, MODEL) and len(res.blocks) == 2
    assert res.tokens == tokens[:8]
    assert bm.num_used_blocks == 2
    bm.install(res, received=2)
    assert all_free(bm) and bm.cached_hashes() == set(res.hashes)
    assert events.log == [("stored", (res.hashes, None))]
    seq = make_seq(1, tokens)
    assert bm.lookup(seq) == 8


def test_reserve_keeps_the_local_prefix_and_asks_only_for_the_rest() -> None:
    bm, events = make_manager(8)
    local = make_seq(1, list(range(5)))
    prefill(bm, local)
    bm.free(local)
    tokens = list(range(13))
    res = bm.reserve(tokens)
    assert res is not None and len(res.held) == 1
    full = block_hashes(tokens[:12], 4, MODEL)
    assert res.parent == full[0] and res.hashes == full[1:] and res.tokens == tokens[4:12]
    bm.install(res, received=2)
    assert events.log[-1] == ("stored", (full[1:], full[0]))
    assert all_free(bm) and bm.cached_hashes() == set(full)


def test_partial_arrival_installs_what_came_and_frees_the_rest() -> None:
    bm, events = make_manager(8)
    tokens = list(range(13))
    res = bm.reserve(tokens)
    assert res is not None
    bm.install(res, received=1)
    assert all_free(bm) and bm.num_free_blocks == 8
    assert bm.cached_hashes() == set(block_hashes(tokens[:4], 4, MODEL))
    assert events.log == [("stored", (res.hashes[:1], None))]


def test_a_hash_computed_here_meanwhile_keeps_its_block() -> None:
    bm, events = make_manager(8)
    tokens = list(range(9))
    res = bm.reserve(tokens)
    assert res is not None
    local = make_seq(1, tokens)
    prefill(bm, local)  # the same prompt computed here while the transfer ran
    registered = {h: b for h, b in zip(res.hashes, local.block_table, strict=False)}
    bm.install(res, received=2)
    stored = [e for e in events.log if e[0] == "stored"]
    assert len(stored) == 1, "no duplicate event for blocks computed here"
    bm.free(local)
    assert all_free(bm) and bm.cached_hashes() == set(registered)


def test_release_after_failure_leaks_nothing_and_registers_nothing() -> None:
    bm, events = make_manager(8)
    held = make_seq(1, list(range(5)))
    prefill(bm, held)
    bm.free(held)
    res = bm.reserve(list(range(17)))
    assert res is not None and bm.num_used_blocks == 4
    bm.release(res)
    assert all_free(bm) and len(bm.cached_hashes()) == 1
    assert [e[0] for e in events.log] == ["stored"]


def test_reserve_refuses_without_room_and_changes_nothing() -> None:
    bm, _ = make_manager(3)
    seq = make_seq(1, list(range(5)))
    prefill(bm, seq)  # holds 2 blocks
    before = bm.num_free_blocks
    assert bm.reserve(list(range(100, 117))) is None
    assert bm.num_free_blocks == before
    bm.free(seq)
    assert all_free(bm)


def test_events_replay_to_the_registered_set() -> None:
    bm, events = make_manager(6)
    for start in (0, 40, 80):
        res = bm.reserve([start + i for i in range(13)])
        assert res is not None
        bm.install(res, received=len(res.blocks))
    assert events.held == set(bm.cached_hashes())
    assert len(events.held) == 6
