"""The gateway's OpenAPI document: the routes it serves, for clients, API explorers and fuzzers.

The gateway passes request bodies through to the replica that serves them, which judges them. The
completion and chat schemas here are those of the bundled workers (protocol.openai_api): every field
they read (OpenAI's, vLLM's `top_k` and `ignore_eos`, and `prefixgate_token_ids`), with the values they
accept; a foreign backend applies its own rules (tools, response_format, n and vendor fields reach it
unchanged). Checks that depend on the model behind a route (the context window, the vocabulary a token
id must fall in) cannot be stated here: they answer 400 with OpenAI's error body, like every other
refusal. `null` means "absent" for every optional field, as in OpenAI's API. Any other /v1 route a
replica serves (files, batches, audio, ...) is proxied too; OpenAPI has no way to list a wildcard.

Authentication is optional in the document because it is optional in the configuration: `/v1/*` needs
an API key when `auth.api_keys_env` is set, `/admin/*` and `/debug/*` the admin token when
`auth.admin_token_env` is set (without one they answer only on a loopback listener, 403 elsewhere,
and only to requests whose Host is a loopback name or address with the listener's port). Admin
requests from another origin are 403 and a mutating one's body that is not JSON is 415, with a token
or without (gateway.http.auth.authorize says what a tokenless admin API trusts).
"""

from __future__ import annotations

from typing import Any

from protocol.openai_api import MAX_LOGPROBS, MAX_N, MAX_STOP_STRINGS, MAX_TEMPERATURE

# `seed` may be any signed or unsigned 64-bit integer.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


def _int(minimum: int | None = None, maximum: int | None = None, description: str = "") -> dict[str, Any]:
    schema: dict[str, Any] = {"type": ["integer", "null"]}
    if minimum is not None:
        schema["minimum"] = minimum
    if maximum is not None:
        schema["maximum"] = maximum
    if description:
        schema["description"] = description
    return schema


def _number(minimum: float, maximum: float) -> dict[str, Any]:
    return {"type": ["number", "null"], "minimum": minimum, "maximum": maximum}


