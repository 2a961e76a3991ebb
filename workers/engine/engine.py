"""The engine core: scheduler, block manager, model runner and detokenizers, one step at a time.

Synchronous and single-threaded on purpose: the offline LLM calls `step()` in a loop, and the
async front (llm.py) runs the same loop in one background thread, so the engine itself never has
to think about locks or event loops.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workers.engine.batch import Runner
from workers.engine.block_manager import BlockManager
from workers.engine.detokenizer import Decoder, Detokenizer
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats, UnschedulableSequence
from workers.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from workers.engine.loader import LoadedModel


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
    # Attention backend: None/"auto" picks flash-attn on CUDA when importable, SDPA otherwise.
    backend: str | None = None
    num_threads: int | None = None
    # Sampling of unseeded requests; fixed here so that a test run is reproducible.
    seed: int = 0


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request: the delta to stream, and the totals for usage."""

    request_id: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # (logprob, top alternatives) of each new token, when the request asked for logprobs.
    new_logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = None


class PromptTooLong(ValueError):
    """The prompt plus max_tokens does not fit the model's context window: a client error."""


StoredCallback = Callable[[list[int], int | None], None]
RemovedCallback = Callable[[list[int]], None]
ClearedCallback = Callable[[], None]


def kv_callbacks(
    on_stored: StoredCallback | None, on_removed: RemovedCallback | None, on_cleared: ClearedCallback | None
) -> dict[str, Callable]:
    """The block manager's KV-event callbacks that were given (it keeps its no-op for the rest)."""
    given = (("on_stored", on_stored), ("on_removed", on_removed), ("on_cleared", on_cleared))
    return {name: fn for name, fn in given if fn is not None}


class Engine:
    """One engine loop over a scheduler and a runner; this constructor runs a loaded model, and the
    simulated engine (workers.sim) gives the same loop a cost-model runner instead."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        *,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
        on_cleared: ClearedCallback | None = None,
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
            num_blocks, config.block_size, loaded.name, **kv_callbacks(on_stored, on_removed, on_cleared)
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
        )
        self.clock = clock
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
        self._sequences: dict[int, Sequence] = {}
        self._detokenizers: dict[int, Detokenizer] = {}

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        """Queue a request; raises PromptTooLong or UnschedulableSequence for one that can never run."""
        needed = len(prompt_token_ids) + sampling.max_tokens
        if needed > self.max_context_len:
            raise PromptTooLong(
                f"this model's context window is {self.max_context_len} tokens, but the request needs "
                f"{needed} ({len(prompt_token_ids)} in the prompt + {sampling.max_tokens} max_tokens)"
            )
        request_id = next(self._ids)
        seq = Sequence(request_id, list(prompt_token_ids), sampling, arrival_time=self._now())
        self.scheduler.add(seq)
        self._sequences[request_id] = seq
        self._detokenizers[request_id] = Detokenizer(stop=sampling.stop)
        return request_id

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, and return a delta for every request that got a token."""
        chunks = self.scheduler.schedule(self._now())
        if not chunks:
            return []
        outputs = self.runner.execute(chunks)
        changed = self.scheduler.update(chunks, outputs, self._now())
        return [self._delta(seq) for seq in changed]

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; None when it had already finished."""
        seq = self.scheduler.abort(request_id, self._now())
        if seq is None:
            return None
        return self._delta(seq, new_token=False)

    def _text(self, seq: Sequence) -> str:
        """The text the latest token adds; a stop string that completes here finishes the sequence."""
        detok = self._detokenizers[seq.seq_id]
        text = detok.update(self.tokenizer, seq.output_token_ids, final=seq.is_finished)
        if detok.stopped and not seq.is_finished:
            self.scheduler.finish(seq.seq_id, "stop", self._now())
        return text

    def _delta(self, seq: Sequence, new_token: bool = True) -> RequestOutput:
        """The delta of a step: the sequence's latest token (each step adds at most one) and its text."""
        new_ids = seq.output_token_ids[-1:] if new_token else []
        text = self._text(seq) if new_ids else ""
        logprobs = None
        if new_ids and seq.sampling.logprobs is not None and seq.output_logprobs:
            last = seq.output_logprobs[-1]
            logprobs = [(last.logprob, last.top_logprobs)]
        if seq.is_finished:
            del self._sequences[seq.seq_id]
            del self._detokenizers[seq.seq_id]
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=new_ids,
            new_text=text,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            new_logprobs=logprobs,
        )


__all__ = ["Engine", "EngineConfig", "PromptTooLong", "RequestOutput", "UnschedulableSequence"]
