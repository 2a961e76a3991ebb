"""The gateway's OpenAPI document: the routes it serves, for clients, API explorers and fuzzers.

The gateway passes request bodies through to the replica that serves them, which judges them. The
completion and chat schemas here are the models the bundled workers validate with
(protocol.openai_models, through gateway.http.openapi_schemas): every field they read (OpenAI's,
vLLM's `top_k` and `ignore_eos`, and `prefixgate_token_ids`), with the values they accept; a foreign
backend applies its own rules (tools, response_format, n and vendor fields reach it
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

from gateway.http.openapi_schemas import REPLICA, SCHEMAS


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _error(description: str) -> dict[str, Any]:
    return _json(_ref("Error"), description)


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
                                "gateway_id": {
                                    "type": "string",
                                    "description": "the gateway (process) that answers",
                                },
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
        "schemas": SCHEMAS,
    },
}
