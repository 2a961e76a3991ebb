"""One request's state as the scheduler and the block manager see it: tokens, KV progress, timing.

Pure data: no torch, no clock of its own (every timestamp comes from the caller), so the same
object serves the real engine and the fleet simulator.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

from workers.engine.sampling_params import SamplingParams

FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Log-probabilities of one generated token, kept only when the request asked for them."""

    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None


@dataclass(eq=False, slots=True)
class Sequence:
    """A request from arrival to finish.

    The KV cache holds the first `num_computed_tokens` of `prompt + output`; whatever lies beyond
    is what the next step has to run. A decode is the case where exactly one token (the last one
    sampled) is left. Preemption frees the KV and sets `num_computed_tokens` back to 0, so the
    prompt and the output generated so far are recomputed together as one prefill, without a
    separate "recompute prompt" to keep in sync.
    """

    seq_id: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at first admission (usage.cached_tokens); a later
    # re-admission after preemption does not change what the client is told.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Physical KV blocks holding positions [0, len(block_table) * block_size), owned by the block
    # manager. block_hashes is the chain hash of each full block of tokens known so far, filled in
    # lazily by the block manager; it depends on the tokens alone, so it survives preemption.
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    # Choices 1..n-1 of an n > 1 request, held by choice 0 (this sequence) until its prompt is
    # prefilled: the scheduler then forks them off it, sharing the prompt's KV, and empties the list.
    forks: list[Sequence] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def group_size(self) -> int:
        """Sequences this one brings into the running batch: itself and the forks it still holds."""
        return 1 + len(self.forks)

    @property
    def is_prefill(self) -> bool:
        """Whether the next step runs prompt (or recomputed) tokens rather than one decode token."""
        return not self.output_token_ids or self.num_uncomputed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole concatenation."""
        split = len(self.prompt_token_ids)
        if end <= split:
            return self.prompt_token_ids[start:end]
        if start >= split:
            return self.output_token_ids[start - split : end - split]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - split]

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
