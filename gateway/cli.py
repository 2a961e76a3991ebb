"""`prefixgate`: the one command line for the gateway, the workers and the benchmarks."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from workers import cli as worker_cli

    worker_cli.add_arguments(commands.add_parser("worker", help="run a bundled worker (engine + HTTP API)"))

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    from bench import engine, fleet, radix_speed, routing

    routing.add_arguments(bench.add_parser("routing", help="replay a trace through every policy"))
    radix_speed.add_arguments(bench.add_parser("radix", help="hashing and index-match speed and memory"))
    engine.add_arguments(bench.add_parser("engine", help="the engine against HF transformers on one machine"))
    fleet.add_arguments(bench.add_parser("fleet", help="a trace over simulated replicas (real scheduler)"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        from workers import cli as worker_cli

        return worker_cli.run(args)
    if args.command == "bench":
        from bench import engine, fleet, radix_speed, routing

        runners = {"routing": routing.run, "radix": radix_speed.run, "engine": engine.run, "fleet": fleet.run}
        runners[args.bench](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
