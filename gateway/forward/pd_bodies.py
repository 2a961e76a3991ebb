"""What a paired attempt adds to the bodies it sends, per protocol (docs/design.md §4). Pure: bodies in,
bodies out.

Everything else in the client's body passes through untouched: a foreign fleet's replicas judge it. (The
fields named here are the gateway's alone: what a client sent of them never goes upstream, see
gateway.forward.internal_fields.)

- prefixgate's own (bundled workers): the decode worker's body names its prefill worker
  (protocol.disaggregation.PREFILL_FIELD) in a grant the gateway signs with the fleet's transfer secret
  (protocol.transfer_auth), for a transfer id of its own making; the decode worker pulls the prompt's KV
  from it, and acts on no grant it cannot verify.
- vLLM (its reference proxy, tests/v1/kv_connector/nixl_integration/toy_proxy_server.py): the prefill
  instance first gets the request cut to one token, unstreamed, asking it to keep the KV for a remote
  decode; its answer's `kv_transfer_params` say where that KV is, and the decode instance gets the
  client's body with them.
- SGLang (its mini load balancer, python/sglang/srt/disaggregation/mini_lb.py): both servers get the
  client's body plus where the prefill server's bootstrap server is and a room number that matches the
  two requests up, sent at once.
"""

from __future__ import annotations

import random
import uuid
from typing import Any
from urllib.parse import urlsplit

import orjson

from protocol.disaggregation import PREFILL_FIELD
from protocol.transfer_auth import grant

# What a vLLM prefill instance is asked for: keep the prompt's KV for a decode instance to pull.
VLLM_PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
# Left out of the prefill request, as vLLM's proxy does: no usage chunk for an unstreamed answer, and a
# minimum output length that its one token cannot meet.
_VLLM_PREFILL_DROPPED = frozenset({"stream_options", "min_tokens", "min_completion_tokens"})
# SGLang numbers the sequences of a request room, room + 1, ... (one per prompt of a batch, times n):
# the last must stay a signed 64-bit integer.
_ROOMS = 2**63


def bundled_fields(prefill_url: str, secret: bytes) -> dict[str, Any]:
    """What a bundled decode worker's body gains: the prefill worker to pull the prompt's KV from, and a
    fresh transfer id, signed."""
    return {PREFILL_FIELD: grant(secret, prefill_url, uuid.uuid4().hex)}


def vllm_prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as a vLLM prefill instance gets it: one token (`max_completion_tokens` too,
    when the client gave it), unstreamed, asking to keep the KV for a remote decode."""
    prefill = {key: value for key, value in body.items() if key not in _VLLM_PREFILL_DROPPED}
    prefill.update(kv_transfer_params=dict(VLLM_PREFILL_PARAMS), stream=False, max_tokens=1)
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


def vllm_transfer_params(answer: bytes) -> dict[str, Any] | None:
    """The `kv_transfer_params` of a vLLM prefill instance's answer: what its decode instance needs to
    pull the KV (None: absent or not an object; the decode instance then computes the prompt itself)."""
    try:
        parsed = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) and params else None


def sglang_fields(
    body: dict[str, Any], prefill_url: str, bootstrap_port: int, rng: random.Random
) -> dict[str, Any]:
    """What both SGLang servers' bodies gain: the prefill server's host (from its URL) and bootstrap
    port, and a random room for the pair. Scalars, as mini_lb sends them for the OpenAI routes: each
    server numbers a batch's or `n`'s sequences from the room, both alike."""
    host = urlsplit(prefill_url).hostname or ""
    return {
        "bootstrap_host": f"[{host}]" if ":" in host else host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": rng.randrange(max(_ROOMS - _sequences(body), 0) + 1),
    }


def _sequences(body: dict[str, Any]) -> int:
    """How many sequences a request makes: `n` for each of a completion batch's prompts."""
    n = body.get("n")
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    return (n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1) * batch
