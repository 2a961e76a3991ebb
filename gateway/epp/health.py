"""The picker's gRPC health (grpc.health.v1), as Kubernetes' gRPC probes and Envoy's health checks ask
it: liveness is the process answering; readiness is the picker able to pick now (the gateway started,
which it does once the tokenizers of the models it knows are loaded, and a replica that Envoy can be
sent to is healthy)."""

from __future__ import annotations

from collections.abc import Callable

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.epp.endpoints import endpoint_of
from gateway.gateway_state import GatewayState

# The service names a probe may ask about: "" and "liveness" for the process, the picker's own
# service and "readiness" for its readiness.
LIVENESS = frozenset({"", "liveness"})
PICKER_SERVICE = external_processor_pb2.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
READINESS = frozenset({"readiness", PICKER_SERVICE})

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def ready(state: GatewayState) -> bool:
    return any(r.routable and r.role == "mixed" and endpoint_of(r.url) for r in state.replicas.all())


class Health(health_pb2_grpc.HealthServicer):
    def __init__(self, state: Callable[[], GatewayState]) -> None:
        self._state = state

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service in LIVENESS:
            return health_pb2.HealthCheckResponse(status=_SERVING)
        if request.service in READINESS:
            status = _SERVING if ready(self._state()) else _NOT_SERVING
            return health_pb2.HealthCheckResponse(status=status)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        raise AssertionError("abort raises")
