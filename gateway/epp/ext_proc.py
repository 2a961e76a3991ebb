"""Envoy's external-processing stream (`envoy.service.ext_proc.v3.ExternalProcessor/Process`), one per
request, as the endpoint picker answers it.

Envoy is configured to stream both bodies to the picker in full duplex (deploy/envoy/envoy.yaml):
the request's body arrives in chunks after its headers, and nothing reaches the replica until the
picker has answered. Once the body is whole the picker answers the headers phase (the route cache
cleared, the chosen endpoints in `x-gateway-destination-endpoint` and in the `envoy.lb` dynamic
metadata, where Envoy's override-host balancer reads them, first choice first) and then sends the body
back in chunks under 64 KiB: in this mode a body the picker does not send back reaches the replica
empty. A request that cannot be served gets an immediate response instead (a 4xx for the client's
mistake, 429 to shed load, 503 when no replica is ready), with OpenAI's error JSON.

On the way back the answer's head names the replica that served (the `upstream.address` attribute)
and each body chunk is sent back as it arrives, so that a stream reaches the client event by event;
gateway.epp.exchange learns from them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import orjson
from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption, Metadata
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf.struct_pb2 import Struct

from gateway.epp.endpoints import DESTINATION, LB_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE, destination
from gateway.epp.exchange import Exchange
from gateway.gateway_state import GatewayState
from protocol.errors import ApiError

log = logging.getLogger("prefixgate.epp")

# The most body bytes in one message back to Envoy (its limit on a streamed chunk is 64 KiB).
CHUNK_BYTES = 60 * 1024
# Where Envoy puts the attributes it was asked to send (response_attributes in its filter config).
_ATTRIBUTES = "envoy.filters.http.ext_proc"
_UPSTREAM_ADDRESS = "upstream.address"


class Picker(pb_grpc.ExternalProcessorServicer):
    """The ext_proc service over the gateway's state (read anew per stream: a reload may replace it)."""

    def __init__(self, state: Callable[[], GatewayState]) -> None:
        self._state = state

    async def Process(
        self, requests: AsyncIterator[pb.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = _Stream(self._state())
        try:
            async for message in requests:
                for reply in await stream.handle(message):
                    yield reply
                if stream.refused:
                    return
        finally:
            stream.exchange.close()


class _Stream:
    """One request's messages from Envoy, phase by phase."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.exchange = Exchange(state)
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.body = bytearray()
        self.arrival = time.monotonic()
        self.decided = False
        self.refused = False

    async def handle(self, message: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        phase = message.WhichOneof("request")
        if phase == "request_headers":
            self.headers = header_dict(message.request_headers.headers)
            self.subset = subset_hint(message.metadata_context)
            self.arrival = time.monotonic()
            if message.request_headers.end_of_stream:
                return await self._decide(body_phase=False, last=True)
            return []
        if phase == "request_body":
            self.body += message.request_body.body
            limit = self.state.config.limits.max_body_bytes
            if len(self.body) > limit:
                self.refused = True
                return [immediate(ApiError(413, f"the body exceeds {limit} bytes", code="body_too_large"))]
            if not message.request_body.end_of_stream:
                return []
            return await self._decide(body_phase=True, last=True)
        if phase == "request_trailers":
            # A body ended by trailers rather than by its last chunk.
            replies = await self._decide(body_phase=True, last=False)
            return [*replies, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if phase == "response_headers":
            head = header_dict(message.response_headers.headers)
            await self._learn(self.exchange.answered(head, upstream_address(message)))
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
        if phase == "response_body":
            chunk = message.response_body
            await self._learn(self.exchange.chunk(chunk.body, chunk.end_of_stream))
            return [_body_reply("response_body", chunk.body, chunk.end_of_stream)]
        if phase == "response_trailers":
            await self._learn(self.exchange.ended())
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    @staticmethod
    async def _learn(step: Awaitable[None]) -> None:
        """A lesson from the answer; one that fails is logged, and the answer goes on to the client."""
        try:
            await step
        except Exception:
            log.exception("learning from an answer failed; the answer is relayed all the same")

    async def _decide(self, *, body_phase: bool, last: bool) -> list[pb.ProcessingResponse]:
        """The headers phase's answer (or an immediate response), then the body sent back."""
        if self.decided:
            return []
        self.decided = True
        raw = bytes(self.body)
        try:
            endpoints = await self.exchange.pick(self.headers, raw, self.subset, self.arrival)
        except ApiError as error:
            self.refused = True
            return [immediate(error)]
        except Exception:
            log.exception("the picker failed to choose for %s", self.headers.get(":path"))
            self.refused = True
            return [immediate(ApiError(500, "internal error in the gateway", code="internal_error"))]
        value = destination(endpoints)
        header = HeaderValueOption(header=HeaderValue(key=DESTINATION, raw_value=value.encode()))
        metadata = Struct()
        metadata.update({LB_NAMESPACE: {DESTINATION: value}})
        mutation = pb.HeaderMutation(set_headers=[header])
        common = pb.CommonResponse(header_mutation=mutation, clear_route_cache=True)
        headers = pb.HeadersResponse(response=common)
        replies = [pb.ProcessingResponse(request_headers=headers, dynamic_metadata=metadata)]
        if body_phase:
            replies += body_replies("request_body", raw, last)
        return replies


def body_replies(phase: str, raw: bytes, last: bool) -> list[pb.ProcessingResponse]:
    """`raw` sent back to Envoy in chunks of at most CHUNK_BYTES (one empty chunk for an empty body)."""
    starts = range(0, len(raw), CHUNK_BYTES) if raw else range(1)
    return [
        _body_reply(phase, raw[start : start + CHUNK_BYTES], last and start + CHUNK_BYTES >= len(raw))
        for start in starts
    ]


def _body_reply(phase: str, data: bytes, end: bool) -> pb.ProcessingResponse:
    streamed = pb.StreamedBodyResponse(body=data, end_of_stream=end)
    mutation = pb.BodyMutation(streamed_response=streamed)
    reply = pb.BodyResponse(response=pb.CommonResponse(body_mutation=mutation))
    return pb.ProcessingResponse(**{phase: reply})


def immediate(error: ApiError) -> pb.ProcessingResponse:
    """The client's answer from the picker itself: OpenAI's error JSON with the error's status."""
    headers = {"content-type": "application/json", **{k.lower(): v for k, v in error.headers.items()}}
    options = [HeaderValueOption(header=HeaderValue(key=k, raw_value=v.encode())) for k, v in headers.items()]
    response = pb.ImmediateResponse(
        headers=pb.HeaderMutation(set_headers=options),
        body=orjson.dumps(error.to_json()),
        details=f"prefixgate_{error.code or error.status}",
    )
    response.status.code = error.status  # type: ignore[assignment]
    return pb.ProcessingResponse(immediate_response=response)


def header_dict(headers: HeaderMap) -> dict[str, str]:
    """Envoy's header map as lower-case names to values (a repeated header's values joined by commas);
    a value that is not UTF-8 keeps its bytes as surrogate escapes, as aiohttp gives them."""
    found: dict[str, str] = {}
    for header in headers.headers:
        value = header.raw_value.decode("utf-8", "surrogateescape") if header.raw_value else header.value
        key = header.key.lower()
        found[key] = f"{found[key]},{value}" if key in found else value
    return found


def subset_hint(metadata: Metadata) -> frozenset[str] | None:
    """The endpoints Envoy allows for this request (None: no hint, any replica)."""
    if SUBSET_NAMESPACE not in metadata.filter_metadata:
        return None
    fields: Any = metadata.filter_metadata[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        return frozenset(v.string_value for v in value.list_value.values if v.string_value)
    return frozenset(e.strip() for e in value.string_value.split(",") if e.strip())


def upstream_address(message: pb.ProcessingRequest) -> str | None:
    """The replica that answered, as Envoy reports it with the response's head."""
    for attributes in (message.attributes, message.response_headers.attributes):
        if _ATTRIBUTES in attributes and _UPSTREAM_ADDRESS in attributes[_ATTRIBUTES].fields:
            return attributes[_ATTRIBUTES].fields[_UPSTREAM_ADDRESS].string_value or None
    return None
