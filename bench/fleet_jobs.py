"""What `bench fleet` simulates: a job per (policy, mode, configured capacity), approximate mode only
for the policies it changes, and the `--capacity-priors` values the capacities come from."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from bench.shared_flags import INDEX_POLICIES


@dataclass(frozen=True, slots=True)
class Job:
    """One (policy, mode) to simulate; in approximate mode, with the replicas' configured capacity as
    a multiple of their true pool (None: not configured)."""

    policy: str
    mode: str
    capacity_scale: float | None = None

    @property
    def key(self) -> str:
        """Its name in the table and the JSON: the policy, then the mode unless precise, then the
        capacity unless it is the true one."""
        if self.mode == "precise":
            return self.policy
        name = f"{self.policy}_{self.mode}"
        if self.capacity_scale is None:
            return f"{name}_unset"
        return name if self.capacity_scale == 1.0 else f"{name}_x{self.capacity_scale:g}"


def jobs_of(
    policies: list[str],
    modes: list[str],
    capacity_scales: Sequence[float | None] = (1.0,),
    foreign: bool = False,
) -> list[Job]:
    """What to simulate: approximate mode changes only what the index policies read, so only they
    run in it, once per configured capacity. Replicas of a `foreign` unit publish no events the
    gateway could follow: every policy runs in approximate mode."""
    if foreign:
        if "approximate" not in modes:
            raise ValueError("replicas counting in another unit can only be routed in approximate mode")
        first = capacity_scales[0]
        index = [Job(p, "approximate", c) for c in capacity_scales for p in policies if p in INDEX_POLICIES]
        return index + [Job(p, "approximate", first) for p in policies if p not in INDEX_POLICIES]
    jobs = [Job(p, "precise") for p in policies if "precise" in modes]
    if "approximate" in modes:
        jobs += [Job(p, "approximate", c) for c in capacity_scales for p in policies if p in INDEX_POLICIES]
    return jobs


def parse_capacity_prior(text: str) -> float | None:
    """`--capacity-priors` value: a positive multiple of the true capacity, or 'unset'."""
    if text == "unset":
        return None
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a capacity prior is a positive multiple or 'unset', got {text!r}")
    return value
