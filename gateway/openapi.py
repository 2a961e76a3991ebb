"""The gateway's OpenAPI document: the routes it serves, for clients and API explorers.

Request and response bodies of the OpenAI routes are OpenAI's; the document names the fields the
gateway itself reads or adds rather than restating OpenAI's whole schema.
"""

from __future__ import annotations

from typing import Any

_ERROR = {
    "description": "OpenAI-style error",
    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
}
_ROUTED_HEADERS = {
    "x-prefixgate-replica": {
        "description": "the replica that served the request",
        "schema": {"type": "string"},
    },
    "x-prefixgate-matched-blocks": {
        "description": "leading prompt blocks the index predicted that replica held",
        "schema": {"type": "integer"},
    },
    "x-prefixgate-predicted-cached-tokens": {"schema": {"type": "integer"}},
    "x-prefixgate-policy": {"schema": {"type": "string"}},
}


def _generation(summary: str, prompt_field: str) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "security": [{"bearer": []}],
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {
                        "schema": {
                            "type": "object",
                            "required": [prompt_field],
                            "properties": {
                                "model": {"type": "string"},
                                prompt_field: {},
                                "stream": {"type": "boolean"},
                                "max_tokens": {"type": "integer", "minimum": 1},
                                "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                                "user": {"type": "string", "description": "session key for session_affinity"},
                            },
                        }
                    }
                },
            },
            "responses": {
                "200": {
                    "description": "OpenAI response, or server-sent events when stream is true",
                    "headers": _ROUTED_HEADERS,
                },
                "400": _ERROR,
                "401": _ERROR,
                "404": _ERROR,
                "413": _ERROR,
                "429": _ERROR,
                "502": _ERROR,
                "503": _ERROR,
            },
        }
    }


def _admin(method: str, summary: str) -> dict[str, Any]:
    return {
        method: {"summary": summary, "security": [{"admin": []}], "responses": {"200": {"description": "ok"}}}
    }


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "prefixgate gateway", "version": "1"},
    "paths": {
        "/v1/completions": _generation(
            "Text completion, routed to the replica holding the prompt's prefix", "prompt"
        ),
        "/v1/chat/completions": _generation(
            "Chat completion, routed by the templated prompt's prefix", "messages"
        ),
        "/v1/models": {
            "get": {
                "summary": "Models served by at least one replica",
                "responses": {"200": {"description": "list"}},
            }
        },
        "/health": {
            "get": {
                "summary": "200 when some replica is routable, 503 otherwise",
                "responses": {"200": {"description": "ok"}, "503": {"description": "no replica"}},
            }
        },
        "/metrics": {
            "get": {"summary": "Prometheus metrics", "responses": {"200": {"description": "text exposition"}}}
        },
        "/admin/replicas": {
            **_admin("get", "Replicas with health, load, index size and KV sync state"),
            **_admin("post", "Add a replica: {url, id?, kind?, model?, block_size?, capacity_blocks?}"),
        },
        "/admin/replicas/{id}/drain": _admin("post", "Stop sending new requests to the replica"),
        "/admin/replicas/{id}/undrain": _admin("post", "Send it requests again"),
        "/admin/replicas/{id}": _admin("delete", "Remove the replica (requests in flight finish)"),
        "/debug/route": {
            **_admin("get", "Explain the decision for ?prompt=&model= without sending it"),
            **_admin("post", "Explain the decision for an OpenAI body without sending it"),
        },
    },
    "components": {
        "securitySchemes": {
            "bearer": {"type": "http", "scheme": "bearer"},
            "admin": {"type": "http", "scheme": "bearer", "description": "the admin token"},
        },
        "schemas": {
            "Error": {
                "type": "object",
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "param": {"type": ["string", "null"]},
                            "code": {"type": ["string", "null"]},
                        },
                    }
                },
            }
        },
    },
}
