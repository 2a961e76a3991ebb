"""How one request samples and when it stops (the OpenAI knobs, validated once at the edge)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    # 0 is greedy; top_k 0 and top_p 1.0 switch those filters off.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # Same seed, same prompt, same output, whatever else is in the batch.
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Log-probabilities of the sampled token and of this many top alternatives (None: none).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of an n > 1 request.

        Choice 0 is the request itself, so n=1 samples exactly as before. A seeded request gives every
        other choice a seed of its own, mixed from (seed, index): the choices differ from each other,
        yet the same request repeats all of them. Unseeded choices draw from the engine's generator.
        """
        if index == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=_choice_seed(self.seed, index))


def _choice_seed(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): neighbouring choices get unrelated seeds."""
    z = (seed * 0x9E3779B97F4A7C15 + index) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)
