"""`bench replay --sim-fleet`: one workload through a gateway per row (bench.replay_rows), each over
fresh simulated workers (bench.row_fleets), `--parallel` rows at a time, and the comparison's table,
JSON and plot."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import tempfile
from pathlib import Path
from typing import Any

from bench.loadgen import REPLICA_HEADER, replay_sessions
from bench.replay_result import ReplayResult
from bench.replay_rows import APPROX, PRECISE, PeerRow, Row, fleet_rows, fleet_workers
from bench.replay_tables import fleet_panels, fleet_tables
from bench.report import bar_panels, write_json
from bench.row_fleets import peer_fleet, row_fleet
from bench.workloads import Session, total_turns
from workers.completion_replies import WORKER_HEADER


def imbalance(requests_per_replica: dict[str, int], replicas: int) -> float:
    """max/mean of requests per replica, replicas that got none counted in the mean."""
    total = sum(requests_per_replica.values())
    return max(requests_per_replica.values(), default=0) * replicas / total if total else 0.0


def _check_fleet_flags(args: argparse.Namespace) -> None:
    """What --sim-fleet's workers can serve: text only where they count words, KV events in the
    gateway's unit only, and sglang-router only with text prompts."""
    if args.sim_fleet < 1 or args.parallel < 1:
        raise SystemExit("prefixgate bench replay: --sim-fleet and --parallel need at least 1")
    if args.text != (args.sim_unit == "words"):
        raise SystemExit(
            "prefixgate bench replay: --text and --sim-unit words go together with --sim-fleet: only "
            "simulated workers that count words read text"
        )
    if args.sim_unit is not None and any(m.precise for m in args.modes):
        raise SystemExit(
            "prefixgate bench replay: --sim-unit: the gateway follows no KV events in another unit; "
            "give approx modes only"
        )
    if not args.text and any(r.startswith("sglang") for r in args.peers):
        raise SystemExit(
            "prefixgate bench replay: sglang-router routes text prompts only: --text --sim-unit words"
        )


def run_fleet(
    args: argparse.Namespace, name: str, params: dict[str, Any], sessions: list[Session], pace: str
) -> dict[str, Any]:
    """Per row: fresh workers (empty caches), a gateway with the row's policy and mode (or a peer
    router), the same sessions; `--parallel` rows at a time, each wave's fleets stopped before the
    next starts. `pace` says how the workload is paced, for the title."""
    _check_fleet_flags(args)
    pool = (args.block_size, args.num_blocks)
    workers = fleet_workers(args.sim_fleet, args.sim_profile, pool, args.sim_unit)
    spec = workers.spec
    plain = PRECISE if args.sim_unit is None else APPROX
    plan: list[Row | PeerRow] = [*fleet_rows(args.policies, args.modes, plain), *map(PeerRow, args.peers)]

    def serve(fleets: contextlib.ExitStack, workdir: Path, row: Row | PeerRow) -> str:
        if isinstance(row, PeerRow):
            return fleets.enter_context(peer_fleet(workdir, workers, row.router))
        knobs = dict(args.prefix_aware or ())
        return fleets.enter_context(row_fleet(workdir, workers, row.policy, row.mode, pool, args.text, knobs))

    async def wave_replays(urls: list[str], first: int) -> list[ReplayResult]:
        return await asyncio.gather(
            *(
                replay_sessions(
                    url,
                    sessions,
                    model=spec.model,
                    concurrency_limit=args.concurrency_limit,
                    timeout_s=args.timeout,
                    label=f"{first + j + 1}/{len(plan)} {plan[first + j].name}",
                    position=j,
                    text=args.text,
                    replica_header=WORKER_HEADER if isinstance(plan[first + j], PeerRow) else REPLICA_HEADER,
                )
                for j, url in enumerate(urls)
            )
        )

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="prefixgate-replay-") as tmp:
        for first in range(0, len(plan), args.parallel):
            wave = plan[first : first + args.parallel]
            with contextlib.ExitStack() as fleets:
                urls = [serve(fleets, Path(tmp) / f"row{first + j}", row) for j, row in enumerate(wave)]
                results = asyncio.run(wave_replays(urls, first))
            for row, result in zip(wave, results, strict=True):
                summary = result.summary()
                how = (
                    {"policy": row.router, "mode": "peer", "capacity_blocks": None}
                    if isinstance(row, PeerRow)
                    else {
                        "policy": row.policy,
                        "mode": row.mode.name,
                        "capacity_blocks": row.mode.capacity_blocks(args.num_blocks),
                    }
                )
                rows[row.name] = {
                    **summary,
                    **how,
                    "imbalance": imbalance(summary["requests_per_replica"], spec.count),
                }
    unit = args.sim_unit or "tokens"
    payload = {
        "workload": name,
        "workload_params": params,
        "requests": total_turns(sessions),
        "rate": args.rate,
        "duration_s": args.duration,
        "speed": args.speed,
        "text": args.text,
        "sim_fleet": {**dataclasses.asdict(spec), "model": spec.model, "unit": unit},
        "prefix_aware": dict(args.prefix_aware or ()),
        "policies": rows,
    }
    counted = {"tokens": "", "words": " words", "blocks64": " tokens"}[unit]
    title = (
        f"replay: {name}, {pace} through the gateway over {spec.count} "
        f"{spec.profile} workers ({spec.num_blocks} blocks of {spec.block_size}{counted})"
    )
    if args.text:
        title += ", text prompts"
    if args.prefix_aware:
        title += ", prefix_aware " + " ".join(f"{k}={v:g}" for k, v in args.prefix_aware)
    print(fleet_tables(title, payload))
    if args.json:
        write_json(args.json, payload)
        bar_panels(Path(args.json).with_suffix(".png"), title, fleet_panels(payload))
    return payload