_BOOL = {"type": ["boolean", "null"]}
_TOKEN_IDS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0},
    "description": "token ids, each below the model's vocabulary size",
}
_TEXT = {"type": "string", "minLength": 1}
# The routed-request headers the gateway adds to every answer a replica gave.
_ROUTED_HEADERS = {
    "x-prefixgate-replica": {
        "description": "the replica that served the request",
        "schema": {"type": "string"},
    },
    "x-prefixgate-matched-blocks": {
        "description": "leading prompt blocks the index predicted that replica held",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "x-prefixgate-predicted-cached-tokens": {"schema": {"type": "string", "pattern": "^[0-9]+$"}},
    "x-prefixgate-policy": {"schema": {"type": "string"}},
    "x-prefixgate-prefill-replica": {
        "description": "the prefill replica that computed the prompt for the replica that served it (only "
        "for a model served by prefill and decode replicas, when one was paired)",
        "schema": {"type": "string"},
    },
}
_SECURITY_V1 = [{"apiKey": []}, {}]
_SECURITY_ADMIN = [{"adminToken": []}, {}]


# -- request bodies -------------------------------------------------------------------------------

# Options the bundled workers do not implement: accepted only with the value that turns them off.
_OFF = {
    "best_of": {"enum": [1, None], "description": "not supported beyond 1"},
    "echo": {"enum": [False, None], "description": "not supported"},
    "suffix": {"enum": ["", None], "description": "not supported"},
    "presence_penalty": {"enum": [0, None], "description": "not supported"},
    "frequency_penalty": {"enum": [0, None], "description": "not supported"},
    "logit_bias": {"type": ["object", "null"], "maxProperties": 0, "description": "not supported"},
    "tools": {"type": ["array", "null"], "maxItems": 0, "description": "not supported"},
    "functions": {"type": ["array", "null"], "maxItems": 0, "description": "not supported"},
    "response_format": {
        "anyOf": [
            {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
            {"type": "null"},
        ],
        "description": "only {'type': 'text'}",
    },
}

_COMMON: dict[str, Any] = {
    "model": {
        "type": ["string", "null"],
        "description": "a model some replica serves (GET /v1/models); optional when the gateway serves one",
    },
    "max_tokens": _int(1, description="at most the context window minus the prompt"),
    "temperature": _number(0, MAX_TEMPERATURE),
    "top_p": _number(0, 1),
    "top_k": _int(-1, description="vLLM's extension: -1 or 0 for none"),
    "seed": _int(_SEED_MIN, _SEED_MAX),
    "stop": {
        "anyOf": [
            _TEXT,
            {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": _TEXT},
            {"type": "null"},
        ]
    },
    "stream": _BOOL,
    "stream_options": {
        "type": ["object", "null"],
        "properties": {"include_usage": _BOOL},
        "description": "only with stream: true",
    },
    "n": _int(1, MAX_N, description="choices, forked from one prefill of the prompt"),
    "user": {"type": ["string", "null"], "description": "the session key of session_affinity routing"},
    "ignore_eos": _BOOL,
    "prefixgate_token_ids": {
        **_TOKEN_IDS,
        "description": "the prompt as token ids, already templated: used instead of prompt or messages",
    },
    **_OFF,
}
# stream_options without stream: true is refused; stated so that generators can respect it.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}

COMPLETION_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_COMMON,
        "prompt": {
            "description": "text, token ids, or a list of exactly one of those (batches are refused)",
            "anyOf": [
                _TEXT,
                _TOKEN_IDS,
                {"type": "array", "minItems": 1, "maxItems": 1, "items": _TEXT},
                {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS},
                {"type": "null"},
            ],
        },
        "logprobs": _int(0, MAX_LOGPROBS, description="top alternatives reported per token"),
    },
    # A prompt, or the token ids instead of one.
    "anyOf": [
        {"required": ["prompt"], "properties": {"prompt": {"not": {"type": "null"}}}},
        {"required": ["prefixgate_token_ids"]},
    ],
    **_STREAM_OPTIONS_NEED_STREAM,
}

_TEXT_PART = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_FUNCTION_CALLED = {
    "type": "object",
    "required": ["name", "arguments"],
    "properties": {"name": {"type": "string"}, "arguments": {"type": "string"}},
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": _FUNCTION_CALLED,
    },
}
CHAT_MESSAGE: dict[str, Any] = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool", "function"]},
        "content": {"anyOf": [_CONTENT, {"type": "null"}]},
        "name": {"type": "string"},
        "tool_call_id": {"type": "string"},
        "tool_calls": {"type": "array", "minItems": 1, "items": _TOOL_CALL},
        "function_call": _FUNCTION_CALLED,
    },
    # Content may be null (or absent) only in an assistant turn that calls tools.
    "anyOf": [
        {"required": ["content"], "properties": {"content": _CONTENT}},
        {
            "properties": {"role": {"const": "assistant"}},
            "anyOf": [{"required": ["tool_calls"]}, {"required": ["function_call"]}],
        },
    ],
}
CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
        "max_completion_tokens": _int(1, description="wins over max_tokens"),
        "logprobs": _BOOL,
        "top_logprobs": _int(0, MAX_LOGPROBS, description="needs logprobs: true"),
    },
    "allOf": [
        _STREAM_OPTIONS_NEED_STREAM,
        {
            "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
            "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
        },
    ],
}

# What /debug/route reads: a prompt in any of the forms the routed APIs carry it (as leniently as the
# routing of those APIs reads it: one it cannot read is a 400 here, "nothing to route").
DEBUG_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {"model": {"type": ["string", "null"]}},
    "anyOf": [{"required": ["messages"]}, {"required": ["prompt"]}, {"required": ["input"]}],
}

REPLICA_ENTRY: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["url"],
    "properties": {
        "url": {"type": "string", "pattern": "^https?://[^/?#]", "description": "the replica's base URL"},
        "id": {"type": ["string", "null"], "description": "default: the worker's own id, or host:port"},
        "kind": {"enum": ["auto", "bundled", "openai"], "description": "auto: ask its /health"},
        "model": {"type": ["string", "null"], "description": "a foreign backend's model"},
        "block_size": {"type": "integer", "minimum": 1, "description": "a foreign backend's KV block"},
        "capacity_blocks": {
            "type": ["integer", "null"],
            "minimum": 1,
            "description": "a foreign backend's KV pool: a prior the gateway corrects (null: learned)",
        },
    },
}

# -- response bodies ------------------------------------------------------------------------------

_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": ["object", "null"],
            "properties": {"cached_tokens": {"type": "integer", "description": "served from the KV cache"}},
        },
    },
}
_FINISH = {"type": ["string", "null"]}


