"""The KV block pool: prefix sharing, LRU eviction, event consistency and the absence of leaks."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radix.hashing import block_hashes
from tests.support.block_managers import MODEL, make_manager, make_seq, prefill
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import Sequence


def test_full_blocks_register_under_the_gateway_hashes() -> None:
    bm, events = make_manager(8)
    tokens = list(range(10))
    seq = make_seq(1, tokens)
    prefill(bm, seq)
    expected = block_hashes(tokens, 4, MODEL)
    assert len(expected) == 2
    assert bm.cached_hashes() == set(expected)
    assert events.log == [("stored", (expected, None))]


def test_two_sequences_sharing_a_prefix_share_its_blocks() -> None:
    bm, _ = make_manager(16)
    a = make_seq(1, [*range(8), 100, 101, 102, 103, 104])
    prefill(bm, a)
    b = make_seq(2, [*range(8), 200, 201, 202])
    assert bm.lookup(b) == 8
    assert bm.admit(b, b.num_tokens)
    assert b.num_computed_tokens == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert [bm.ref_count(blk) for blk in b.block_table[:2]] == [2, 2]
    assert b.block_table[2] not in a.block_table
    assert bm.ref_count(a.block_table[2]) == 1
    # 4 blocks for a, 1 more for b's own tail.
    assert bm.num_used_blocks == 5
    bm.free(a)
    assert [bm.ref_count(blk) for blk in b.block_table[:2]] == [1, 1]
    bm.free(b)
    assert bm.num_used_blocks == 0


def test_free_releases_every_block_but_keeps_full_ones_cached() -> None:
    bm, events = make_manager(8)
    seq = make_seq(1, list(range(14)))
    prefill(bm, seq)
    blocks = list(seq.block_table)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert all(bm.ref_count(blk) == 0 for blk in blocks)
    assert bm.num_free_blocks == bm.num_blocks and bm.num_used_blocks == 0 and bm.usage == 0.0
    assert bm.cached_hashes() == set(block_hashes(list(range(14)), 4, MODEL)) == events.held


def test_a_full_prompt_hit_still_computes_the_last_token() -> None:
    bm, events = make_manager(8)
    tokens = list(range(8))
    first = make_seq(1, tokens)
    prefill(bm, first)
    head = first.block_table[0]
    bm.free(first)
    again = make_seq(2, tokens)
    # Both blocks are cached, but the last block is recomputed so the runner has logits to sample.
    assert bm.lookup(again) == 4
    assert bm.admit(again, 8)
    assert again.num_computed_tokens == 4
    assert again.block_table[0] == head
    bm.mark_computed(again, 4)
    # The recomputed copy of block 2 is a duplicate: the mapping and the event stream stay as they were.
    assert [kind for kind, _ in events.log] == ["stored"]
    assert bm.cached_hashes() == set(block_hashes(tokens, 4, MODEL))
    bm.free(again)
    assert bm.num_free_blocks == 8


def test_a_partial_last_block_leaves_all_full_blocks_reusable() -> None:
    bm, _ = make_manager(8)
    prefill_and_free(bm, list(range(8)))
    assert bm.lookup(make_seq(2, list(range(9)))) == 8


def prefill_and_free(bm: BlockManager, tokens: list[int], seq_id: int = 1) -> Sequence:
    seq = make_seq(seq_id, tokens)
    prefill(bm, seq)
    bm.free(seq)
    return seq


@pytest.mark.parametrize("prompt_len", [8, 10])
def test_fork_shares_the_full_prompt_blocks_by_reference(prompt_len: int) -> None:
    bm, events = make_manager(16)
    tokens = list(range(prompt_len))
    parent = make_seq(1, tokens)
    prefill(bm, parent)
    parent.append_token(500)
    kids = [make_seq(i, tokens) for i in (2, 3)]
    used, logged = bm.num_used_blocks, len(events.log)
    for kid in kids:
        bm.fork(parent, kid)
    full = prompt_len // 4
    for kid in kids:
        assert kid.block_table == parent.block_table[:full] and kid.num_computed_tokens == full * 4
        assert kid.block_hashes == block_hashes(tokens, 4, MODEL)[:full]
    # Nothing copied, nothing registered: only the reference counts of the full blocks moved.
    assert [bm.ref_count(b) for b in parent.block_table] == [3] * full + [1] * (prompt_len % 4 > 0)
    assert (bm.num_used_blocks, len(events.log)) == (used, logged)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.fork(parent, kids[0])
    # A kid writes the prompt's tail and its own first token into a block of its own.
    kid = kids[0]
    kid.append_token(600)
    assert bm.grow(kid, kid.num_tokens)
    bm.mark_computed(kid, kid.num_tokens - kid.num_computed_tokens)
    assert kid.block_table[full:] and not set(kid.block_table[full:]) & set(parent.block_table)
    for seq in (parent, *kids):
        bm.free(seq)
    assert bm.num_used_blocks == 0 and bm.cached_hashes() == events.held


def test_eviction_is_lru_and_takes_a_prefix_tail_first() -> None:
    bm, events = make_manager(4)
    a_tokens = [1] * 8
    b_tokens = [2] * 8
    prefill_and_free(bm, a_tokens, 1)
    prefill_and_free(bm, b_tokens, 2)
    a0, a1 = block_hashes(a_tokens, 4, MODEL)
    b0, b1 = block_hashes(b_tokens, 4, MODEL)
    events.log.clear()
    # Every block is cached and unreferenced; a's were released first, each prefix tail first.
    c = make_seq(3, [3] * 9)
    assert bm.admit(c, 8)
    assert events.log == [("removed", [a1, a0])]
    assert bm.cached_hashes() == {b0, b1}
    assert bm.admit(make_seq(4, [4] * 5), 4)
    assert events.log[-1] == ("removed", [b1])


def test_reuse_refreshes_recency() -> None:
    bm, events = make_manager(5)
    a_tokens = [1] * 8
    b_tokens = [2] * 8
    prefill_and_free(bm, a_tokens, 1)
    prefill_and_free(bm, b_tokens, 2)
    # a's head block is used again, so b's blocks are now the least recently used.
    prefill_and_free(bm, [*a_tokens[:4], 7], 3)
    a0, a1 = block_hashes(a_tokens, 4, MODEL)
    b0, b1 = block_hashes(b_tokens, 4, MODEL)
    events.log.clear()
    # The never-used block goes first, then the LRU: a's tail, then b tail first; a's head stays.
    assert bm.admit(make_seq(4, [5] * 17), 16)
    assert events.log == [("removed", [a1, b1, b0])]
    assert bm.cached_hashes() == {a0}


def test_concurrent_identical_prompts_register_each_hash_once() -> None:
    bm, events = make_manager(8)
    tokens = list(range(9))
    a, b = make_seq(1, tokens), make_seq(2, tokens)
    # Both are admitted before either has computed anything, so neither can reuse the other.
    assert bm.admit(a, 9) and bm.admit(b, 9)
    assert set(a.block_table).isdisjoint(b.block_table)
    bm.mark_computed(a, 9)
    bm.mark_computed(b, 9)
    assert len(events.log) == 1
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 8
    # b's private copies went straight back to the free list: nothing is evicted to reuse them.
    assert bm.admit(make_seq(3, [9] * 24), 24)
    assert len(events.log) == 1


def test_blocks_filled_by_decoding_extend_the_chain() -> None:
    bm, events = make_manager(8)
    seq = make_seq(1, [5, 6, 7, 8, 9, 10])
    prefill(bm, seq)
    first = block_hashes(seq.prompt_token_ids, 4, MODEL)
    assert events.log == [("stored", (first, None))]
    for token in (11, 12, 13):
        seq.append_token(token)
        assert bm.grow(seq, seq.num_tokens)
        bm.mark_computed(seq, 1)
    # The second block (positions 4-7) fills once the sampled 12 is computed, continuing the chain.
    full = block_hashes([5, 6, 7, 8, 9, 10, 11, 12, 13], 4, MODEL)
    assert events.log[-1] == ("stored", ([full[1]], full[0]))
    assert bm.cached_hashes() == set(full)


def test_refused_admission_and_growth_change_nothing() -> None:
    bm, events = make_manager(3)
    prefill_and_free(bm, [1] * 8)
    a = make_seq(2, [2] * 4)
    assert bm.admit(a, 4)
    events.log.clear()
    before = (bm.num_free_blocks, bm.cached_hashes())
    big = make_seq(3, [3] * 12)
    assert not bm.admit(big, 12)
    assert big.block_table == []
    assert not bm.grow(a, 16)
    assert len(a.block_table) == 1
    assert (bm.num_free_blocks, bm.cached_hashes()) == before and events.log == []


def test_a_hit_on_unreferenced_blocks_counts_them_against_the_free_pool() -> None:
    bm, _ = make_manager(3)
    prefill_and_free(bm, [1] * 8)
    # 2 cached blocks are revived and 2 more are needed: only 1 is left once the hit is taken.
    seq = make_seq(2, [1] * 8 + [2] * 8)
    assert bm.lookup(seq) == 8
    assert not bm.admit(seq, 16)
    assert bm.admit(seq, 12)
    assert bm.num_free_blocks == 0


def test_reset_clears_the_cache_but_not_blocks_in_use() -> None:
    bm, events = make_manager(8)
    prefill_and_free(bm, list(range(8)))
    running = make_seq(2, list(range(100, 108)))
    prefill(bm, running)
    bm.reset()
    assert events.log[-1] == ("cleared", None)
    assert bm.cached_hashes() == frozenset()
    assert bm.num_used_blocks == 2
    assert bm.lookup(make_seq(3, list(range(9)))) == 0
    bm.free(running)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 0


def test_admit_rejects_a_chunk_that_does_not_pass_the_cached_prefix() -> None:
    bm, _ = make_manager(8)
    prefill_and_free(bm, list(range(8)))
    with pytest.raises(ValueError):
        bm.admit(make_seq(2, list(range(12))), 8)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random interleavings of admission, chunked compute, decoding, release and flushes.

    A shadow KV store stands in for the attention kernels: each computed position is written into
    the block the table names, so a wrong reuse (a stale or foreign block handed out as a cached
    prefix) shows up as wrong tokens under a live sequence.
    """

    def __init__(self) -> None:
        super().__init__()
        self.seqs: dict[int, Sequence] = {}
        self.next_id = 0
        self.kv: dict[int, list[int | None]] = {}

    @initialize(num_blocks=st.integers(2, 12), block_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm, self.events = make_manager(num_blocks, block_size)
        self.bs = block_size

    def compute(self, seq: Sequence, n: int) -> None:
        start = seq.num_computed_tokens
        for pos, token in enumerate(seq.token_slice(start, start + n), start):
            block = seq.block_table[pos // self.bs]
            self.kv.setdefault(block, [None] * self.bs)[pos % self.bs] = token
        self.bm.mark_computed(seq, n)

    @rule(
        family=st.integers(0, 2),
        head=st.integers(0, 12),
        tail=st.lists(st.integers(0, 2), max_size=8),
        data=st.data(),
    )
    def admit(self, family: int, head: int, tail: list[int], data: st.DataObject) -> None:
        tokens = [10 + family] * head + tail
        if not tokens:
            return
        seq = make_seq(self.next_id, tokens)
        self.next_id += 1
        cached = self.bm.lookup(seq)
        assert cached % self.bs == 0 and cached < seq.num_tokens
        n = data.draw(st.integers(1, seq.num_tokens - cached), label="first chunk")
        if not self.bm.admit(seq, cached + n):
            assert seq.block_table == [] and seq.num_computed_tokens == 0
            return
        assert seq.num_computed_tokens == cached
        assert len(seq.block_table) == self.bm.blocks_for(cached + n)
        self.seqs[seq.seq_id] = seq
        self.compute(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), n=st.integers(1, 6), token=st.integers(0, 2))
    def advance(self, data: st.DataObject, n: int, token: int) -> None:
        seq = self.seqs[data.draw(st.sampled_from(sorted(self.seqs)), label="seq")]
        if seq.num_uncomputed_tokens == 0:
            seq.append_token(token)
        n = min(n, seq.num_uncomputed_tokens)
        if self.bm.grow(seq, seq.num_computed_tokens + n):
            self.compute(seq, n)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.sampled_from(sorted(self.seqs)), label="seq"))
        self.bm.free(seq)

    @rule()
    def flush(self) -> None:
        self.bm.reset()

    @invariant()
    def events_replay_to_the_cached_set(self) -> None:
        assert self.events.held == self.bm.cached_hashes()

    @invariant()
    def reference_counts_match_the_block_tables(self) -> None:
        holders = [0] * self.bm.num_blocks
        for seq in self.seqs.values():
            assert len(set(seq.block_table)) == len(seq.block_table)
            for block in seq.block_table:
                holders[block] += 1
        assert holders == [self.bm.ref_count(b) for b in range(self.bm.num_blocks)]
        in_use = sum(1 for count in holders if count)
        assert self.bm.num_used_blocks == in_use
        assert self.bm.num_free_blocks + in_use == self.bm.num_blocks
        assert self.bm.num_cached_blocks <= self.bm.num_blocks

    @invariant()
    def every_sequence_reads_its_own_tokens(self) -> None:
        for seq in self.seqs.values():
            tokens = seq.token_slice(0, seq.num_computed_tokens)
            for pos, token in enumerate(tokens):
                assert self.kv[seq.block_table[pos // self.bs]][pos % self.bs] == token

    @invariant()
    def hash_chains_are_the_gateway_hashes(self) -> None:
        for seq in self.seqs.values():
            known = len(seq.block_hashes)
            assert seq.block_hashes == block_hashes(seq.token_slice(0, known * self.bs), self.bs, MODEL)

    @invariant()
    def nothing_leaks_once_every_sequence_is_gone(self) -> None:
        if not self.seqs:
            assert self.bm.num_used_blocks == 0
            assert self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.pytestmark = [pytest.mark.fuzz]
