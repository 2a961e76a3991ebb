"""`prefixgate`: the one command line for the gateway, the workers and the benchmarks."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    from workers import cli as worker_cli

    worker_cli.add_arguments(commands.add_parser("worker", help="run a bundled worker (engine + HTTP API)"))

    serve = commands.add_parser("serve", help="run the gateway from its YAML config")
    serve.add_argument("--config", required=True, help="gateway YAML (see configs/gateway.example.yaml)")
    serve.add_argument("--host", default=None, help="override listen.host")
    serve.add_argument("--port", type=int, default=None, help="override listen.port")
    serve.add_argument("--log-level", default="INFO")

    from gateway import up

    up.add_arguments(commands.add_parser("up", help="the local fleet: a gateway and SmolLM2 workers"))

    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)

    from bench import engine, fleet, overhead, radix_speed, replay

    radix_speed.add_arguments(bench.add_parser("radix", help="hashing and index-match speed and memory"))
    engine.add_arguments(bench.add_parser("engine", help="the engine against HF transformers on one machine"))
    fleet.add_arguments(bench.add_parser("fleet", help="a trace over simulated replicas (real scheduler)"))
    replay.add_arguments(bench.add_parser("replay", help="open-loop load against an OpenAI endpoint"))
    overhead.add_arguments(bench.add_parser("overhead", help="the gateway's added latency and capacity"))
    return parser


def serve(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from gateway.app import create_app
    from gateway.app import serve as serve_app
    from gateway.config import load_config
    from policies import ConfigError

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"prefixgate serve: {error}", file=sys.stderr)
        return 2
    listen = config.listen.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    config = config.model_copy(update={"listen": listen})
    serve_app(create_app(config, config_path=Path(args.config)), listen.host, listen.port)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "worker":
        from workers import cli as worker_cli

        return worker_cli.run(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "up":
        from gateway import up

        return up.run(args)
    if args.command == "bench":
        from bench import engine, fleet, overhead, radix_speed, replay

        runners = {
            "radix": radix_speed.run,
            "engine": engine.run,
            "fleet": fleet.run,
            "replay": replay.run,
            "overhead": overhead.run,
        }
        runners[args.bench](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
