"""Continuous batching: budgets, chunked prefill, FCFS, preemption, aborts, stop conditions, n > 1
choices forked off one prefill, no leaks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.batch import ScheduledChunk, StepOutput
from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, UnschedulableSequence
from workers.engine.sequence import Sequence, SequenceStatus

MODEL = "test-model"
EOS = 2


def default_token(seq_id: int, index: int) -> int:
    """The fake model's output: a function of the sequence and position only, and never EOS."""
    return 1000 + (seq_id * 31 + index * 7) % 97


class FakeRunner:
    """Stands in for the model runner. It keeps a shadow of the paged KV cache and checks what a
    real runner relies on: the chunk is the next run of the sequence's tokens, the block table
    covers it, and every earlier position already holds the right token in the block the table
    names (so a wrong prefix reuse or a lost block after preemption is caught). Its tokens are
    deterministic, so the output is known whatever preemption and chunking happened. A fork samples
    its first token at its parent's chunk, as the model runner does."""

    def __init__(self, block_size: int, token: Callable[[int, int], int] = default_token) -> None:
        self.block_size = block_size
        self.token = token
        self.prompts: dict[int, list[int]] = {}
        self.kv: dict[int, list[int | None]] = {}

    def expected(self, seq_id: int, num_generated: int) -> list[int]:
        return self.prompts[seq_id] + [self.token(seq_id, i) for i in range(num_generated)]

    def step(self, chunks: list[ScheduledChunk]) -> list[StepOutput]:
        bs = self.block_size
        outputs: list[StepOutput] = []
        for chunk in chunks:
            tokens = self.expected(chunk.seq_id, chunk.num_generated)
            end = chunk.start_pos + len(chunk.token_ids)
            assert chunk.token_ids and end <= len(tokens)
            assert chunk.token_ids == tokens[chunk.start_pos : end]
            assert chunk.sample == (end == len(tokens))
            assert len(chunk.block_table) == -(-end // bs)
            for pos in range(chunk.start_pos):
                assert self.kv[chunk.block_table[pos // bs]][pos % bs] == tokens[pos], (chunk.seq_id, pos)
            for pos in range(chunk.start_pos, end):
                self.kv.setdefault(chunk.block_table[pos // bs], [None] * bs)[pos % bs] = tokens[pos]
            if chunk.sample:
                for seq_id in (chunk.seq_id, *(fork_id for fork_id, _ in chunk.forks)):
                    outputs.append(StepOutput(seq_id, self.token(seq_id, chunk.num_generated)))
        return outputs


class Engine:
    """The engine loop in miniature: a scheduler, its block manager and a fake runner."""

    def __init__(self, num_blocks: int = 256, block_size: int = 16, **config: Any) -> None:
        self.held: set[int] = set()
        self.bm = BlockManager(
            num_blocks,
            block_size,
            MODEL,
            on_stored=lambda hashes, _parent: self.held.update(hashes),
            on_removed=self.held.difference_update,
            on_cleared=self.held.clear,
        )
        self.config = SchedulerConfig(eos_token_ids=(EOS,), **config)
        self.sched = Scheduler(self.config, self.bm)
        self.runner = FakeRunner(block_size)
        self.now = 0.0
        self.trace: list[list[ScheduledChunk]] = []

    def submit(
        self,
        seq_id: int,
        prompt: list[int],
        max_tokens: int,
        *,
        fork_ids: tuple[int, ...] = (),
        **sampling: Any,
    ) -> Sequence:
        """Queue a request; `fork_ids` are the sequence ids of its choices 1..n-1 (held as its forks)."""
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        seq = Sequence(seq_id, list(prompt), params, arrival_time=self.now)
        seq.forks = [Sequence(i, list(prompt), params, arrival_time=self.now) for i in fork_ids]
        self.sched.add(seq)
        for member in (seq, *seq.forks):
            self.runner.prompts[member.seq_id] = list(prompt)
        return seq

    def step(self) -> tuple[list[ScheduledChunk], list[Sequence]]:
        self.now += 1.0
        chunks = self.sched.schedule(self.now)
        self.check(chunks)
        changed = self.sched.update(chunks, self.runner.step(chunks), self.now)
        self.trace.append(chunks)
        assert self.held == self.bm.cached_hashes()
        return chunks, changed

    def check(self, chunks: list[ScheduledChunk]) -> None:
        assert sum(len(c.token_ids) for c in chunks) <= self.config.max_num_batched_tokens
        assert len({c.seq_id for c in chunks}) == len(chunks)
        assert len(self.sched.running) <= self.config.max_num_seqs
        assert chunks or not self.sched.has_work(), "a step with work scheduled nothing"

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the scheduler did not drain its work")

    def assert_all_free(self) -> None:
        assert not self.sched.has_work()
        assert self.bm.num_used_blocks == 0
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(self.bm.ref_count(b) == 0 for b in range(self.bm.num_blocks))


def tokens_of(chunks: list[ScheduledChunk]) -> dict[int, int]:
    return {c.seq_id: len(c.token_ids) for c in chunks}


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_sequences_join_and_leave_the_batch_every_step() -> None:
    eng = Engine()
    a = eng.submit(1, prompt(10, 20), max_tokens=5)
    b = eng.submit(2, prompt(40, 20), max_tokens=2)
    chunks, changed = eng.step()
    assert tokens_of(chunks) == {1: 20, 2: 20}
    assert [s.seq_id for s in changed] == [1, 2]
    c = eng.submit(3, prompt(70, 10), max_tokens=3)
    chunks, changed = eng.step()
    # b finishes here and leaves; c joins while a decodes.
    assert tokens_of(chunks) == {1: 1, 2: 1, 3: 10}
    assert b.finish_reason == "length" and b.is_finished
    chunks, _ = eng.step()
    assert tokens_of(chunks) == {1: 1, 3: 1}
    eng.run()
    for seq in (a, b, c):
        assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "length"
        assert (
            seq.output_token_ids
            == eng.runner.expected(seq.seq_id, seq.sampling.max_tokens)[seq.num_prompt_tokens :]
        )
        assert seq.first_scheduled_time is not None and seq.first_token_time is not None
        assert seq.arrival_time < seq.first_scheduled_time <= seq.first_token_time <= seq.finished_time
    eng.assert_all_free()


def test_leftover_budget_goes_to_the_next_prefill() -> None:
    eng = Engine(max_num_batched_tokens=64)
    eng.submit(1, prompt(0, 100), max_tokens=2)
    eng.submit(2, prompt(500, 100), max_tokens=2)
    assert tokens_of(eng.step()[0]) == {1: 64}
    assert tokens_of(eng.step()[0]) == {1: 36, 2: 28}
    assert tokens_of(eng.step()[0]) == {1: 1, 2: 63}
    eng.run()
    eng.assert_all_free()


def test_decodes_run_every_step_while_a_long_prompt_prefills() -> None:
    eng = Engine(num_blocks=1024, max_num_batched_tokens=512)
    shorts = [eng.submit(i, prompt(100 * i, 20), max_tokens=200) for i in range(3)]
    eng.step()
    long = eng.submit(9, prompt(10_000, 5000), max_tokens=4)
    prefill_steps = 0
    while long.first_token_time is None:
        chunks, _ = eng.step()
        share = tokens_of(chunks)
        assert all(share[s.seq_id] == 1 for s in shorts)
        assert sum(share.values()) <= 512
        assert share[9] == (509 if long.first_token_time is None else 5000 - 509 * prefill_steps)
        prefill_steps += 1
    assert prefill_steps == -(-5000 // 509)
    eng.run()
    assert long.output_token_ids == eng.runner.expected(9, 4)[5000:]
    eng.assert_all_free()


def test_forced_small_chunks_sample_only_at_the_end() -> None:
    eng = Engine(max_prefill_chunk=16)
    seq = eng.submit(1, prompt(0, 50), max_tokens=1)
    sizes = []
    while seq.output_token_ids == []:
        (chunk,) = eng.step()[0]
        sizes.append((len(chunk.token_ids), chunk.sample))
    assert sizes == [(16, False), (16, False), (16, False), (2, True)]
    eng.assert_all_free()


def test_without_chunking_a_prompt_runs_whole_or_waits() -> None:
    eng = Engine(max_num_batched_tokens=64, enable_chunked_prefill=False)
    eng.submit(1, prompt(0, 50), max_tokens=3)
    eng.submit(2, prompt(100, 30), max_tokens=3)
    assert tokens_of(eng.step()[0]) == {1: 50}
    assert tokens_of(eng.step()[0]) == {1: 1, 2: 30}
    with pytest.raises(UnschedulableSequence):
        eng.submit(3, prompt(0, 60), max_tokens=10)
    eng.run()
    eng.assert_all_free()


def test_preemption_when_blocks_run_out_recomputes_and_completes() -> None:
    eng = Engine(num_blocks=8, block_size=4, max_num_seqs=2)
    a = eng.submit(1, prompt(0, 8), max_tokens=12)
    b = eng.submit(2, prompt(50, 8), max_tokens=12)
    c = eng.submit(3, prompt(80, 4), max_tokens=2)
    while b.num_preemptions == 0:
        eng.step()
    # The most recently admitted one gives way and waits at the front of the queue.
    assert a.num_preemptions == 0 and b.status is SequenceStatus.WAITING
    assert list(eng.sched.waiting) == [b, c] and b.block_table == [] and b.num_computed_tokens == 0
    generated = b.num_output_tokens
    while b.status is SequenceStatus.WAITING:
        chunks, _ = eng.step()
    # Re-admitted after a finished; its head blocks outlived the preemption in the prefix cache.
    assert a.is_finished
    (readmit,) = (c for c in chunks if c.seq_id == 2)
    assert readmit.start_pos == 12 and readmit.sample and readmit.num_generated == generated
    eng.run()
    for seq in (a, b):
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == eng.runner.expected(seq.seq_id, 12)[8:]
    assert b.num_cached_tokens == 0 and c.num_output_tokens == 2
    eng.assert_all_free()


def test_a_prefill_short_of_blocks_takes_back_a_later_decode_slot() -> None:
    eng = Engine(num_blocks=8, block_size=4, max_prefill_chunk=4)
    long = eng.submit(1, prompt(0, 24), max_tokens=1)
    late = eng.submit(2, prompt(50, 4), max_tokens=12)
    assert tokens_of(eng.step()[0]) == {1: 4, 2: 4}
    for _ in range(4):
        assert tokens_of(eng.step()[0]) == {2: 1, 1: 4}
    # The decode is scheduled first and takes the last free block; then the older prefill needs one,
    # so the decode is preempted and its share of this step withdrawn.
    chunks, _ = eng.step()
    assert tokens_of(chunks) == {1: 4}
    assert late.num_preemptions == 1 and long.num_preemptions == 0
    assert chunks[0].start_pos == 20 and chunks[0].sample and long.finish_reason == "length"
    eng.run()
    assert late.output_token_ids == eng.runner.expected(2, 12)[4:]
    eng.assert_all_free()


def test_fcfs_order_of_admission() -> None:
    eng = Engine(max_num_seqs=1)
    seqs = [eng.submit(i, prompt(10 * i, 5), max_tokens=3) for i in range(4)]
    eng.run()
    starts = [s.first_scheduled_time for s in seqs]
    ends = [s.finished_time for s in seqs]
    assert starts == sorted(starts) and len(set(starts)) == 4
    assert ends == sorted(ends)
    assert all(s.output_token_ids == eng.runner.expected(s.seq_id, 3)[5:] for s in seqs)


def test_a_waiting_head_is_not_overtaken_by_smaller_requests() -> None:
    eng = Engine(num_blocks=10, block_size=4)
    eng.submit(1, prompt(0, 28), max_tokens=8)
    big = eng.submit(2, prompt(100, 16), max_tokens=4)
    small = eng.submit(3, prompt(200, 2), max_tokens=1)
    # 7 blocks go to the first prompt; the second needs 4 of the 3 left, and the third, which would
    # fit, waits behind it.
    assert tokens_of(eng.step()[0]) == {1: 28}
    eng.run()
    assert big.first_scheduled_time is not None and small.first_scheduled_time is not None
    assert big.first_scheduled_time <= small.first_scheduled_time
    eng.assert_all_free()


def test_abort_mid_prefill_frees_everything() -> None:
    eng = Engine(max_prefill_chunk=16)
    seq = eng.submit(1, prompt(0, 100), max_tokens=4)
    eng.step()
    assert seq.num_computed_tokens == 16 and eng.bm.num_used_blocks == 1
    assert eng.sched.abort(1, eng.now) is seq
    assert seq.finish_reason == "abort" and seq.finished_time == eng.now
    assert eng.sched.abort(1, eng.now) is None
    assert eng.sched.schedule(eng.now) == []
    eng.assert_all_free()


def test_abort_mid_decode_frees_everything() -> None:
    eng = Engine()
    keep = eng.submit(1, prompt(0, 40), max_tokens=6)
    seq = eng.submit(2, prompt(100, 40), max_tokens=50)
    for _ in range(3):
        eng.step()
    assert seq.num_output_tokens == 3 and not seq.is_prefill
    eng.sched.abort(2, eng.now)
    assert seq.finish_reason == "abort" and seq.block_table == []
    eng.run()
    assert keep.finish_reason == "length"
    eng.assert_all_free()


def test_abort_while_waiting_and_while_a_step_runs() -> None:
    eng = Engine(max_num_seqs=1)
    eng.submit(1, prompt(0, 10), max_tokens=3)
    queued = eng.submit(2, prompt(50, 10), max_tokens=3)
    chunks = eng.sched.schedule(1.0)
    assert eng.sched.abort(2, 1.0) is queued and list(eng.sched.waiting) == []
    # The engine drops a request while its step is on the model: the result is ignored.
    eng.sched.abort(1, 1.0)
    assert eng.sched.update(chunks, eng.runner.step(chunks), 2.0) == []
    eng.assert_all_free()


def test_eos_and_stop_tokens_finish_a_sequence() -> None:
    eng = Engine()
    eng.runner.token = lambda seq_id, index: EOS if index == 2 else 7 if seq_id == 3 else 1000 + index
    stopped = eng.submit(1, prompt(0, 10), max_tokens=8)
    ignoring = eng.submit(2, prompt(0, 10), max_tokens=8, ignore_eos=True)
    stop_id = eng.submit(3, prompt(0, 10), max_tokens=8, stop_token_ids=(7,))
    eng.run()
    assert (stopped.finish_reason, stopped.num_output_tokens) == ("stop", 3)
    assert (ignoring.finish_reason, ignoring.num_output_tokens) == ("length", 8)
    assert (stop_id.finish_reason, stop_id.output_token_ids) == ("stop", [7])
    eng.assert_all_free()


def test_engine_finish_on_a_stop_string_frees_the_sequence() -> None:
    eng = Engine()
    seq = eng.submit(1, prompt(0, 10), max_tokens=20)
    eng.step()
    eng.step()
    assert eng.sched.finish(1, "stop", eng.now) is seq
    assert seq.finish_reason == "stop" and seq.num_output_tokens == 2
    eng.assert_all_free()


def test_prefix_cache_hits_are_reported_as_cached_tokens() -> None:
    eng = Engine()
    base = prompt(0, 40)
    first = eng.submit(1, base, max_tokens=2)
    eng.run()
    assert first.num_cached_tokens == 0
    partial = eng.submit(2, base[:32] + prompt(900, 10), max_tokens=2)
    (chunk,) = eng.step()[0]
    assert partial.num_cached_tokens == 32 and chunk.start_pos == 32 and len(chunk.token_ids) == 10
    eng.run()
    # A prompt wholly in the cache still runs its last block, to sample from the last token.
    whole = eng.submit(3, base[:32], max_tokens=2)
    (chunk,) = eng.step()[0]
    assert whole.num_cached_tokens == 16 and chunk.start_pos == 16 and len(chunk.token_ids) == 16
    assert chunk.sample
    eng.run()
    eng.assert_all_free()


def test_requests_that_can_never_run_are_rejected_at_add() -> None:
    eng = Engine(num_blocks=4, block_size=4)
    with pytest.raises(UnschedulableSequence, match="KV blocks"):
        eng.submit(1, prompt(0, 10), max_tokens=8)
    with pytest.raises(UnschedulableSequence):
        eng.submit(2, [], max_tokens=1)
    # 16 tokens of KV is the whole pool: the last sampled token is never stored.
    eng.submit(3, prompt(0, 10), max_tokens=7)
    with pytest.raises(ValueError):
        eng.submit(3, prompt(0, 10), max_tokens=1)
    eng.run()
    eng.assert_all_free()


def test_stats_for_the_load_endpoint() -> None:
    eng = Engine(max_prefill_chunk=16, max_num_seqs=1)
    eng.submit(1, prompt(0, 100), max_tokens=2)
    eng.submit(2, prompt(500, 50), max_tokens=2)
    stats = eng.sched.stats()
    assert (stats.running, stats.waiting, stats.queued_prefill_tokens) == (0, 2, 150)
    eng.step()
    stats = eng.sched.stats()
    assert (stats.running, stats.waiting, stats.queued_prefill_tokens) == (1, 1, 134)
    assert (stats.kv_blocks_used, stats.kv_blocks_total) == (1, 256)
    assert stats.kv_usage == 1 / 256
    while eng.sched.running[0].num_output_tokens == 0:
        eng.step()
    # A decode's pending token is not prefill work.
    assert eng.sched.stats().queued_prefill_tokens == 50


# -- n > 1: choices forked off one prefill ---------------------------------------------------------


def assert_outputs_as_expected(eng: Engine, *seqs: Sequence) -> None:
    for seq in seqs:
        assert seq.finish_reason == "length"
        expected = eng.runner.expected(seq.seq_id, seq.sampling.max_tokens)[seq.num_prompt_tokens :]
        assert seq.output_token_ids == expected, seq.seq_id


@pytest.mark.parametrize("prompt_len", [16, 18])
def test_forks_share_the_prompts_full_blocks_and_recompute_only_its_tail(prompt_len: int) -> None:
    eng = Engine(block_size=4)
    parent = eng.submit(1, prompt(0, prompt_len), max_tokens=5, fork_ids=(2, 3))
    kids = list(parent.forks)
    assert eng.sched.stats().waiting == 1, "only choice 0 queues"
    (chunk,), changed = eng.step()
    # One prefill of the prompt; the choices' first tokens come from its last position.
    assert (chunk.seq_id, len(chunk.token_ids), chunk.sample) == (1, prompt_len, True)
    assert chunk.forks == ((2, kids[0].sampling), (3, kids[1].sampling))
    assert changed == [parent, *kids] and parent.forks == []
    full = prompt_len // 4
    shared = parent.block_table[:full]
    for kid in kids:
        assert kid.block_table == shared and kid.num_computed_tokens == full * 4
        assert kid.output_token_ids == [eng.runner.token(kid.seq_id, 0)]
        assert kid.num_cached_tokens == parent.num_cached_tokens
    assert [eng.bm.ref_count(b) for b in parent.block_table] == [3] * full + [1] * (prompt_len % 4 > 0)
    assert len(eng.sched.running) == 3
    chunks, _ = eng.step()
    tail = prompt_len - full * 4
    # A kid runs the prompt's tail (not shared: its own tokens follow it) with its first token; with
    # no tail that is a plain decode.
    assert tokens_of(chunks) == {1: 1, 2: tail + 1, 3: tail + 1}
    assert all(c.start_pos == full * 4 and c.sample and not c.forks for c in chunks if c.seq_id != 1)
    eng.run()
    assert_outputs_as_expected(eng, parent, *kids)
    eng.assert_all_free()


def test_a_choice_that_stops_at_its_first_token_still_frees_its_share() -> None:
    eng = Engine(block_size=4)
    eng.runner.token = lambda seq_id, index: EOS if seq_id == 2 else 1000 + index
    parent = eng.submit(1, prompt(0, 10), max_tokens=1, fork_ids=(2, 3))
    kids = list(parent.forks)
    _, changed = eng.step()
    assert changed == [parent, *kids] and all(s.is_finished for s in changed)
    assert [s.finish_reason for s in changed] == ["length", "stop", "length"]
    eng.assert_all_free()


def test_forks_take_their_seats_in_the_batch_from_admission() -> None:
    eng = Engine(block_size=4, max_num_seqs=4, max_prefill_chunk=4)
    group = eng.submit(1, prompt(0, 12), max_tokens=3, fork_ids=(2, 3))
    kids = list(group.forks)
    late = eng.submit(4, prompt(100, 4), max_tokens=10)
    later = eng.submit(5, prompt(200, 4), max_tokens=3)
    # The group holds 3 of the 4 seats while its prompt is prefilled in chunks: one more joins.
    assert tokens_of(eng.step()[0]) == {1: 4, 4: 4}
    assert list(eng.sched.waiting) == [later] and len(eng.sched.running) == 2
    while group.num_output_tokens == 0:
        eng.step()
    assert len(eng.sched.running) == 4 and list(eng.sched.waiting) == [later]
    eng.run()
    assert_outputs_as_expected(eng, group, *kids, late, later)
    eng.assert_all_free()


def test_a_group_waits_until_all_its_choices_fit_the_batch() -> None:
    eng = Engine(max_num_seqs=3)
    alone = eng.submit(1, prompt(0, 8), max_tokens=4)
    group = eng.submit(2, prompt(100, 8), max_tokens=4, fork_ids=(3, 4))
    assert tokens_of(eng.step()[0]) == {1: 8}
    while not alone.is_finished:
        assert group.status is SequenceStatus.WAITING
        eng.step()
    eng.run()
    assert_outputs_as_expected(eng, alone, group)
    eng.assert_all_free()


def test_a_group_that_could_never_fit_is_rejected_at_add() -> None:
    eng = Engine(num_blocks=8, block_size=4, max_num_seqs=4)
    # 4 shared prompt blocks + 4 choices x 2 blocks of their own (4 + 6 - 1 tokens need 5 blocks).
    with pytest.raises(UnschedulableSequence, match="n=4 choices needs 12 KV blocks"):
        eng.submit(1, prompt(0, 16), max_tokens=6, fork_ids=(2, 3, 4))
    with pytest.raises(UnschedulableSequence, match="n=5 choices run as 5 sequences"):
        eng.submit(1, prompt(0, 4), max_tokens=1, fork_ids=(2, 3, 4, 5))
    with pytest.raises(ValueError, match="one sequence id each"):
        eng.submit(1, prompt(0, 4), max_tokens=1, fork_ids=(1,))
    assert not eng.sched.has_work()
    # 4 + 4 x 1 blocks: the whole pool, run without a preemption.
    group = eng.submit(1, prompt(0, 16), max_tokens=5, fork_ids=(2, 3, 4))
    kids = list(group.forks)
    eng.run()
    assert_outputs_as_expected(eng, group, *kids)
    assert all(s.num_preemptions == 0 for s in (group, *kids))
    eng.assert_all_free()


def test_a_preempted_choice_is_readmitted_on_the_cached_prompt_blocks() -> None:
    eng = Engine(num_blocks=10, block_size=4)
    other = eng.submit(1, prompt(500, 4), max_tokens=20)
    group = eng.submit(2, prompt(0, 8), max_tokens=12, fork_ids=(3,))
    (kid,) = group.forks
    while kid.num_output_tokens == 0:
        eng.step()
    shared = group.block_table[:2]
    while kid.num_preemptions == 0:
        eng.step()
    # The latest to join the batch (the kid, at its fork) gives way first.
    assert (other.num_preemptions, group.num_preemptions) == (0, 0)
    assert kid.status is SequenceStatus.WAITING and kid.block_table == []
    generated = kid.num_output_tokens
    while kid.status is SequenceStatus.WAITING:
        chunks, _ = eng.step()
    (readmit,) = (c for c in chunks if c.seq_id == kid.seq_id)
    # Prompt + output recomputed from past the prompt's two full blocks, which it shares again.
    assert readmit.start_pos >= 8 and kid.block_table[:2] == shared
    assert readmit.num_generated == generated
    eng.run()
    assert_outputs_as_expected(eng, other, group, kid)
    eng.assert_all_free()


def test_a_parent_preempted_before_its_fork_keeps_its_forks() -> None:
    eng = Engine(num_blocks=7, block_size=4, max_prefill_chunk=2)
    other = eng.submit(1, prompt(500, 4), max_tokens=24)
    while other.num_computed_tokens < 15:
        eng.step()
    group = eng.submit(2, prompt(0, 12), max_tokens=1, fork_ids=(3,))
    (kid,) = group.forks
    while group.num_preemptions == 0:
        assert group.num_output_tokens == 0, "the pool was meant to run out during the prefill"
        eng.step()
    assert group.status is SequenceStatus.WAITING and group.forks == [kid]
    assert (
        kid.status is SequenceStatus.WAITING and kid.block_table == [] and kid.seq_id not in eng.sched._live
    )
    eng.run()
    assert kid.num_preemptions == 0 and kid.first_scheduled_time == group.first_scheduled_time
    assert_outputs_as_expected(eng, other, group, kid)
    eng.assert_all_free()


def test_aborting_a_group_before_and_after_its_fork_frees_everything() -> None:
    eng = Engine(max_prefill_chunk=16)
    group = eng.submit(1, prompt(0, 40), max_tokens=8, fork_ids=(2, 3))
    kids = list(group.forks)
    eng.step()
    assert eng.bm.num_used_blocks == 1
    # Mid-prefill: the forks were never made, and end with their parent.
    assert eng.sched.abort(1, eng.now) is group
    assert all(s.finish_reason == "abort" and s.finished_time == eng.now for s in (group, *kids))
    assert eng.sched.abort(2, eng.now) is None
    eng.assert_all_free()
    group = eng.submit(4, prompt(0, 40), max_tokens=8, fork_ids=(5, 6))
    kids = list(group.forks)
    while group.num_output_tokens < 2:
        eng.step()
    assert eng.bm.num_used_blocks > 0
    for seq in (group, *kids):
        assert eng.sched.abort(seq.seq_id, eng.now) is seq and seq.finish_reason == "abort"
    eng.assert_all_free()


workload = st.fixed_dictionaries(
    {
        # KV blocks beyond what the largest request needs alone: small, to force preemption; below 0,
        # some requests are rejected.
        "pool_slack": st.integers(-2, 6),
        "block_size": st.sampled_from([1, 2, 4]),
        "budget": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 6),
        "chunk": st.one_of(st.none(), st.integers(1, 12)),
        "chunked": st.booleans(),
        "arrivals": st.lists(
            st.tuples(
                st.integers(0, 10),  # arrival step
                st.integers(0, 2),  # prefix family
                st.integers(0, 16),  # tokens taken from the family prefix
                st.lists(st.integers(0, 3), max_size=8),  # own tail
                st.integers(1, 16),  # max_tokens
                st.integers(1, 3),  # n: choices forked off the one prefill
            ),
            min_size=1,
            max_size=12,
        ),
        # (index into the arrivals, steps after its arrival, abort after schedule rather than before it)
        "aborts": st.lists(st.tuples(st.integers(0, 11), st.integers(0, 8), st.booleans()), max_size=4),
    }
)


def group_blocks(prompt_len: int, max_tokens: int, n: int, bs: int) -> int:
    """KV blocks n choices need at once: the prompt's full blocks shared, the rest each their own."""
    shared = prompt_len // bs
    return shared + n * (-(-(prompt_len + max_tokens - 1) // bs) - shared)


def fork_ids(index: int, n: int) -> tuple[int, ...]:
    return tuple(100 + 10 * index + j for j in range(1, n))


@settings(max_examples=150, deadline=None)
@given(workload)
def test_random_workloads_finish_exactly_and_leak_nothing(w: dict) -> None:
    bs = w["block_size"]
    largest = max(
        group_blocks(head + len(tail), max_tokens, n, bs) for _, _, head, tail, max_tokens, n in w["arrivals"]
    )
    num_blocks = max(1, largest + w["pool_slack"])
    eng = Engine(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_batched_tokens=w["budget"],
        max_num_seqs=w["max_num_seqs"],
        max_prefill_chunk=w["chunk"],
        enable_chunked_prefill=w["chunked"],
    )
    by_step: dict[int, list[int]] = {}
    for index, (at, *_rest) in enumerate(w["arrivals"]):
        by_step.setdefault(at, []).append(index)
    aborts_at: dict[int, list[tuple[int, bool]]] = {}
    for index, delay, after_schedule in w["aborts"]:
        index %= len(w["arrivals"])
        aborts_at.setdefault(w["arrivals"][index][0] + delay, []).append((index, after_schedule))
    # Arrival index -> the request's choices (choice 0's seq_id is the index).
    groups: dict[int, list[Sequence]] = {}
    aborted: set[int] = set()

    def abort(indexes: list[int]) -> None:
        """As the engine aborts a request: every choice (forks not made yet end with choice 0)."""
        for index in indexes:
            for seq in groups.get(index, []):
                if eng.sched.abort(seq.seq_id, eng.now) is not None:
                    aborted.add(index)

    last_arrival = max(at for at, *_ in w["arrivals"])
    step = 0
    while step <= last_arrival or eng.sched.has_work():
        assert step < 3000, "the scheduler did not drain its work"
        for index in by_step.get(step, []):
            _, family, head, tail, max_tokens, n = w["arrivals"][index]
            tokens = [100 * (family + 1) + i for i in range(head)] + tail
            peak = len(tokens) + max_tokens - 1
            fits = (
                bool(tokens)
                and n <= w["max_num_seqs"]
                and group_blocks(len(tokens), max_tokens, n, bs) <= num_blocks
                and (w["chunked"] or peak <= w["budget"])
            )
            if fits:
                parent = eng.submit(index, tokens, max_tokens, fork_ids=fork_ids(index, n))
                groups[index] = [parent, *parent.forks]
            else:
                with pytest.raises(UnschedulableSequence):
                    eng.submit(index, tokens, max_tokens, fork_ids=fork_ids(index, n))
        abort([i for i, after_schedule in aborts_at.get(step, []) if not after_schedule])
        eng.now += 1.0
        chunks = eng.sched.schedule(eng.now)
        eng.check(chunks)
        outputs = eng.runner.step(chunks)
        abort([i for i, after_schedule in aborts_at.get(step, []) if after_schedule])
        eng.sched.update(chunks, outputs, eng.now)
        assert eng.held == eng.bm.cached_hashes()
        step += 1
    for index, group in groups.items():
        for seq in group:
            assert seq.is_finished
            if seq.finish_reason == "abort":
                assert index in aborted
            else:
                assert seq.finish_reason == "length"
                assert (
                    seq.output_token_ids
                    == eng.runner.expected(seq.seq_id, seq.sampling.max_tokens)[seq.num_prompt_tokens :]
                )
    eng.assert_all_free()
