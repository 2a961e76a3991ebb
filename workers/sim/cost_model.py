"""How long one engine step takes, predicted from the shape of the batch it runs.

The form, and why:

    t = step_s                                     fixed per step: scheduling, launches, host sync
      + sample_s   * sampled                       per sequence sampled: LM-head row, sampler
      + max(weights_s, token_s * tokens)           dense layers over every token in the step
      + attn_pair_s * prefill_attn_pairs           prefill attention, compute-bound
      + kv_token_s  * decode_kv_tokens             decode attention, bound by reading the KV cache

- Dense layers (QKV/O projections, MLP) do the same work per token whether the token is a prompt
  token or a decode, and every step streams all the weights once. So their time is a roofline:
  the larger of "read the weights" (`weights_s`, paid by any step) and "do the FLOPs"
  (`token_s` per token). Below the ridge (`weights_s / token_s` tokens) extra decodes ride along
  for free, which is why batching decodes pays; above it the step is compute-bound and additive.
- Prefill attention: a chunk of q tokens starting at position p has its queries attend causally to
  p + 1 ... p + q keys, `q*p + q*(q+1)/2` (query, key) pairs, each a fixed number of FLOPs. This is
  the ∝ q·(p+q) term, counted exactly for the causal mask that kernels exploit. It is what makes a
  long prompt cost more per token than a short one, and a cached prefix save more than its tokens.
- Decode attention: one query per sequence reads the K and V of its whole context, so its time is
  memory traffic, `kv_token_s` per KV token read; FLOPs are negligible beside it.
- A chunk of one token is priced as a decode (one query reading its context), whatever the scheduler
  calls it: the kernels cannot tell a one-token prompt tail from a decode either.
- The terms add because the kernels run one after another within a step; only the dense layers,
  where weight reads and FLOPs overlap within one GEMM, take a max.

Pure: no clock, no I/O. Fitted coefficients (calibrate) and derived ones (profiles) both land here.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Protocol

from workers.engine.batch import ScheduledChunk


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step's cost depends on; shapes of disjoint chunk sets add up to the shape of their union."""

    # Tokens of chunks longer than one token, and their causal (query, key) pairs.
    prefill_tokens: int = 0
    prefill_attn_pairs: int = 0
    # One-token chunks, and the KV tokens they read (their context, the new token included).
    decode_seqs: int = 0
    decode_kv_tokens: int = 0
    # Chunks that end at their sequence's last token, so the step samples for them.
    sampled: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ValueError(f"{f.name} must be >= 0, got {value}")

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def tokens(self) -> int:
        """Every token through the dense layers this step."""
        return self.prefill_tokens + self.decode_seqs


def chunk_shape(start_pos: int, num_tokens: int, sample: bool = True) -> StepShape:
    """The shape of one chunk of `num_tokens` tokens whose first token sits at `start_pos`."""
    if num_tokens < 1 or start_pos < 0:
        raise ValueError(f"a chunk needs num_tokens >= 1 and start_pos >= 0, got {num_tokens}, {start_pos}")
    sampled = int(sample)
    if num_tokens == 1:
        return StepShape(decode_seqs=1, decode_kv_tokens=start_pos + 1, sampled=sampled)
    return StepShape(
        prefill_tokens=num_tokens, prefill_attn_pairs=causal_pairs(num_tokens, start_pos), sampled=sampled
    )


def causal_pairs(num_tokens: int, start_pos: int) -> int:
    """(query, key) pairs of a causal chunk: each query sees the context before it and itself."""
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


def step_shape(chunks: Iterable[ScheduledChunk]) -> StepShape:
    """The sum of the chunks' shapes, summed in plain integers: the fleet simulator prices every step
    of every replica through here, and one StepShape per chunk was most of its run time."""
    prefill_tokens = pairs = decode_seqs = kv_tokens = sampled = 0
    for c in chunks:
        q, p = len(c.token_ids), c.start_pos
        if q == 1:
            decode_seqs += 1
            kv_tokens += p + 1
        else:
            prefill_tokens += q
            pairs += causal_pairs(q, p)
        sampled += c.sample
    return StepShape(prefill_tokens, pairs, decode_seqs, kv_tokens, sampled)


class StepCost(Protocol):
    """What a simulated replica needs of its cost model: this module's CostModel for one GPU, or
    ep_cost's ExpertParallelCost for a group of them serving one MoE model."""

    def time(self, shape: StepShape) -> float: ...

    def step_time(self, chunks: Iterable[ScheduledChunk]) -> float: ...


@dataclass(frozen=True, slots=True)
class CostModel:
    """Seconds per unit of each term of the form in the module docstring; all non-negative."""

    step_s: float
    sample_s: float
    token_s: float
    weights_s: float
    attn_pair_s: float
    kv_token_s: float

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not value >= 0:  # NaN fails too
                raise ValueError(f"{f.name} must be a non-negative number of seconds, got {value}")

    def time(self, shape: StepShape) -> float:
        """Seconds for a step of this shape; an empty step runs nothing and costs nothing."""
        if shape.tokens == 0:
            return 0.0
        return (
            self.step_s
            + self.sample_s * shape.sampled
            + max(self.weights_s, self.token_s * shape.tokens)
            + self.attn_pair_s * shape.prefill_attn_pairs
            + self.kv_token_s * shape.decode_kv_tokens
        )

    def step_time(self, chunks: Iterable[ScheduledChunk]) -> float:
        return self.time(step_shape(chunks))

    @property
    def ridge_tokens(self) -> float:
        """Tokens per step above which the dense layers are compute-bound rather than weight-bound."""
        return self.weights_s / self.token_s if self.token_s else float("inf")
