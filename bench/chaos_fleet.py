"""The fleet every chaos scenario and fault test builds on (bench.local_fleet's processes, with chaos's
settings): h100-8b workers with 16-token blocks, gateways whose health checks are fast enough for a
recovery to be timed, and the questions put to a gateway about its replicas."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.local_fleet import SimWorkers, gateway_config
from bench.probes import get_json
from workers.sim.profiles import get_profile, profile_to_json

MODEL = "Llama-3.1-8B-Instruct"  # the h100-8b profile's model, which every worker here serves
BLOCK_SIZE = 16
# The simulated worker of every scenario (`count` is not used: each is started on its own).
WORKER = SimWorkers(1, "h100-8b", BLOCK_SIZE, 2048)
# A fleet's start-up, and how often a scenario polls (finer than any recovery time worth reporting).
START_TIMEOUT_S = 120.0
POLL_S = 0.05
FAST_HEALTH = {"interval_s": 0.2, "timeout_s": 0.5, "failures": 2, "load_interval_s": 0.05}


def sim_profile(
    workdir: Path, name: str, *, step_s: float | None = None, max_num_seqs: int | None = None
) -> str:
    """h100-8b with 16-token blocks, optionally a larger fixed cost per step (`step_s`: slow steps keep
    streams going long enough to cut) and a narrower batch (`max_num_seqs`: a queue that fills); the
    path of its JSON, for `--sim-profile`."""
    profile = get_profile("h100-8b")
    changes: dict[str, Any] = {"name": name, "block_size": BLOCK_SIZE}
    if max_num_seqs is not None:
        changes["max_num_seqs"] = max_num_seqs
    if step_s is not None:
        changes["cost"] = dataclasses.replace(profile.cost, step_s=step_s)
    path = workdir / f"{name}.json"
    workdir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_json(dataclasses.replace(profile, **changes))))
    return str(path)


def fast_gateway_config(urls: Sequence[str], **sections: Any) -> dict[str, Any]:
    """A gateway over `urls` that routes the token-id prompts sent here, with fast health checks;
    `sections` replace whole top-level sections."""
    return gateway_config(MODEL, urls, **{"health": FAST_HEALTH, **sections})


def replicas(gateway_url: str) -> dict[str, dict[str, Any]]:
    """The gateway's replicas by id, as /admin/replicas lists them (empty if it does not answer)."""
    listing = get_json(f"{gateway_url}/admin/replicas")
    rows = listing.get("replicas", []) if isinstance(listing, dict) else []
    return {row["id"]: row for row in rows}


def routable(gateway_url: str, replica: str) -> bool:
    row = replicas(gateway_url).get(replica)
    return row is not None and row["healthy"] and not row["draining"]


def unhealthy(gateway_url: str, replica: str) -> bool:
    row = replicas(gateway_url).get(replica)
    return row is not None and not row["healthy"]
