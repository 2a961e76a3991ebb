"""What `bench fleet` and `bench replay` read from the same flags: `--workload`'s generated sessions,
`--prefix-aware` knobs, and which policies get a row per index mode. Here so that neither command
imports the other."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Any

from bench.workloads import (
    AGENT_WORKLOADS,
    AgentParams,
    GroupedParams,
    LongMixParams,
    Session,
    agent_sessions,
    grouped_sessions,
    longmix_sessions,
    scaled,
)

# The policies that read the index, and so route differently when it is predicted (approximate).
INDEX_POLICIES = ("prefix_aware", "cache_threshold")
# The generated workloads by name: bench.workloads.TUNED and HELD_OUT say which may be tuned on.
WORKLOADS = ("agent", "grouped", "longmix", "agent-zipf", "agent-tools", "agent-think")


def prefix_aware_knob(text: str) -> tuple[str, float]:
    """`--prefix-aware KEY=VALUE`: a knob of policies.prefix_aware's config, checked when it is built."""
    key, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return key.strip(), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected KEY=NUMBER, got {text!r}") from None


def generated_sessions(args: argparse.Namespace) -> tuple[list[Session], dict[str, Any]]:
    """`--workload`'s sessions and parameters from the flags both benches share: --seed, --sessions
    (agent workloads: sessions; longmix: requests) and --duration (agent workloads: the window
    sessions start in; grouped, longmix: prompts due later are left out), --rate (grouped, longmix),
    --limit (sessions) and --speed."""
    if args.workload in AGENT_WORKLOADS:
        params: AgentParams | GroupedParams | LongMixParams = replace(
            AGENT_WORKLOADS[args.workload], seed=args.seed
        )
        if args.sessions is not None:
            params = replace(params, sessions=args.sessions)
        if args.duration is not None:
            params = replace(params, start_window_s=args.duration)
        return scaled(agent_sessions(params)[: args.limit], args.speed), asdict(params)
    if args.workload == "grouped":
        params = GroupedParams(seed=args.seed)
        if args.rate is not None:
            params = replace(params, rate=args.rate)
        sessions = grouped_sessions(params)
    else:
        params = LongMixParams(seed=args.seed)
        if args.rate is not None:
            params = replace(params, rate=args.rate)
        if args.sessions is not None:
            params = replace(params, requests=args.sessions)
        sessions = longmix_sessions(params)
    if args.duration is not None:
        sessions = [s for s in sessions if s.start_s < args.duration]
    return scaled(sessions[: args.limit], args.speed), asdict(params)
