"""How long one step of an expert-parallel group takes: G GPUs serving one MoE model as one replica.

The layout is DeepSeek-V3's for serving (SGLang's DP attention, vLLM's data + expert parallelism):
every rank holds the attention, the gate, the embeddings and the LM head whole, and 1/G of the
routed experts. Attention is data-parallel: a sequence lives on one rank (here rank seq_id mod G,
round robin), which holds its KV and runs its attention; per MoE layer the step's tokens go to their
experts' ranks and back, an all-to-all each way. The ranks move in lockstep, layer by layer, so the
step takes

    t = max over ranks of that rank's dense time   CostModel's form over the rank's own sequences
      + max(distinct * expert_read_s,              the slowest rank's experts (moe.ExpertLayout):
            picks * expert_pair_s)                 weight reads or FLOPs, whichever is larger
      + layers * 2 * link.time(bytes / 2)          dispatch and combine of the busiest sender

- All-to-all bytes per layer for a rank holding t tokens: t * hidden * dtype bytes * top_k * 2
  (dispatch, combine) * (G-1)/G, each of a token's k copies leaving unless its expert is local.
  That is a copy per expert, as a plain all-to-all sends; DeepEP sends one per destination rank,
  fewer when a token's experts share one. Destinations are taken as uniform: a skewed gate's hot
  rank also receives more than its share, which is not priced here (its expert work, priced,
  dominates it).
- The terms add: communication is not overlapped with computation (DeepSeek's two micro-batches
  overlap them; this is the plain schedule).
- The group's scheduler is one: one KV pool of every rank's memory, one prefix cache, G ranks'
  token and sequence budgets, one rank's tokens at most for one sequence's chunk. Real DP-attention
  ranks each schedule and cache their own sequences, so two differences remain: sharing the cache is
  what a cache-aware router across the ranks approaches (the group's hit rate here is an upper
  bound), and two long prompts of one rank may share a step here, beyond that rank's budget, where
  its own scheduler would have run them one after the other.
- A StepShape carries no sequence ids, so `time(shape)` prices it as one rank's work, the others
  idle: a single long prompt is that.

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from workers.engine.batch import ScheduledChunk
from workers.sim.cost_model import CostModel, StepShape, step_shape
from workers.sim.link import KvLink
from workers.sim.moe_routing import ExpertLayout


def all_to_all_bytes(tokens: int, hidden: int, dtype_bytes: int, top_k: int, group: int) -> float:
    """Bytes one rank holding `tokens` tokens sends per MoE layer, dispatch and combine together."""
    return tokens * hidden * dtype_bytes * top_k * 2 * (group - 1) / group


class StepTerms(NamedTuple):
    """A step's time by term, for the reports that explain a layout's numbers."""

    dense_s: float
    experts_s: float
    all_to_all_s: float
    imbalance: float

    @property
    def total_s(self) -> float:
        return self.dense_s + self.experts_s + self.all_to_all_s


@dataclass(frozen=True, slots=True)
class ExpertParallelCost:
    # One rank's attention, gate, embeddings and LM head: a dense model's terms, routed experts aside.
    dense: CostModel
    layout: ExpertLayout
    layers: int
    hidden: int
    dtype_bytes: int
    # Seconds of one token's FLOPs through one expert in every layer.
    expert_pair_s: float
    # Seconds to read one expert's weights in every layer.
    expert_read_s: float
    # Each rank's link to the others, for the all-to-all.
    link: KvLink

    def terms(self, ranks: Sequence[StepShape]) -> StepTerms:
        """The terms of a step whose ranks run these shapes (ranks not listed are idle)."""
        if len(ranks) > self.layout.group:
            raise ValueError(f"{len(ranks)} ranks' shapes for a group of {self.layout.group}")
        tokens = sum(s.tokens for s in ranks)
        if tokens == 0:
            return StepTerms(0.0, 0.0, 0.0, 1.0)
        load = self.layout.slowest(tokens)
        experts_s = max(load.distinct * self.expert_read_s, load.picks * self.expert_pair_s)
        sent = all_to_all_bytes(
            max(s.tokens for s in ranks), self.hidden, self.dtype_bytes, self.layout.top_k, self.layout.group
        )
        all_to_all_s = self.layers * 2 * self.link.time(math.ceil(sent / 2))
        return StepTerms(max(self.dense.time(s) for s in ranks), experts_s, all_to_all_s, load.imbalance)

    def time(self, shape: StepShape) -> float:
        """Seconds for a step of this shape run by one rank, the others idle."""
        return self.terms([shape]).total_s

    def step_time(self, chunks: Iterable[ScheduledChunk]) -> float:
        """Seconds for a step of these chunks, each on its sequence's rank."""
        ranks: list[list[ScheduledChunk]] = [[] for _ in range(self.layout.group)]
        for c in chunks:
            ranks[c.seq_id % self.layout.group].append(c)
        return self.terms([step_shape(r) for r in ranks]).total_s