def _completion_like(kind: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": kind},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": choice},
            "usage": _USAGE,
        },
    }


COMPLETION = _completion_like(
    "text_completion",
    {
        "type": "object",
        "required": ["index", "text", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "text": {"type": "string"},
            "logprobs": {"type": ["object", "null"]},
            "finish_reason": _FINISH,
        },
    },
)
CHAT_COMPLETION = _completion_like(
    "chat.completion",
    {
        "type": "object",
        "required": ["index", "message", "finish_reason"],
        "properties": {
            "index": {"type": "integer"},
            "message": {
                "type": "object",
                "required": ["role", "content"],
                "properties": {"role": {"const": "assistant"}, "content": {"type": ["string", "null"]}},
            },
            "logprobs": {"type": ["object", "null"]},
            "finish_reason": _FINISH,
        },
    },
)
ERROR: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
REPLICA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "url", "kind", "model", "healthy", "draining", "inflight", "load"],
    "properties": {
        "id": {"type": "string"},
        "url": {"type": "string"},
        "kind": {"enum": ["bundled", "openai"]},
        "model": {"type": "string"},
        "block_size": {"type": "integer"},
        "capacity_blocks": {"type": "integer"},
        "max_context_len": {"type": "integer"},
        "source": {"type": "string"},
        "incarnation": {"type": ["string", "null"]},
        "healthy": {"type": "boolean"},
        "draining": {"type": "boolean"},
        "inflight": {"type": "integer"},
        "load": {
            "type": "object",
            "properties": {
                "running": {"type": "integer"},
                "waiting": {"type": "integer"},
                "queued_prefill_tokens": {"type": "integer"},
            },
        },
        "prefill_rate": {"type": "number"},
        "index_blocks": {"type": "integer", "description": "blocks the gateway's index holds for it"},
        "kv_sync": {"type": "object", "description": "the state of its KV event follower"},
    },
}
HEALTH: dict[str, Any] = {
    "type": "object",
    "required": ["status", "replicas", "models", "policy"],
    "properties": {
        "status": {"enum": ["ok", "degraded", "unavailable"]},
        "gateway_id": {"type": "string"},
        "replicas": {
            "type": "object",
            "properties": {
                "routable": {"type": "integer"},
                "total": {"type": "integer"},
                "pending": {"type": "integer"},
            },
        },
        "models": {"type": "array", "items": {"type": "string"}},
        "policy": {"type": "string"},
        "redis": {"type": "object"},
        "degraded": {"type": "boolean"},
    },
}
ROUTE_EXPLANATION: dict[str, Any] = {
    "type": "object",
    "required": ["model", "policy", "prompt_tokens", "tokenized", "order", "replicas"],
    "properties": {
        "model": {"type": "string"},
        "policy": {"type": "string"},
        "prompt_tokens": {"type": "integer"},
        "tokenized": {"type": "boolean"},
        "order": {"type": "array", "items": {"type": "string"}},
        "decision_us": {"type": "number"},
        "replicas": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["replica", "healthy", "matched_blocks", "cached_tokens", "est_ttft_s", "rank"],
                "properties": {
                    "replica": {"type": "string"},
                    "healthy": {"type": "boolean"},
                    "matched_blocks": {"type": "integer"},
                    "cached_tokens": {"type": "integer"},
                    "running": {"type": "integer"},
                    "waiting": {"type": "integer"},
                    "queued_prefill_tokens": {"type": "integer"},
                    "prefill_rate": {"type": "number"},
                    "est_ttft_s": {"type": "number"},
                    "rank": {"type": ["integer", "null"]},
                },
            },
        },
    },
}

# -- operations -----------------------------------------------------------------------------------

# Every route may refuse a body over limits.max_body_bytes (413) and answers errors in OpenAI's shape.
_V1_ERRORS = {"401": _error("no valid API key (when keys are configured)")}
_ADMIN_ERRORS = {
    "401": _error("no valid admin token (when one is configured)"),
    "403": _error(
        "admin routes are off (no admin token configured and a non-loopback listener), a request from "
        "another origin, or, without a token, a Host that is not this loopback listener"
    ),
    "415": _error("a body that is not application/json (on POST and DELETE)"),
}


# One server-sent event of a stream (OpenAPI 3.1 documents a stream by its events): a JSON chunk, an
# error object if the replica failed mid-stream, and `[DONE]` last.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"anyOf": [{"const": "[DONE]"}, {"type": "string", "pattern": "^\\{"}]}},
}


