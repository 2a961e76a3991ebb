"""Continuous batching over the paged KV pool: which tokens of which sequences run in the next step.

Pure: no torch, no I/O, no clock of its own. The engine drives it with the model runner; the fleet
simulator drives the very same object with a cost model, so simulated replicas queue, chunk, share
prefixes and preempt exactly as real ones do.

One step is `schedule(now)` -> run the chunks -> `update(chunks, outputs, now)`; a step's chunks must
be applied by `update` before the next `schedule`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from workers.engine.batch import ScheduledChunk, StepOutput
from workers.engine.block_manager import BlockManager
from workers.engine.sequence import FinishReason, Sequence, SequenceStatus, TokenLogprobs


class UnschedulableSequence(ValueError):
    """A request this engine could never run, however idle it were: a client error, not a wait."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # Tokens run per step, decodes and prefill chunks together.
    max_num_batched_tokens: int = 2048
    # Sequences admitted at once (holding KV blocks), whether or not they run in a given step.
    max_num_seqs: int = 64
    # Off: a prompt runs whole in one step or waits (then prompt + max_tokens must fit the budget).
    enable_chunked_prefill: bool = True
    # Upper bound on one sequence's prefill chunk per step; small values exercise chunking in tests.
    max_prefill_chunk: int | None = None
    # The model's end-of-sequence ids, honoured unless a request sets ignore_eos.
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be positive, got {self.max_prefill_chunk}")


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the worker's /load endpoint and metrics report."""

    running: int
    waiting: int
    # Prompt (or recompute) tokens not yet in the KV cache across waiting and running sequences;
    # a waiting sequence counts in full, since its prefix-cache hit is only known at admission.
    queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total


class Scheduler:
    """FCFS continuous batching with a token budget, chunked prefill and preemption by recompute."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        # Admission order: the last one is the first to be preempted.
        self.running: list[Sequence] = []
        self._live: dict[int, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; refuse one that could not run even alone, rather than let it wait
        (or preempt itself) forever."""
        if seq.seq_id in self._live:
            raise ValueError(f"sequence {seq.seq_id} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.output_token_ids or seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} is not a fresh sequence")
        if not seq.prompt_token_ids:
            raise UnschedulableSequence("the prompt is empty: there is no token to compute logits from")
        # The last sampled token is never written to the KV cache.
        peak = seq.num_prompt_tokens + seq.sampling.max_tokens - 1
        bm = self.block_manager
        if bm.blocks_for(peak) > bm.num_blocks:
            raise UnschedulableSequence(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.sampling.max_tokens}) needs "
                f"{bm.blocks_for(peak)} KV blocks of {bm.block_size} tokens; the pool has {bm.num_blocks}"
            )
        if not self.config.enable_chunked_prefill and peak > self.config.max_num_batched_tokens:
            raise UnschedulableSequence(
                f"prompt + max_tokens ({peak + 1} tokens) exceeds max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) and chunked prefill is off"
            )
        self._live[seq.seq_id] = seq
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> list[ScheduledChunk]:
        """The next step: running decodes first, then running prefills, then new admissions (FCFS),
        within the token budget; blocks that run out are found by preempting the latest admitted."""
        budget = self.config.max_num_batched_tokens
        # seq_id -> tokens to run this step, in scheduling order.
        plan: dict[int, int] = {}
        preempted = False
        for seq in sorted(self.running, key=lambda s: s.is_prefill):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            n = self._chunk_size(seq.num_uncomputed_tokens, budget)
            if n == 0:
                continue
            while not self.block_manager.grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                budget += plan.pop(victim.seq_id, 0)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                plan[seq.seq_id] = n
                budget -= n
        # After a preemption the pool is tight: admitting now would only set up the next one.
        if not preempted:
            self._admit(budget, plan, now)
        return [self._chunk(self._live[seq_id], n) for seq_id, n in plan.items()]

    def _admit(self, budget: int, plan: dict[int, int], now: float) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.lookup(seq)
            n = self._chunk_size(seq.num_tokens - cached, budget)
            if n == 0 or not bm.admit(seq, cached + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                seq.num_cached_tokens = cached
            plan[seq.seq_id] = n
            budget -= n

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """Tokens of a sequence to run now (0: none fit); a decode has exactly one remaining."""
        if not self.config.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        return min(remaining, budget, self.config.max_prefill_chunk or remaining)

    def _chunk(self, seq: Sequence, n: int) -> ScheduledChunk:
        start = seq.num_computed_tokens
        end = start + n
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, end),
            start_pos=start,
            block_table=list(seq.block_table),
            sample=end == seq.num_tokens,
            sampling=seq.sampling,
            num_generated=seq.num_output_tokens,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV (its full blocks likely stay cached for the re-admission)
        and go back to the front of the queue, ahead of the ones that arrived after it."""
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(
        self, chunks: Iterable[ScheduledChunk], outputs: Iterable[StepOutput], now: float
    ) -> list[Sequence]:
        """Apply a step's results; return the sequences that got a token (some of them finished),
        so the engine can stream their deltas. Chunks of sequences finished or aborted while the
        step ran are ignored."""
        sampled = {out.seq_id: out for out in outputs}
        changed: list[Sequence] = []
        for chunk in chunks:
            seq = self._live.get(chunk.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            if chunk.start_pos != seq.num_computed_tokens:
                raise RuntimeError(
                    f"chunk of sequence {seq.seq_id} starts at {chunk.start_pos}, but "
                    f"{seq.num_computed_tokens} tokens are computed: a step was skipped or applied twice"
                )
            self.block_manager.mark_computed(seq, len(chunk.token_ids))
            if not chunk.sample:
                continue
            out = sampled.get(seq.seq_id)
            if out is None:
                raise RuntimeError(f"the runner returned no token for sequence {seq.seq_id}")
            logprobs = None
            if seq.sampling.logprobs is not None:
                logprobs = TokenLogprobs(out.logprob, out.top_logprobs)
            seq.append_token(out.token_id, logprobs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._stop_reason(seq, out.token_id)
            if reason is not None:
                self._retire(seq, reason, now)
            changed.append(seq)
        return changed

    def _stop_reason(self, seq: Sequence, token_id: int) -> FinishReason | None:
        sampling = seq.sampling
        if token_id in sampling.stop_token_ids:
            return "stop"
        if not sampling.ignore_eos and token_id in self.config.eos_token_ids:
            return "stop"
        if seq.num_output_tokens >= sampling.max_tokens:
            return "length"
        return None

    def finish(self, seq_id: int, reason: FinishReason, now: float) -> Sequence | None:
        """End a sequence early (the engine matched a stop string, or the client went away) and free
        its blocks at once; None if it is unknown or already finished."""
        seq = self._live.get(seq_id)
        if seq is not None:
            self._retire(seq, reason, now)
        return seq

    def abort(self, seq_id: int, now: float) -> Sequence | None:
        return self.finish(seq_id, "abort", now)

    def _retire(self, seq: Sequence, reason: FinishReason, now: float) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        del self._live[seq.seq_id]
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finished_time = now

    def stats(self) -> SchedulerStats:
        queued = sum(s.num_uncomputed_tokens for s in (*self.waiting, *self.running) if s.is_prefill)
        bm = self.block_manager
        return SchedulerStats(
            running=len(self.running),
            waiting=len(self.waiting),
            queued_prefill_tokens=queued,
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
        )
