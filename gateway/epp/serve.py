"""`prefixgate epp --config gateway.yaml`: the gateway as Envoy's endpoint picker.

The same process as `prefixgate serve` (its HTTP listener keeps /metrics, /health, /live, the admin API
and the proxy itself), with the ext_proc service and gRPC health on their own port, opened once the
gateway has started (its tokenizers loaded), closed before it stops.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from grpc_health.v1 import health_pb2_grpc

from gateway import serve
from gateway.epp.ext_proc import Picker
from gateway.epp.health import Health
from gateway.http.keys import GATEWAY

log = logging.getLogger("prefixgate.epp")

DEFAULT_GRPC_PORT = 9002
# How long requests in flight may take to finish when the picker stops.
_GRACE_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve.add_arguments(parser)
    parser.add_argument("--grpc-host", default="0.0.0.0", help="where the ext_proc service listens")
    parser.add_argument("--grpc-port", type=int, default=DEFAULT_GRPC_PORT, help="its port")


def run(args: argparse.Namespace) -> int:
    service = grpc_service(args.grpc_host, args.grpc_port)
    return serve.run(args, extend=lambda app: app.cleanup_ctx.append(service))


def grpc_service(host: str, port: int) -> Callable[[web.Application], AsyncIterator[None]]:
    """The ext_proc and health services as a step of the app's life, after the gateway's start."""

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        gw = app[GATEWAY]
        server = grpc.aio.server()
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(Picker(lambda: gw.state), server)
        health_pb2_grpc.add_HealthServicer_to_server(Health(lambda: gw.state), server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if server.add_insecure_port(address) == 0:
            raise SystemExit(f"prefixgate epp: cannot listen on {address} for ext_proc")
        await server.start()
        log.info("endpoint picker (ext_proc) on %s", address)
        yield
        await server.stop(_GRACE_S)

    return lifecycle
