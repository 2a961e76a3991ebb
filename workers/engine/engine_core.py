"""The engine core: scheduler, block manager, model runner and detokenizers, one step at a time.

Synchronous and single-threaded on purpose: the offline LLM calls `step()` in a loop, and the
async front (llm.py) runs the same loop in one background thread, so the engine itself never has
to think about locks or event loops.

A request asks for n choices of one prompt. Each choice is a sequence of its own, forked off the
single prefill of the prompt (scheduler.py); the engine maps its sequences back to (request,
choice index) and reports every delta tagged with both.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.batch import Runner
from workers.engine.block_manager import BlockManager, StoredTokensCallback
from workers.engine.detokenizer import Decoder, Detokenizer
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats, UnschedulableSequence
from workers.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from workers.engine.loader import LoadedModel
    from workers.engine.model.moe import RoutingCounts


@dataclass(frozen=True, slots=True)
class EngineConfig:
    block_size: int = 16
    # KV pool size: num_blocks if given, else as many blocks as fit in kv_memory_bytes.
    num_blocks: int | None = None
    kv_memory_bytes: int = 256 * 2**20
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    max_prefill_chunk: int | None = None
    # Attention backend: None/"auto" picks flash-attn, else Triton on CUDA, else SDPA (ModelRunner).
    backend: str | None = None
    # Decode steps from CUDA graphs: None where they can be captured, True insists, False never.
    cuda_graphs: bool | None = None
    num_threads: int | None = None
    # Sampling of unseeded requests; fixed here so that a test run is reproducible.
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one choice of a request: the delta to stream, and the totals for
    usage. `finished` is the choice's; the request is done when all of its choices are."""

    request_id: int
    # The choice, 0..n-1 (always 0 for n=1).
    index: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    # The prompt's tokens and those of it served from the prefix cache: the same for every choice.
    prompt_tokens: int
    cached_tokens: int
    # This choice's tokens so far.
    completion_tokens: int
    # (logprob, top alternatives) of each new token, when the request asked for logprobs.
    new_logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = None


@dataclass(slots=True)
class _Choice:
    """Where a sequence's deltas go: its request and choice index, and its own text stream."""

    request_id: int
    index: int
    detokenizer: Detokenizer


class PromptTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context window: a client error."""


StoredCallback = Callable[[list[int], int | None], None]
RemovedCallback = Callable[[list[int]], None]
ClearedCallback = Callable[[], None]


def kv_callbacks(
    on_stored: StoredCallback | None,
    on_removed: RemovedCallback | None,
    on_cleared: ClearedCallback | None,
    on_stored_tokens: StoredTokensCallback | None = None,
) -> dict[str, Callable]:
    """The block manager's KV-event callbacks that were given (it keeps its no-op for the rest)."""
    given = (
        ("on_stored", on_stored),
        ("on_removed", on_removed),
        ("on_cleared", on_cleared),
        ("on_stored_tokens", on_stored_tokens),
    )
    return {name: fn for name, fn in given if fn is not None}


