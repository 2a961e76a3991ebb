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
    # Choices of an n > 1 request forked off this sequence here, as (seq_id, sampling): each samples
    # its first token from this chunk's last-position logits too. Set only on the chunk that
    # completes the prompt of a request's choice 0, the first time.
    forks: tuple[tuple[int, SamplingParams], ...] = ()


@dataclass(frozen=True, slots=True)
class SampleSlot:
    """One token a step samples: a sampling chunk's own, or one of its forks' from the same logits."""

    # Index of the chunk among the step's chunks with sample=True: the logits row to sample from.
    row: int
    seq_id: int
    sampling: SamplingParams
    num_generated: int


def sample_slots(chunks: Sequence[ScheduledChunk]) -> list[SampleSlot]:
    """What a step samples, in the order its StepOutputs come back: each sampling chunk, followed by
    its forks in order."""
    slots: list[SampleSlot] = []
    for row, chunk in enumerate(c for c in chunks if c.sample):
        slots.append(SampleSlot(row, chunk.seq_id, chunk.sampling, chunk.num_generated))
        slots += [SampleSlot(row, seq_id, sampling, chunk.num_generated) for seq_id, sampling in chunk.forks]
    return slots


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What the runner returns per sample slot (sample_slots): one per chunk with sample=True, each
    followed by one per fork of that chunk."""

    seq_id: int
    token_id: int
    # log p(token) and the top alternatives as (token id, log p), when sampling.logprobs is set.
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class Runner(Protocol):
    """What runs a step: the model (ModelRunner) or a cost model (workers.sim.SimRunner)."""

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[StepOutput]: ...