def _generation(summary: str, request: str, response: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": _SECURITY_V1,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": "the replica's answer: JSON, or server-sent events when stream is true",
                    "headers": _ROUTED_HEADERS,
                    "content": {
                        "application/json": {"schema": _ref(response)},
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                "400": _error("the body is not valid JSON, a field is invalid, or the prompt does not fit"),
                **_V1_ERRORS,
                "404": _error("no replica serves that model"),
                "413": _error("the body is larger than limits.max_body_bytes"),
                "429": _error("the gateway, or every replica tried, is full: retry after Retry-After"),
                "502": _error("every replica tried failed"),
                "503": _error("no healthy replica serves the model, or those tried are unavailable"),
                "504": _error("no replica tried answered within limits.request_timeout_s"),
            },
        }
    }


_ANY_JSON = {"type": "object", "description": "passed to the replica as sent"}


def _passthrough(summary: str) -> dict[str, Any]:
    """A route the gateway proxies by load (or, for a stored response, to its replica): the replica
    judges the body and answers; a route it does not serve is its 404."""
    return {
        "post": {
            "summary": summary,
            "security": _SECURITY_V1,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ANY_JSON}}},
            "responses": {
                "200": {
                    "description": "the replica's answer, as it sent it",
                    "headers": _ROUTED_HEADERS,
                    "content": {
                        "application/json": {"schema": {}},
                        "text/event-stream": {"schema": _SSE_EVENT},
                    },
                },
                "400": _error("the body is not a JSON object, or the replica refused it"),
                **_V1_ERRORS,
                "404": _error("no replica serves that model, or the replica does not serve this route"),
                "405": _error("the replica does not serve this route with this method"),
                "413": _error("the body is larger than limits.max_body_bytes"),
                "422": _error("the replica refused the body"),
                "429": _error("the gateway, or every replica tried, is full: retry after Retry-After"),
                "502": _error("every replica tried failed"),
                "503": _error("no healthy replica serves the model, or those tried are unavailable"),
                "504": _error("no replica tried answered within limits.request_timeout_s"),
            },
        }
    }


_REMOVED = {
    "type": "object",
    "required": ["status", "id", "inflight"],
    "properties": {
        "status": {"const": "removed"},
        "id": {"type": "string"},
        "inflight": {"type": "integer", "description": "requests still finishing on it"},
    },
}


