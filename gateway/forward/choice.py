"""Which replica serves a request, whichever front end received it (the HTTP proxy, or Envoy through the
endpoint picker, gateway.epp): the model it is for, its session key, the policy's choice by prefix or by
load, and what the first choice is then expected to hold (gateway.fleet.expectations)."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Mapping, Sequence

from gateway.fleet.expectations import NOTHING, Expectation, expect, record
from gateway.fleet.replicas import Replica
from gateway.forward.pd_legs import PAIRED_ROUTES
from gateway.forward.request_view import PREFIX_ROUTES, RequestView, Route
from gateway.forward.router import Decision, decide
from gateway.gateway_state import GatewayState
from protocol.errors import ApiError

# A Responses API object by id (GET, DELETE, /cancel, /input_items): served where it was produced.
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]+)")


def model_of(state: GatewayState, name: str | None, required: bool) -> str | None:
    """The model a request is for: the one it names, else the default one (the configured default, or
    the only one). Naming a model no replica serves is a 404. A route that needs a model (`required`)
    and names none when several are served is a 400; any other is then served by any replica."""
    models = state.replicas.models()
    if name is None:
        if state.config.model is not None and state.config.model in models:
            return state.config.model
        if len(models) == 1:
            return models[0]
        if not required:
            return None
        raise ApiError(
            400, f"model is required: this gateway serves {models}", param="model", code="model_required"
        )
    if name not in models:
        raise ApiError(
            404,
            f"the model {name!r} does not exist; this gateway serves {models}",
            param="model",
            code="model_not_found",
        )
    return name


def session_key(state: GatewayState, headers: Mapping[str, str], view: RequestView) -> str | None:
    """The session header, else the `user` field. A header is bytes, whatever it holds: one that is not
    UTF-8 (aiohttp's surrogate escapes) is a key as good as any, its bytes written as escapes."""
    header = headers.get(state.config.routing.session_affinity.header)
    if header:
        return header.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return view.user


async def choose(
    state: GatewayState,
    path: str,
    headers: Mapping[str, str],
    route: Route,
    view: RequestView,
    replicas: list[Replica],
    tokens: Sequence[int] | None,
) -> Decision:
    """The policy's choice by prefix, or by load; a stored response's own replica first and alone, when
    it can take the request (no other replica holds that response)."""
    if route in PREFIX_ROUTES:
        session = session_key(state, headers, view)
        paired = route in PAIRED_ROUTES
        decision = decide(
            state.policy, state.index, replicas, tokens, session, state.pd, paired, state.chains
        )
    else:
        decision = decide(state.by_load, state.index, [r for r in replicas if r.role != "prefill"], None)
    found = _RESPONSE_PATH.match(path)
    response_id = view.previous_response_id or (found.group(1) if found else None)
    if response_id is not None:
        owner = state.replicas.get(await state.response_owners.owner(response_id) or "")
        if owner is not None and owner.routable and owner in replicas:
            return dataclasses.replace(decision, order=[owner.id])
    return decision


def expect_first(state: GatewayState, route: Route, decision: Decision) -> Expectation:
    """What the first choice is expected to hold of the prompt, to record as the request leaves for it
    (record_first), and the decision's time counted."""
    if route not in PREFIX_ROUTES:
        return NOTHING
    state.metrics.child(state.metrics.decision, decision.policy).observe(decision.seconds)
    chosen = state.replicas.get(decision.order[0]) if decision.order else None
    hashes = decision.hashes.get(chosen.block_size) if chosen is not None else None
    if chosen is None or not hashes:
        return NOTHING
    return expect(state.index, chosen, hashes, precise=chosen.precise)


def record_first(state: GatewayState, expectation: Expectation) -> None:
    """Record what the first choice is expected to hold, once (gateway.fleet.expectations)."""
    record(state.index, state.predictions, expectation, now=time.time())
