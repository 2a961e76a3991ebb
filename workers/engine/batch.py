"""The contract between the scheduler (pure, no torch) and the model runner: one step's work."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One sequence's share of a step: a prefill chunk, or the single token of a decode."""

    seq_id: int
    # The tokens to run now; their KV is written into the sequence's blocks.
    token_ids: list[int]
    # Position of token_ids[0] in the sequence: the tokens before it (cached prefix, earlier chunks,
    # earlier decodes) are already in the KV cache.
    start_pos: int
    # Physical KV block ids covering positions [0, start_pos + len(token_ids)).
    block_table: list[int]
    # The chunk ends at the sequence's last token, so the step samples the next token for it.
    sample: bool
    sampling: SamplingParams
    # Tokens generated so far by this sequence (seeded sampling derives its generator state from it).
    num_generated: int = 0


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the runner returns per sampled chunk, in the order of the chunks with sample=True."""

    seq_id: int
    token_id: int
    # log p(token) and the top alternatives as (token id, log p), when sampling.logprobs is set.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Runner(Protocol):
    """What runs a step: the model (ModelRunner) or a cost model (workers.sim.SimRunner)."""

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[StepOutput]: ...
