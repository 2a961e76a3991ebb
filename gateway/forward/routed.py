"""A request once routed: what the forward path (gateway.forward.proxy) and the prefill side of a paired
attempt (gateway.forward.pd_legs) both carry, in a module of its own so that neither imports the other
for it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from gateway.forward.request_view import Route
from gateway.forward.router import Decision
from radix.capacity import Predicted


@dataclass(slots=True)
class Routed:
    route: Route
    model: str
    method: str
    # Path and query string, as the client sent them.
    target: str
    # The client's body as received: forwarded unchanged unless token ids are attached.
    raw: bytes
    # The body as JSON (None when it is not a JSON object: a file upload, an empty GET).
    body: dict[str, Any] | None
    # The client's end-to-end headers (gateway.http.reading.forwarded_headers), Authorization not among them;
    # a multidict, as a header may come more than once (Cookie).
    headers: CIMultiDict[str]
    # The prompt's whole token ids when routing has them (tokenizers.Prompt.token_ids): what a bundled
    # worker's stream is continued from elsewhere.
    tokens: Sequence[int] | None
    # Whether the gateway tokenized the prompt itself (the ids are then worth attaching).
    tokenized: bool
    decision: Decision
    arrival: float
    # The client's Authorization header, forwarded only when configured.
    authorization: str | None
    # What the first choice was predicted to hold of the prompt, before this request was recorded there:
    # what its reported reuse is checked against (Predictions.learn), and the replica's index tick at
    # that record. None: not predicted.
    predicted: Predicted | None = None
    recorded_tick: int | None = None
    # Called as the request leaves for its first choice: records what that replica is expected to hold
    # (gateway.forward.choice.record_first), before any other request is routed.
    leaving: Callable[[], None] | None = None
