"""/openapi.json's generation requests are the workers' checks, stated: bodies drawn from the document
as valid are accepted by protocol.openai_api, and bodies drawn as invalid are refused, with no server
between (tests/gateway/test_fuzz.py drives the same document against a live gateway)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from gateway.http.openapi import OPENAPI
from protocol.errors import ApiError
from protocol.openai_api import GenerationRequest, ServedModel, parse_chat, parse_completion

PARSERS: dict[str, Callable[[Any, ServedModel], GenerationRequest]] = {
    "/v1/completions": parse_completion,
    "/v1/chat/completions": parse_chat,
}
SETTINGS = {
    "max_examples": 60,
    "deadline": None,
    "database": None,
    "derandomize": True,
    "suppress_health_check": list(HealthCheck),
}


def integral(value: Any) -> Any:
    """JSON Schema counts 1.0 as an integer; the workers, as OpenAI's API, want 1. A client writes 1."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, list):
        return [integral(v) for v in value]
    if isinstance(value, dict):
        return {k: integral(v) for k, v in value.items()}
    return value


def roomy(body: Any) -> ServedModel:
    """A model that fits whatever the document allows: the checks that depend on the model (its name,
    context window and vocabulary) are not the document's to state."""
    name = body.get("model") if isinstance(body, dict) else None
    return ServedModel(name if isinstance(name, str) else "m", 2**32, 10**100, 10**100)


def strategy(path: str, mode: GenerationMode) -> Any:
    return schemathesis.openapi.from_dict(OPENAPI)[path]["POST"].as_strategy(generation_mode=mode)


@pytest.mark.parametrize("path", sorted(PARSERS))
def test_every_body_the_document_calls_valid_is_accepted(path: str) -> None:
    parse = PARSERS[path]

    @settings(**SETTINGS)
    @given(case=strategy(path, GenerationMode.POSITIVE))
    def run(case: schemathesis.Case) -> None:
        body = integral(case.body)
        parse(body, roomy(body))

    run()


@pytest.mark.parametrize("path", sorted(PARSERS))
def test_every_body_the_document_calls_invalid_is_refused(path: str) -> None:
    parse = PARSERS[path]

    @settings(**SETTINGS)
    @given(case=strategy(path, GenerationMode.NEGATIVE))
    def run(case: schemathesis.Case) -> None:
        with pytest.raises(ApiError) as refused:
            parse(case.body, roomy(case.body))
        assert refused.value.status == 400

    run()
