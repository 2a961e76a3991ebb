"""The rows of `bench replay --sim-fleet`: a policy and how its gateway is told about the simulated
workers (bundled, or foreign with a capacity told or not), or a peer router in its place; the
workers every row gets, counting in the gateway's unit or their own; the gateway config each row
runs; and the `--modes` and `--peers` flags that name the rows. Pure: the processes are
bench.row_fleets'."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.local_fleet import SimWorkers, gateway_config
from bench.peers import PEER_ROWS, PEER_VARIANTS
from bench.shared_flags import INDEX_POLICIES
from gateway.gateway_config import TEXT_SPEC
from workers.sim.profiles import get_profile

# --sim-unit: the workers' own unit, and the KV block of `blocks64`.
SIM_UNITS = ("words", "blocks64")
BLOCKS64 = 64


@dataclass(frozen=True, slots=True)
class Mode:
    """How the gateway knows the simulated workers' caches. Precise: declared bundled, it follows
    their KV events. Approximate: declared foreign (`kind: openai`), it predicts their caches from its
    own routing, told a capacity of `capacity_factor` times their true pool (None: told none, so the
    gateway's own default, or what it learns, applies)."""

    precise: bool
    capacity_factor: float | None = None
    # Routed on the prompt's text (`tokenizer: text`), not tokenized: with --text only.
    on_text: bool = False
    # limits.prefill_depth (None: every request sent at once).
    prefill_depth: int | None = None

    @property
    def name(self) -> str:
        return self._base_name + ("" if self.prefill_depth is None else f" queued {self.prefill_depth}")

    @property
    def _base_name(self) -> str:
        if self.precise:
            return "precise"
        if self.on_text:
            return "approx text"
        return (
            "approx cap absent" if self.capacity_factor is None else f"approx cap x{self.capacity_factor:g}"
        )

    def capacity_blocks(self, num_blocks: int) -> int | None:
        """The capacity the gateway is told for workers of `num_blocks` blocks (None: none)."""
        if self.precise or self.capacity_factor is None:
            return None
        return max(1, round(self.capacity_factor * num_blocks))


PRECISE = Mode(precise=True)
APPROX = Mode(precise=False)
TEXT = Mode(precise=False, on_text=True)
FLEET_MODES = (Mode(False, 0.25), Mode(False, 1.0), Mode(False, 16.0), APPROX, PRECISE)


@dataclass(frozen=True, slots=True)
class Row:
    """One row of the comparison: a policy, and how its gateway is told about the workers."""

    policy: str
    mode: Mode

    @property
    def name(self) -> str:
        return f"{self.policy} {self.mode.name}" if self.policy in INDEX_POLICIES else self.policy


@dataclass(frozen=True, slots=True)
class PeerRow:
    """A row with a peer router (bench.peers.PEER_ROWS) in place of the gateway."""

    router: str

    @property
    def name(self) -> str:
        return self.router


def fleet_rows(policies: Sequence[str], modes: Sequence[Mode], plain: Mode = PRECISE) -> list[Row]:
    """A row per mode for the policies that read the index, one for the others in the `plain` mode
    (precise: bundled workers, whose load reports they read; APPROX where the workers count in
    another unit and must be declared foreign). Rows of one mode come together, so that the index
    policies run side by side (--parallel) under the same conditions and read next to each other."""
    index = [p for p in policies if p in INDEX_POLICIES]
    return [Row(p, m) for m in modes for p in index] + [
        Row(p, plain) for p in policies if p not in INDEX_POLICIES
    ]


def row_gateway_config(
    model: str,
    worker_urls: Sequence[str],
    policy: str,
    mode: Mode,
    pool: tuple[int, int],
    port: int,
    text: bool = False,
    prefix_aware: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """local_fleet's gateway config, with the workers declared as the mode says; `pool` is their
    (block size, blocks) as the gateway is told them, in its own tokens. Ids are the workers' own (w0,
    w1, ...) either way, so rows compare. `text`: the prompts come as text, which the gateway reads
    with the default tokenizer (SmolLM2's) whatever the model, as a gateway before a backend with a
    tokenizer of its own would. `prefix_aware`: knobs of that policy's config (--prefix-aware)."""
    held = {} if mode.prefill_depth is None else {"limits": {"prefill_depth": mode.prefill_depth}}
    config = gateway_config(model, worker_urls, policy, port, **held)
    if prefix_aware:
        config["routing"]["prefix_aware"] = dict(prefix_aware)
    if text:
        config["models"] = {model: {"tokenizer": TEXT_SPEC if mode.on_text else "default"}}
    if mode.precise:
        config["replicas"] = [{"url": url, "kind": "bundled"} for url in worker_urls]
        return config
    block_size, num_blocks = pool
    capacity = mode.capacity_blocks(num_blocks)
    told = {} if capacity is None else {"capacity_blocks": capacity}
    config["replicas"] = [
        {"url": url, "id": f"w{i}", "kind": "openai", "model": model, "block_size": block_size, **told}
        for i, url in enumerate(worker_urls)
    ]
    return config


@dataclass(frozen=True, slots=True)
class FleetWorkers:
    """The simulated workers of every row: how many, with which profile and pool, and the flags that
    make them count in their own unit (none: the gateway's)."""

    spec: SimWorkers
    flags: tuple[str, ...] = ()

    @property
    def block_size(self) -> int:
        return self.spec.block_size or get_profile(self.spec.profile).block_size


def fleet_workers(count: int, profile: str, pool: tuple[int, int], unit: str | None) -> FleetWorkers:
    """`count` workers of `profile` with `pool` (block size, blocks), counting in `unit` (SIM_UNITS;
    None: the gateway's tokens). blocks64 keeps the pool's tokens, in blocks of 64."""
    block_size, num_blocks = pool
    if unit is None:
        return FleetWorkers(SimWorkers(count, profile, block_size, num_blocks))
    if unit == "words":
        return FleetWorkers(SimWorkers(count, profile, block_size, num_blocks), ("--sim-tokenizer", "words"))
    if unit == "blocks64":
        return FleetWorkers(SimWorkers(count, profile, BLOCKS64, max(1, num_blocks * block_size // BLOCKS64)))
    raise ValueError(f"unit must be one of {SIM_UNITS}, got {unit!r}")


def _mode(item: str) -> Mode:
    """One of `--modes`' items; ValueError when it names none."""
    item, at, depth_text = item.partition("@")
    depth = int(depth_text) if at else None
    if depth is not None and depth < 1:
        raise ValueError(depth_text)
    kind, _, factor = item.partition(":")
    if kind == "precise" and not factor:
        return Mode(True, prefill_depth=depth)
    if kind == "text" and not factor:
        return Mode(False, on_text=True, prefill_depth=depth)
    if kind == "approx":
        capacity_factor = float(factor) if factor else None
        if capacity_factor is None or capacity_factor > 0:
            return Mode(False, capacity_factor, prefill_depth=depth)
    raise ValueError(item)


def parse_peers(text: str) -> tuple[str, ...]:
    """`--peers`: peer rows, comma-separated: a row's full name (bench.peers.PEER_ROWS, PEER_VARIANTS)
    or a router's, for all of its PEER_ROWS (sglang, vllm-router)."""
    rows: list[str] = []
    for item in (i.strip() for i in text.split(",") if i.strip()):
        named = [r for r in PEER_ROWS if r == item or r.startswith(f"{item} ")]
        named += [item] if item in PEER_VARIANTS else []
        if not named:
            raise argparse.ArgumentTypeError(
                f"expected rows of {', '.join([*PEER_ROWS, *PEER_VARIANTS])} or a router's name; got {item!r}"
            )
        rows += [r for r in named if r not in rows]
    return tuple(rows)


def parse_modes(text: str) -> tuple[Mode, ...]:
    """`--modes`: precise, approx (no capacity told), approx:F (F > 0 times the true pool) and text
    (approx, routed on the prompt's text), comma-separated; each may end in @N, the gateway's
    limits.prefill_depth (N prompts at most computing at once on a replica, the rest held)."""
    try:
        modes = tuple(_mode(item.strip()) for item in text.split(",") if item.strip())
    except ValueError:
        modes = ()
    if not modes:
        raise argparse.ArgumentTypeError(
            "expected precise, approx, approx:FACTOR (FACTOR > 0) or text, each with an optional @DEPTH"
            f" (DEPTH >= 1), comma-separated; got {text!r}"
        )
    return modes
