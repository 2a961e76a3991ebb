"""`prefixgate bench chaos` (`make chaos`): the fault scenarios of tests/faults as one quick exercise on
real processes, with a results table.

Each scenario starts a fleet of its own — simulated workers, gateways and, where it needs one, a
private redis-server — as child processes from the `prefixgate` command line (as bench.local_fleet
does), drives it with client traffic, injects one fault, removes it, and reports the requests sent,
how many succeeded and failed, the slowest answer, how long the fleet took to be whole again once the
fault was gone, and whether every check held:

- replica_killed: one of two workers is SIGKILLed under steady load, then restarted on its port.
  Requests that had sent nothing are retried on the survivor; the restarted worker rejoins.
- redis_down: two gateways and two workers share one Redis, which is SIGKILLed under load and
  restarted empty on its port. The gateways route on their local index meanwhile (degraded, no
  request lost), then reconnect; the workers re-register.
- overload: a burst of concurrent requests on narrow workers (2 running + 2 waiting each) behind a
  gateway with a small `limits.max_inflight`: every answer is a 200 or a 429 with Retry-After (never a
  5xx), and the gateway's resident memory grows by less than a stated bound.
- disconnect_storm: 500 clients start streams through the gateway and all drop mid-stream: every
  upstream sequence is aborted (the workers' running, waiting and referenced KV blocks back to 0)
  and the gateway holds no request any more.
- stuck_upstream: one worker is SIGSTOPped under load: no request waits past the gateway's
  `limits.request_timeout_s`, the worker is marked unhealthy and traffic moves to the other; after
  SIGCONT it is routable again.
- streams_replica_killed: a streaming grouped replay over four workers, one SIGKILLed and restarted
  mid-replay, with bundled workers and with the same workers declared foreign: no stream is truncated
  (one whose worker died mid-answer is continued on another, gateway.forward.migration) and none fails.

This module is the command; the scenarios are in bench.chaos_scenarios and bench.chaos_streams, on
bench.chaos_fleet's processes and bench.chaos_traffic's clients, which tests/faults share to make
the same faults with finer checks.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.chaos_scenarios import (
    ScenarioResult,
    disconnect_storm,
    overload,
    redis_down,
    replica_killed,
    stuck_upstream,
)
from bench.chaos_streams import streams_replica_killed
from bench.report import bar_panels, format_table, write_json

SCENARIOS: dict[str, Callable[[Path], ScenarioResult]] = {
    "replica_killed": replica_killed,
    "redis_down": redis_down,
    "overload": overload,
    "disconnect_storm": disconnect_storm,
    "stuck_upstream": stuck_upstream,
    "streams_replica_killed": streams_replica_killed,
}


# -- the command ---------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only", nargs="+", choices=list(SCENARIOS), default=None, help="run these scenarios (default: all)"
    )
    parser.add_argument("--json", default=None, help="write the results here (and a PNG next to it)")
    parser.add_argument("--plot", default=None, help="the PNG's path (default: the JSON's, .png)")
    parser.add_argument("--workdir", default=None, help="keep the processes' logs here (default: a temp dir)")


def _row(r: ScenarioResult) -> list[Any]:
    recovered = "-" if r.recovered_s is None else round(r.recovered_s, 2)
    return [
        r.scenario, r.requests, r.succeeded, r.refused, r.failed, round(r.max_latency_s, 2), recovered,
        "pass" if r.passed else "FAIL",
    ]  # fmt: skip


def run(args: argparse.Namespace) -> dict[str, Any]:
    names = args.only or list(SCENARIOS)
    results: list[ScenarioResult] = []
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        root = (
            Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        )
        for name in names:
            t0 = time.monotonic()
            try:
                result = SCENARIOS[name](root / name)
            except Exception as error:  # one scenario's breakage must not hide the others' results
                result = ScenarioResult(name, error=f"{type(error).__name__}: {error}")
            result.details["seconds"] = round(time.monotonic() - t0, 1)
            results.append(result)
            status = "pass" if result.passed else "FAIL"
            print(f"{name}: {status} in {result.details['seconds']} s", flush=True)
    header = [
        "scenario",
        "requests",
        "succeeded",
        "refused 429",
        "failed",
        "max latency s",
        "recovered in s",
        "result",
    ]
    print()
    print(
        format_table(
            "chaos: faults on a live fleet (loopback, real processes)", header, [_row(r) for r in results]
        )
    )
    for r in results:
        broken = [name for name, ok in r.checks.items() if not ok]
        if r.error or broken:
            print(f"  {r.scenario}: {r.error or 'failed checks: ' + '; '.join(broken)}")
    payload = {
        "scenarios": [r.to_json() for r in results],
        "passed": all(r.passed for r in results),
        "seconds": round(time.monotonic() - started, 1),
    }
    if args.json:
        write_json(args.json, payload)
        plot = args.plot or str(Path(args.json).with_suffix(".png"))
        bar_panels(
            plot,
            "chaos: each fault's cost and recovery",
            [
                ("max latency (s)", {r.scenario: r.max_latency_s for r in results}),
                ("recovered in (s)", {r.scenario: r.recovered_s or 0.0 for r in results}),
                ("answered as specified (%)", {r.scenario: _share(r) for r in results}),
            ],
        )
        print(f"wrote {args.json} and {plot}")
    if not payload["passed"]:
        raise SystemExit(1)
    return payload


def _share(r: ScenarioResult) -> float:
    """Requests that got a 200 or a proper 429, in percent."""
    return 100.0 * (r.succeeded + r.refused) / r.requests if r.requests else 0.0
