"""A mixture-of-experts model's shape, and where its gate sends a step's tokens: what the time of an
expert-parallel step depends on (ep_cost).

Routing. Each token's gate picks `top_k` of the model's E experts, expert e with probability pi_e
(summing to k). A uniform gate has pi_e = k/E; a skewed one (`Gate(zipf=s)`) weighs expert e by
(e+1)^-s, the few-experts-win shape that load balancing exists for, capped at every token. b tokens
leave expert e untouched with probability (1 - pi_e)^b, so they touch sum_e 1 - (1 - pi_e)^b
distinct experts, E * (1 - (1 - k/E)^b) for a uniform gate. That count, not the token count, is
what a decode step reads weights for: each touched expert's weights are read once however many
tokens it has, so a small batch of an MoE model reads only part of it.

Placement. A group of G ranks holds the experts in contiguous slices of E/G (expert e on rank
e * G // E), the plain expert-parallel layout, with no replicas of hot experts (EPLB's remedy, not
modelled). The group waits for its slowest rank at every layer: its expert work is set by the most
picks (FLOPs) and the most distinct experts (weight reads) any rank has. Each is a sum of many small
draws, so a rank's count is taken as its mean plus z_G standard deviations, z_G being the expected
largest of G standard normals (Blom's approximation; 0 for G = 1), capped at what the rank can
hold. The picks' variance per token is the hypergeometric one of a uniform gate, k * s * (1 - s) *
(E - k) / (E - 1) for a rank with share s of the picks; for a skewed gate it is an approximation,
beside a mean that dominates there. Against a Monte Carlo of a uniform gate this is within 10% from
4 tokens a step up (tests/workers/sim/test_sim_moe_routing.py).

Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import NormalDist


@dataclass(frozen=True, slots=True)
class MoeModel:
    """A decoder whose every MLP is a top-k routed set of SwiGLU experts (Mixtral, Qwen3-MoE), with
    grouped-query attention and untied embeddings. Parameter counts are per layer unless named."""

    model_name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int
    top_k: int
    expert_intermediate: int
    max_context_len: int
    eos_token_ids: tuple[int, ...]

    @property
    def attention_params(self) -> int:
        """Q and O (hidden x heads * head_dim), K and V (hidden x kv_heads * head_dim)."""
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads)

    @property
    def gate_params(self) -> int:
        return self.hidden * self.experts

    @property
    def expert_params(self) -> int:
        """Gate, up and down projections of one expert."""
        return 3 * self.hidden * self.expert_intermediate

    @property
    def head_params(self) -> int:
        """The LM head's, and as many again in the embedding."""
        return self.vocab * self.hidden

    @property
    def dense_params(self) -> int:
        """What every rank of an expert-parallel group holds whole: all but the routed experts."""
        return self.layers * (self.attention_params + self.gate_params) + 2 * self.head_params

    @property
    def total_params(self) -> int:
        return self.dense_params + self.layers * self.experts * self.expert_params

    @property
    def active_params(self) -> int:
        """Parameters one token goes through: the model cards' "active" count."""
        return self.dense_params + self.layers * self.top_k * self.expert_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True, slots=True)
class Gate:
    """How a gate spreads its picks over the experts: zipf 0 is uniform, s > 0 weighs expert e by
    (e+1)^-s."""

    zipf: float = 0.0

    def __post_init__(self) -> None:
        if not self.zipf >= 0:
            raise ValueError(f"zipf must be >= 0, got {self.zipf}")

    def inclusion(self, experts: int, top_k: int) -> list[float]:
        """pi_e, the chance a token picks expert e: k times its weight's share, except that no expert
        can be picked by more than every token; what a capped expert cannot take goes to the others
        by their weights, so the picks still number k a token."""
        weights = [(e + 1) ** -self.zipf for e in range(experts)]
        capped: set[int] = set()
        while True:
            scale = (top_k - len(capped)) / sum(w for e, w in enumerate(weights) if e not in capped)
            over = {e for e, w in enumerate(weights) if e not in capped and w * scale > 1}
            if not over:
                return [1.0 if e in capped else w * scale for e, w in enumerate(weights)]
            capped |= over

    @property
    def name(self) -> str:
        return "uniform" if self.zipf == 0 else f"zipf {self.zipf:g}"


@dataclass(frozen=True, slots=True)
class RankLoad:
    """The work of the rank a step waits for, and the mean rank's picks beside it."""

    picks: float
    distinct: float
    mean_picks: float

    @property
    def imbalance(self) -> float:
        """Slowest rank's picks over the mean rank's: 1 is perfect balance."""
        return self.picks / self.mean_picks if self.mean_picks else 1.0


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """`experts` experts behind a top-`top_k` gate, in contiguous slices over `group` ranks."""

    experts: int
    top_k: int
    group: int
    gate: Gate = Gate()
    # Per rank: its share of all picks, and the inclusion probability pi_e of each of its experts.
    _ranks: tuple[tuple[float, tuple[float, ...]], ...] = field(init=False, repr=False, compare=False)
    # The expected largest of `group` standard normals.
    _z: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k must be within [1, {self.experts}], got {self.top_k}")
        if self.group < 1 or self.experts % self.group:
            raise ValueError(f"{self.experts} experts do not split evenly over {self.group} ranks")
        inclusion = self.gate.inclusion(self.experts, self.top_k)
        per = self.experts // self.group
        ranks = tuple(
            (sum(inclusion[r * per : (r + 1) * per]) / self.top_k, tuple(inclusion[r * per : (r + 1) * per]))
            for r in range(self.group)
        )
        object.__setattr__(self, "_ranks", ranks)
        object.__setattr__(self, "_z", NormalDist().inv_cdf((self.group - 0.375) / (self.group + 0.25)))

    @property
    def experts_per_rank(self) -> int:
        return self.experts // self.group

    def slowest(self, tokens: int) -> RankLoad:
        """The most picks and the most distinct experts a rank has in a step of `tokens` tokens."""
        k = self.top_k
        # A token picks at most min(k, E/G) of one rank's experts.
        most_picks = tokens * min(k, self.experts_per_rank)
        # Some rank has at least its even share of the picks, whole.
        picks = float(math.ceil(tokens * k / self.group))
        distinct = 0.0
        for share, rank in self._ranks:
            variance = tokens * k * share * (1 - share) * (self.experts - k) / max(self.experts - 1, 1)
            rank_picks = min(tokens * k * share + self._z * math.sqrt(max(variance, 0.0)), most_picks)
            touched = [1 - (1 - pi) ** tokens for pi in rank]
            spread = math.sqrt(sum(d * (1 - d) for d in touched))
            rank_distinct = min(sum(touched) + self._z * spread, len(rank), rank_picks)
            picks, distinct = max(picks, rank_picks), max(distinct, rank_distinct)
        return RankLoad(picks, distinct, tokens * k / self.group)
