"""A simulated replica as both fleet simulators (bench.fleet, bench.pd_fleet) run it and route to it."""

from __future__ import annotations

from policies import ReplicaView
from radix import RadixIndex
from workers.sim.cost_model import chunk_shape
from workers.sim.profiles import Profile
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine


def nominal_prefill_rate(profile: Profile) -> float:
    """Prompt tokens per second of one full-budget prefill step: what est_ttft divides by."""
    tokens = profile.max_num_batched_tokens
    return tokens / profile.cost.time(chunk_shape(0, tokens))


class Replica:
    """A SimEngine on its own virtual clock, its KV events feeding the index in precise mode."""

    def __init__(self, rid: str, profile: Profile, index: RadixIndex, precise: bool) -> None:
        self.id = rid
        self.clock = VirtualClock()
        callbacks = {}
        if precise:
            callbacks = {
                "on_stored": lambda hashes, parent: index.insert(rid, hashes),
                "on_removed": lambda hashes: index.remove(rid, hashes),
                "on_cleared": lambda: index.clear(rid),
            }
        self.engine = SimEngine(profile, clock=self.clock, **callbacks)


def replica_view(
    replica: Replica, matched_blocks: int, index: RadixIndex, prefill_rate: float
) -> ReplicaView:
    """The replica as the gateway would see it: its load and queue from its engine, its cache from
    the index."""
    stats = replica.engine.stats()
    profile = replica.engine.profile
    return ReplicaView(
        id=replica.id,
        block_size=profile.block_size,
        matched_blocks=matched_blocks,
        running=stats.running,
        waiting=stats.waiting,
        queued_prefill_tokens=stats.queued_prefill_tokens,
        max_waiting=profile.max_num_seqs,
        prefill_rate=prefill_rate,
        cached_blocks=index.blocks_of(replica.id),
    )
