"""Continuous batching over the paged KV pool: which tokens of which sequences run in the next step.

Pure: no torch, no I/O, no clock of its own. The engine drives it with the model runner; the fleet
simulator drives the very same object with a cost model, so simulated replicas queue, chunk, share
prefixes and preempt exactly as real ones do.

One step is `schedule(now)` -> run the chunks -> `update(chunks, outputs, now)`; a step's chunks must
be applied by `update` before the next `schedule`.

A request for n > 1 choices arrives as one sequence holding n - 1 forks (Sequence.forks). Only it
queues and prefills; the step that samples its first token samples the forks' first tokens from the
same logits, and `update` then forks them off it (BlockManager.fork). From there each choice is a
sequence of its own: it decodes, is preempted, finishes and is aborted on its own. Admission keeps a
seat for every fork still held, so the forks never push the batch past max_num_seqs.
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
        """Queue a new sequence (with its forks, for an n > 1 request); refuse one that could not run
        even alone, all its choices at once, rather than let it wait (or preempt itself) forever."""
        for member in (seq, *seq.forks):
            if member.seq_id in self._live:
                raise ValueError(f"sequence {member.seq_id} is already scheduled")
            if member.status is not SequenceStatus.WAITING or member.output_token_ids or member.block_table:
                raise ValueError(f"sequence {member.seq_id} is not a fresh sequence")
        if len({member.seq_id for member in (seq, *seq.forks)}) != seq.group_size:
            raise ValueError(f"the choices of sequence {seq.seq_id} need one sequence id each")
        for child in seq.forks:
            if child.forks or child.prompt_token_ids != seq.prompt_token_ids:
                raise ValueError(f"sequence {child.seq_id} is not a plain choice of {seq.seq_id}'s prompt")
        if not seq.prompt_token_ids:
            raise UnschedulableSequence("the prompt is empty: there is no token to compute logits from")
        n = seq.group_size
        if n > self.config.max_num_seqs:
            raise UnschedulableSequence(
                f"n={n} choices run as {n} sequences at once; this worker runs at most "
                f"{self.config.max_num_seqs}"
            )
        # The last sampled token is never written to the KV cache.
        peak = seq.num_prompt_tokens + seq.sampling.max_tokens - 1
        bm = self.block_manager
        # The prompt's full blocks are shared by the choices; each holds the rest of its own.
        shared = seq.num_prompt_tokens // bm.block_size
        needed = shared + n * (bm.blocks_for(peak) - shared)
        if needed > bm.num_blocks:
            choices = f" for each of n={n} choices" if n > 1 else ""
            raise UnschedulableSequence(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.sampling.max_tokens}){choices} "
                f"needs {needed} KV blocks of {bm.block_size} tokens; the pool has {bm.num_blocks}"
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
        # A sequence holding forks takes a seat for each: they join the batch when it samples.
        seats = sum(s.group_size for s in self.running)
        while self.waiting and budget > 0 and seats + self.waiting[0].group_size <= self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.lookup(seq)
            n = self._chunk_size(seq.num_tokens - cached, budget)
            if n == 0 or not bm.admit(seq, cached + n):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            seats += seq.group_size
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
        sample = end == seq.num_tokens
        return ScheduledChunk(
            seq_id=seq.seq_id,
            token_ids=seq.token_slice(start, end),
            start_pos=start,
            block_table=list(seq.block_table),
            sample=sample,
            sampling=seq.sampling,
            num_generated=seq.num_output_tokens,
            forks=tuple((child.seq_id, child.sampling) for child in seq.forks) if sample else (),
        )

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: drop the KV (its full blocks likely stay cached for the re-admission)
        and go back to the front of the queue, ahead of the ones that arrived after it. Forks not
        made yet stay with it, to be made when its prompt is computed again."""
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update(
        self, chunks: Iterable[ScheduledChunk], outputs: Iterable[StepOutput], now: float
    ) -> list[Sequence]:
        """Apply a step's results; return the sequences that got a token (some of them finished),
        so the engine can stream their deltas: forks made this step come right after their parent.
        Chunks of sequences finished or aborted while the step ran are ignored."""
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
            self._append(seq, sampled, now)
            # Forked before the parent can finish (and free the blocks they share) on this token.
            forks, seq.forks = seq.forks, []
            for child in forks:
                self._fork(seq, child)
                self._append(child, sampled, now)
            for got in (seq, *forks):
                reason = self._stop_reason(got, got.output_token_ids[-1])
                if reason is not None:
                    self._retire(got, reason, now)
                changed.append(got)
        return changed

    def _append(self, seq: Sequence, sampled: dict[int, StepOutput], now: float) -> None:
        out = sampled.get(seq.seq_id)
        if out is None:
            raise RuntimeError(f"the runner returned no token for sequence {seq.seq_id}")
        logprobs = None
        if seq.sampling.logprobs is not None:
            logprobs = TokenLogprobs(out.logprob, out.top_logprobs)
        seq.append_token(out.token_id, logprobs)
        if seq.first_token_time is None:
            seq.first_token_time = now

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start a choice off its parent's computed prompt: it joins the batch right behind it, with
        the prompt's full blocks shared and the parent's admission (the cached-token count the
        client is told, the time it was first scheduled) as its own."""
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        child.first_scheduled_time = parent.first_scheduled_time
        child.num_cached_tokens = parent.num_cached_tokens
        self.running.append(child)
        self._live[child.seq_id] = child

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
        """Finish `seq` and free its blocks; forks it still holds (its prompt was never completed,
        so only an abort gets here) end with it, having never run."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        else:
            self.waiting.remove(seq)
        del self._live[seq.seq_id]
        for ended in (seq, *seq.forks):
            ended.status = SequenceStatus.FINISHED
            ended.finish_reason = reason
            ended.finished_time = now
        seq.forks = []

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
