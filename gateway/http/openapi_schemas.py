"""The bodies /openapi.json names (gateway.http.openapi): the generation requests as the bundled workers
validate them (protocol.openai_models, so the document states exactly what is checked), and the
answers and admin objects the gateway and its replicas send.
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from protocol.openai_models import ChatRequest, CompletionRequest

_REF_TEMPLATE = "#/components/schemas/{model}"


def request_schemas() -> dict[str, Any]:
    """CompletionRequest, ChatRequest and the objects they hold, by name."""
    _, top = models_json_schema(
        [(CompletionRequest, "validation"), (ChatRequest, "validation")], ref_template=_REF_TEMPLATE
    )
    return top["$defs"]


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
        "precise": {
            "type": "boolean",
            "description": "its index entries come from its KV events (else they are predictions)",
        },
        "healthy": {"type": "boolean"},
        "draining": {"type": "boolean"},
        "inflight": {"type": "integer", "description": "this process's requests in flight there"},
        "sibling_inflight": {
            "type": "integer",
            "description": "the other processes' (serve --workers N), counted in its load",
        },
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
        "siblings": {
            "type": "object",
            "description": "serve --workers N: this process, and its messages to and from the others",
            "properties": {
                "process": {"type": "integer"},
                "processes": {"type": "integer"},
                "sent": {"type": "integer"},
                "received": {"type": "integer"},
                "dropped": {"type": "integer"},
                "malformed": {"type": "integer"},
            },
        },
    },
}
ROUTE_EXPLANATION: dict[str, Any] = {
    "type": "object",
    "required": ["model", "policy", "prompt_tokens", "tokenized", "order", "replicas"],
    "properties": {
        "gateway_id": {"type": "string", "description": "the gateway (process) that explains it"},
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

SCHEMAS: dict[str, Any] = {
    **request_schemas(),
    "RouteRequest": DEBUG_REQUEST,
    "ReplicaEntry": REPLICA_ENTRY,
    "Completion": COMPLETION,
    "ChatCompletion": CHAT_COMPLETION,
    "Replica": REPLICA,
    "Health": HEALTH,
    "RouteExplanation": ROUTE_EXPLANATION,
    "Error": ERROR,
}