def _replica_action(summary: str, method: str = "post") -> dict[str, Any]:
    response = REPLICA if method == "post" else _REMOVED
    return {
        method: {
            "summary": summary,
            "security": _SECURITY_ADMIN,
            "parameters": [{"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {
                "200": _json(response, "the replica"),
                **_ADMIN_ERRORS,
                "404": _error("no replica with that id"),
            },
        }
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "prefixgate gateway", "version": "1"},
    "paths": {
        "/v1/completions": _generation(
            "Text completion, routed to the replica holding the prompt's prefix",
            "CompletionRequest",
            "Completion",
        ),
        "/v1/chat/completions": _generation(
            "Chat completion, routed by the templated prompt's prefix", "ChatRequest", "ChatCompletion"
        ),
        "/v1/responses": _passthrough(
            "Responses API: routed by instructions + input; with previous_response_id, to the replica "
            "holding that response"
        ),
        "/v1/embeddings": _passthrough("Embeddings, routed by load"),
        "/v1/score": _passthrough("Scoring (vLLM), routed by load"),
        "/tokenize": _passthrough("Tokenize (vLLM), routed by load"),
        "/detokenize": _passthrough("Detokenize (vLLM), routed by load"),
        "/v1/models": {
            "get": {
                "summary": "Models served by at least one replica",
                "security": _SECURITY_V1,
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["object", "data"],
                            "properties": {
                                "object": {"const": "list"},
                                "data": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["id", "object"],
                                        "properties": {
                                            "id": {"type": "string"},
                                            "object": {"const": "model"},
                                            "created": {"type": "integer"},
                                            "owned_by": {"type": "string"},
                                            "max_model_len": {"type": "integer"},
                                            "replicas": {"type": "integer", "description": "routable ones"},
                                        },
                                    },
                                },
                            },
                        },
                        "the models",
                    ),
                    **_V1_ERRORS,
                },
            }
        },
        "/live": {
            "get": {
                "summary": "Liveness: 200 while the process serves (the probe for restarts)",
                "responses": {"200": _json({"type": "object"}, "the gateway is alive")},
            }
        },
        "/health": {
            "get": {
                "summary": "Readiness: 200 when a request could be served now (the probe for traffic)",
                "responses": {
                    "200": _json(_ref("Health"), "some replica is routable"),
                    "503": _json(_ref("Health"), "no replica is routable"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "This document",
                "responses": {"200": _json({"type": "object"}, "the OpenAPI document")},
            }
        },
        "/admin/replicas": {
            "get": {
                "summary": "Replicas with health, load, index size and KV sync state",
                "security": _SECURITY_ADMIN,
                "responses": {
                    "200": _json(
                        {
                            "type": "object",
                            "required": ["replicas", "pending"],
                            "properties": {
                                "replicas": {"type": "array", "items": _ref("Replica")},
                                "pending": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "properties": {
                                            "url": {"type": "string"},
                                            "source": {"type": "string"},
                                        },
                                    },
                                },
                            },
                        },
                        "the replicas, and the URLs still being probed",
                    ),
                    **_ADMIN_ERRORS,
                },
            },
            "post": {
                "summary": "Add a replica: probed now, and every health interval until it answers",
                "security": _SECURITY_ADMIN,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("ReplicaEntry")}},
                },
                "responses": {
                    "201": _json(
                        {
                            "type": "object",
                            "required": ["status", "replica"],
                            "properties": {"status": {"const": "active"}, "replica": _ref("Replica")},
                        },
                        "it answered and routes now",
                    ),
                    "202": _json(
                        {
                            "type": "object",
                            "required": ["status", "url"],
                            "properties": {"status": {"const": "pending"}, "url": {"type": "string"}},
                        },
                        "it does not answer yet: probed again every health interval",
                    ),
                    "400": _error("not a valid replica entry"),
                    **_ADMIN_ERRORS,
                    "413": _error("the body is larger than limits.max_body_bytes"),
                },
            },
        },
        "/admin/replicas/{id}/drain": _replica_action("Stop sending new requests to the replica"),
        "/admin/replicas/{id}/undrain": _replica_action("Send it requests again"),
        "/admin/replicas/{id}": _replica_action("Remove the replica (requests in flight finish)", "delete"),
        "/debug/route": {
            "get": {
                "summary": "Explain the decision for a text prompt without sending it",
                "security": _SECURITY_ADMIN,
                "parameters": [
                    {"name": "prompt", "in": "query", "required": True, "schema": _TEXT},
                    {"name": "model", "in": "query", "required": False, "schema": {"type": "string"}},
                    {"name": "user", "in": "query", "required": False, "schema": {"type": "string"}},
                ],
                "responses": {
                    "200": _json(_ref("RouteExplanation"), "the decision, per replica"),
                    "400": _error("an invalid prompt"),
                    **_ADMIN_ERRORS,
                    "404": _error("no replica serves that model"),
                },
            },
            "post": {
                "summary": "Explain the decision for an OpenAI body (messages: a chat; input: a Responses "
                "request) without sending it",
                "security": _SECURITY_ADMIN,
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": _ref("RouteRequest")}},
                },
                "responses": {
                    "200": _json(_ref("RouteExplanation"), "the decision, per replica"),
                    "400": _error("the body is not valid JSON, or holds no prompt to route"),
                    **_ADMIN_ERRORS,
                    "404": _error("no replica serves that model"),
                    "413": _error("the body is larger than limits.max_body_bytes"),
                },
            },
        },
    },
    "components": {
        "securitySchemes": {
            "apiKey": {"type": "http", "scheme": "bearer", "description": "one of auth.api_keys_env's keys"},
            "adminToken": {"type": "http", "scheme": "bearer", "description": "auth.admin_token_env's token"},
        },
        "schemas": {
            "CompletionRequest": COMPLETION_REQUEST,
            "ChatRequest": CHAT_REQUEST,
            "ChatMessage": CHAT_MESSAGE,
            "RouteRequest": DEBUG_REQUEST,
            "ReplicaEntry": REPLICA_ENTRY,
            "Completion": COMPLETION,
            "ChatCompletion": CHAT_COMPLETION,
            "Replica": REPLICA,
            "Health": HEALTH,
            "RouteExplanation": ROUTE_EXPLANATION,
            "Error": ERROR,
        },
    },
}