class Engine:
    """One engine loop over a scheduler and a runner; this constructor runs a loaded model, and the
    simulated engine (workers.sim) gives the same loop a cost-model runner instead."""

    # A mixture-of-experts model's routed-token counts and its expert-parallel ranks, for /metrics
    # (None: a dense model, or the simulated engine).
    moe_routing: tuple[RoutingCounts, int] | None = None

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
        on_cleared: ClearedCallback | None = None,
        on_stored_tokens: StoredTokensCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # The model's modules load torch; imported here so that the simulated engine, which shares this
        # loop and never calls this constructor, runs without it.
        import torch

        from workers.engine.model_runner import ModelRunner, num_blocks_for_budget

        self.config = config = config or EngineConfig()
        self.model_config = loaded.config
        weight = loaded.model.model.embed_tokens.weight
        num_blocks = config.num_blocks or num_blocks_for_budget(
            config.kv_memory_bytes, loaded.config, config.block_size, weight.dtype
        )
        block_manager = BlockManager(
            num_blocks,
            config.block_size,
            loaded.name,
            **kv_callbacks(on_stored, on_removed, on_cleared, on_stored_tokens),
        )
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_prefill_chunk=config.max_prefill_chunk,
                eos_token_ids=loaded.config.eos_token_ids,
            ),
            block_manager,
        )
        generator = torch.Generator(device=weight.device).manual_seed(config.seed)
        runner = ModelRunner(
            loaded.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            backend=config.backend,
            num_threads=config.num_threads,
            generator=generator,
            cuda_graphs=config.cuda_graphs,
            max_num_seqs=config.max_num_seqs,
        )
        self.clock = clock
        if loaded.model.routing is not None:
            self.moe_routing = (loaded.model.routing, loaded.model.shard.size)
        self._attach(loaded.name, loaded.tokenizer, loaded.config.max_context_len, scheduler, runner, clock)

    def _attach(
        self,
        model_name: str,
        tokenizer: Decoder | None,
        max_context_len: int,
        scheduler: Scheduler,
        runner: Runner,
        now: Callable[[], float],
    ) -> None:
        """The state the loop drives, whatever runs its steps."""
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.scheduler = scheduler
        self.block_manager = scheduler.block_manager
        self.runner = runner
        self._now = now
        self._ids = itertools.count()
        # Request id -> its choices' sequences, in index order, until every one has finished.
        self._requests: dict[int, list[Sequence]] = {}
        # Sequence id -> its choice, until its final delta.
        self._choices: dict[int, _Choice] = {}

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams, n: int = 1) -> int:
        """Queue a request for `n` choices of one prompt and return its id, which is also the sequence
        id of its choice 0 (the one that prefills the prompt). Raises PromptTooLong or
        UnschedulableSequence for a request that can never run."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        needed = len(prompt_token_ids) + sampling.max_tokens
        if needed > self.max_context_len:
            raise PromptTooLong(
                f"this model's context window is {self.max_context_len} tokens, but the request needs "
                f"{needed} ({len(prompt_token_ids)} in the prompt + {sampling.max_tokens} max_tokens)"
            )
        now = self._now()
        # One prompt list for all the choices: a sequence never changes its prompt.
        prompt = list(prompt_token_ids)
        group = [
            Sequence(next(self._ids), prompt, sampling.for_choice(i), arrival_time=now) for i in range(n)
        ]
        parent = group[0]
        parent.forks = group[1:]
        self.scheduler.add(parent)
        request_id = parent.seq_id
        self._requests[request_id] = group
        for index, seq in enumerate(group):
            self._choices[seq.seq_id] = _Choice(request_id, index, Detokenizer(stop=sampling.stop))
        return request_id

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, and return a delta for every choice that got a token."""
        chunks = self.scheduler.schedule(self._now())
        if not chunks:
            return []
        outputs = self.runner.execute(chunks)
        changed = self.scheduler.update(chunks, outputs, self._now())
        return [self._delta(seq) for seq in changed]

    def abort(self, request_id: int) -> list[RequestOutput]:
        """Stop every choice of a request now and free their KV blocks; the final delta of each choice
        that was still running (none when the request had already finished)."""
        group = self._requests.get(request_id)
        if group is None:
            return []
        unfinished = [seq for seq in group if seq.seq_id in self._choices]
        now = self._now()
        for seq in unfinished:
            # Choices not forked yet are not the scheduler's: they end with choice 0.
            self.scheduler.abort(seq.seq_id, now)
        return [self._delta(seq, new_token=False) for seq in unfinished]

    def _text(self, seq: Sequence) -> str:
        """The text the latest token adds; a stop string that completes here finishes the sequence."""
        detok = self._choices[seq.seq_id].detokenizer
        text = detok.update(self.tokenizer, seq.output_token_ids, final=seq.is_finished)
        if detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq.seq_id, "stop", self._now())
        return text

    def _delta(self, seq: Sequence, new_token: bool = True) -> RequestOutput:
        """The delta of a step: the sequence's latest token (each step adds at most one) and its text."""
        choice = self._choices[seq.seq_id]
        group = self._requests[choice.request_id]
        new_ids = seq.output_token_ids[-1:] if new_token else []
        text = self._text(seq) if new_ids else ""
        logprobs = None
        if new_ids and seq.sampling.logprobs is not None and seq.output_logprobs:
            last = seq.output_logprobs[-1]
            logprobs = [(last.logprob, last.top_logprobs)]
        if seq.is_finished:
            del self._choices[seq.seq_id]
            if all(s.seq_id not in self._choices for s in group):
                del self._requests[choice.request_id]
        return RequestOutput(
            request_id=choice.request_id,
            index=choice.index,
            new_token_ids=new_ids,
            new_text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            # Choice 0's: it admitted the prompt, whether or not the others were forked yet.
            cached_tokens=group[0].num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            new_logprobs=logprobs,
        )


__all__ = ["Engine", "EngineConfig", "PromptTooLong", "RequestOutput", "UnschedulableSequence"]
