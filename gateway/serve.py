"""`prefixgate serve --config gateway.yaml`: the gateway process, or (`--workers N`) N of them."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from gateway import process_group
from gateway.gateway_config import load_config
from policies import ConfigError
from protocol.serving import EVENT_LOOPS


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
    parser.add_argument(
        "--workers",
        type=_positive,
        default=1,
        help="gateway processes on the one port (SO_REUSEPORT), routing as one; 1: this process alone",
    )
    # Set by the parent of `--workers N` for each process it starts: "index:count:fd of the relay".
    parser.add_argument("--sibling", default=None, help=argparse.SUPPRESS)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def run(args: argparse.Namespace, extend: Callable[[web.Application], None] | None = None) -> int:
    """Serve until interrupted; `extend` adds to the app before it starts (the endpoint picker's
    gRPC services: gateway.epp.serve)."""
    fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    if args.sibling is not None:
        fmt = f"%(asctime)s %(levelname)s [process {args.sibling.split(':')[0]}] %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=fmt)
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"prefixgate serve: {error}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    listen = config.listen.model_copy(update=overrides)
    config = config.model_copy(update={"listen": listen})
    if args.workers > 1 and args.sibling is None:
        if extend is not None:
            print("prefixgate epp: --workers is for `serve`; run a picker per pod instead", file=sys.stderr)
            return 2
        return process_group.run(
            lambda k, fd, port: _child(args, k, fd, port), args.workers, listen.host, listen.port
        )
    # Here, not at the top: the parent of `--workers N` serves nothing and needs none of it.
    from gateway.http.app import create_app
    from gateway.sync.siblings import Siblings
    from protocol.serving import serve

    siblings, gateway_id = None, None
    if args.sibling is not None:
        index, count, fd = (int(part) for part in args.sibling.split(":"))
        siblings = Siblings(index, count, socket.socket(fileno=fd))
        base = config.gateway_id or f"{socket.gethostname()}-{os.getppid()}"
        gateway_id = f"{base}-p{index}-{secrets.token_hex(2)}"
    app = create_app(config, config_path=Path(args.config), gateway_id=gateway_id, siblings=siblings)
    if extend is not None:
        extend(app)
    serve(app, args.event_loop, host=listen.host, port=listen.port, reuse_port=siblings is not None)
    return 0


def _child(args: argparse.Namespace, index: int, fd: int, port: int) -> list[str]:
    """The command line of process `index` of `--workers N`."""
    return [
        sys.executable,
        "-m",
        "prefixgate",
        "serve",
        "--config",
        args.config,
        *(["--host", args.host] if args.host is not None else []),
        "--port",
        str(port),
        "--event-loop",
        args.event_loop,
        "--log-level",
        args.log_level,
        "--sibling",
        f"{index}:{args.workers}:{fd}",
    ]
