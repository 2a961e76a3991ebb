"""`prefixgate serve --config gateway.yaml`: the gateway process."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from gateway.gateway_config import load_config
from gateway.http.app import create_app
from policies import ConfigError
from protocol.serving import EVENT_LOOPS, serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="gateway YAML (see configs/gateway.example.yaml)")
    parser.add_argument("--host", default=None, help="override listen.host")
    parser.add_argument("--port", type=int, default=None, help="override listen.port")
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="auto: uvloop when installed (the fast extra)",
    )
    parser.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace, extend: Callable[[web.Application], None] | None = None) -> int:
    """Serve until interrupted; `extend` adds to the app before it starts (the endpoint picker's
    gRPC services: gateway.epp.serve)."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"prefixgate serve: {error}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    listen = config.listen.model_copy(update=overrides)
    config = config.model_copy(update={"listen": listen})
    app = create_app(config, config_path=Path(args.config))
    if extend is not None:
        extend(app)
    serve(app, args.event_loop, host=listen.host, port=listen.port)
    return 0
