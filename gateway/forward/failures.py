"""What a client is told when the replicas it was routed to fail (docs/design.md §2 step 6).

A refusal for overload (429, 503) is the fleet saying it is full, not broken: it reaches the client
with its Retry-After when no other choice answered. Otherwise the client gets 504 when the last
attempt timed out, else 502; a stream that fails once output flowed and cannot be continued ends with
an error event, the way OpenAI streams report errors. Every message names what was tried and why it
failed, for the operator as much as for the client.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.fleet.replicas import Replica
from gateway.forward.upstream import UpstreamError, error_kind
from gateway.gateway_config import Limits
from gateway.gateway_state import GatewayState
from protocol.errors import ApiError
from protocol.openai_responses import SSE_DONE, sse


@dataclass(slots=True)
class Failures:
    """How the failed attempts so far ended: what the client is told when every choice failed."""

    # The last failure, in words.
    last: str = ""
    # How it ended: "timeout" (no answer in time), "refused" (429/503), or another failure.
    kind: str = ""
    # The last refusal, with its Retry-After: the fleet is full, not broken.
    refusal: ApiError | None = None

    def failed(self, state: GatewayState, replica: Replica, kind: str, message: str) -> None:
        state.mark_failure(replica)
        state.metrics.upstream_errors.labels(replica.id, kind).inc()
        self.last, self.kind = message, "timeout" if kind == "timeout" else "error"

    def refused(
        self, state: GatewayState, replica: Replica, status: int, headers: Mapping[str, str], model: str
    ) -> None:
        state.metrics.upstream_errors.labels(replica.id, f"http_{status}").inc()
        self.last, self.kind = f"replica {replica.id} answered {status}", "refused"
        self.refusal = refusal(status, headers, model)

    def answer(self, model: str, limits: Limits) -> ApiError:
        """The client's answer once every choice failed."""
        if self.refusal is not None:
            # A replica that is up but full said when to come back: that, not a 5xx, is the answer for
            # a client whose other choices could not be reached either.
            return self.refusal
        if self.kind == "timeout":
            return ApiError(
                504,
                f"no replica tried for {model!r} answered in time (limits: connect_timeout_s "
                f"{limits.connect_timeout_s:g}, request_timeout_s {limits.request_timeout_s:g}); "
                f"last: {self.last}",
                code="upstream_timeout",
            )
        return ApiError(
            502, f"every replica tried for {model!r} failed; last: {self.last}", code="upstream_unavailable"
        )


def refusal(status: int, headers: Mapping[str, str], model: str) -> ApiError:
    """A replica's 429/503 as the gateway's own answer, keeping its Retry-After (1 s if it gave none)."""
    retry_after = headers.get("Retry-After", "1")
    if status == 429:
        message, code = f"every replica tried for {model!r} is at its queue limit", "queue_full"
    else:
        message, code = f"the replicas tried for {model!r} are unavailable", "unavailable"
    return ApiError(status, f"{message}; retry shortly", code=code, headers={"Retry-After": retry_after})


def unavailable(replicas: Iterable[Replica], model: str) -> str:
    """Why none of `model`'s `replicas` can take a request now, in words for the client."""
    replicas = list(replicas)
    prefill = [r.id for r in replicas if r.role == "prefill" and r.routable]
    answering = [r for r in replicas if r.role != "prefill" and r.routable]
    if prefill and not answering:
        return (
            f"no decode replica of {model!r} is available right now; its prefill replicas "
            f"({', '.join(prefill)}) compute prompts for decode replicas and answer no client"
        )
    if answering and all(r.role == "decode" and r.pd_protocol == "sglang" for r in answering):
        return f"the SGLang decode replicas of {model!r} need a prefill replica, and none is available"
    return f"no healthy replica serves {model!r} right now"


def failed_mid_stream(state: GatewayState, replica: Replica, error: TimeoutError | UpstreamError) -> None:
    kind = error_kind(error)
    if not kind.startswith("http_"):  # a refusal is an answer: the replica is up
        state.mark_failure(replica)
    state.metrics.upstream_errors.labels(replica.id, kind).inc()


def stream_error(
    replica_id: str, error: TimeoutError | UpstreamError, request_timeout_s: float
) -> tuple[bytes, int]:
    """The error event (then [DONE]) that ends a stream no replica could finish, and its status."""
    if isinstance(error, TimeoutError):  # silent for limits.request_timeout_s: stuck, or far too slow
        message, code = f"sent nothing for {request_timeout_s:g} s mid-stream", "upstream_timeout"
        status = 504
    else:
        message, code, status = f"failed mid-stream: {error!r}", "upstream_failed", 502
    return sse(ApiError(status, f"replica {replica_id} {message}", code=code).to_json()) + SSE_DONE, status
