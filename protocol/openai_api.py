"""The OpenAI request bodies a bundled worker accepts, validated at its edge (docs/design.md §4).

Pure: no I/O and no engine. Every way a body can be wrong becomes an `ApiError` with a 4xx status
and OpenAI's error shape here, so that nothing malformed ever reaches the engine thread (where a bad
token id would fail every request in the batch, not just its own). The gateway does not apply these
checks to what it forwards (it passes bodies through, docs/design.md §2); it reads the same messages with
`chat_messages` when it renders a prompt for routing, so a valid body becomes the same prompt on both
sides.

Extensions beyond OpenAI's fields, as vLLM spells them where it has them: `top_k`, `ignore_eos`, and
`prefixgate_token_ids` — the prompt's token ids as the gateway computed them (after the chat
template, for chat). When present they are used as the prompt and nothing is tokenized; the rest of
the body is still validated as usual. `prefixgate_prefill` — the gateway's grant naming the prefill
worker a decode worker pulls the prompt's KV from (prefill/decode disaggregation, signed:
protocol.transfer_auth; workers.disaggregation checks it). The gateway refuses any `prefixgate_*`
field but `prefixgate_token_ids` from a client (gateway.forward.internal_fields).
"""

from __future__ import annotations

import array
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from protocol.errors import ApiError
from protocol.errors import bad_value as _bad

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# The default of OpenAI's legacy completions endpoint; chat defaults to whatever fits instead.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# Roles as the chat template sees them: OpenAI's `developer` is the system prompt of templates that
# predate it; `function` is the legacy spelling of a tool result.
CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}
# Choices per request: each is a sequence of its own in the running batch.
MAX_N = 64
# Levels of objects and arrays a body may nest: well under the 254 that orjson encodes.
MAX_JSON_DEPTH = 128
_SEED_RANGE = (-(2**63), 2**64 - 1)
# One chat message as the template reads it (see chat_messages).
Message = dict[str, Any]

# Options this worker does not implement, with the values that mean "off" (accepted and ignored). The
# type counts too: `"echo": 0` or `"logit_bias": false` is refused as OpenAI refuses it.
_OFF_VALUES: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None or (_is_int(v) and v == 1),
    "echo": lambda v: v is None or v is False,
    "suffix": lambda v: v is None or v == "",
    "logit_bias": lambda v: v is None or v == {},
    "presence_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "frequency_penalty": lambda v: v is None or (_is_number(v) and v == 0),
    "tools": lambda v: v is None or v == [],
    "functions": lambda v: v is None or v == [],
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
}


@dataclass(frozen=True, slots=True)
class ServedModel:
    """What request validation needs to know about the model behind the worker."""

    name: str
    vocab_size: int
    max_context_len: int
    # block_size * num_blocks: the longest sequence the KV pool could ever hold.
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion or chat request, before its prompt is tokenized."""

    chat: bool
    prompt: str | None = None
    messages: tuple[Message, ...] = ()
    # Prompt ids given by the client (`prompt` as ids) or attached by the gateway.
    token_ids: tuple[int, ...] | None = None
    # None: the endpoint's default (16 for completions, all that fits for chat).
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # Top alternatives to report per token; None: no logprobs at all.
    logprobs: int | None = None
    stream: bool = False
    include_usage: bool = False
    # Choices to generate, each a sequence forked from the one prefill of the prompt.
    n: int = 1
    # The prefill worker to pull the prompt's KV from (a decode worker's request from the gateway).
    prefill_url: str | None = None


# -- parsing --------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. orjson is a strict RFC 8259 parser, and several times faster than
    the standard library's on the long id lists of token prompts: it refuses NaN and Infinity, numbers
    beyond a double, unpaired surrogates (escaped or not), text that is not UTF-8, and nesting past
    1,024 levels, all of which would otherwise travel on into tokenizers, hashing and the engine.
    Nesting is bounded tighter still (MAX_JSON_DEPTH): a parsed body may be encoded again (the gateway
    attaches fields; prompts render tools and arguments), and orjson encodes 254 levels at most."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        if str(error).startswith("depth limit exceeded"):
            raise _too_deep() from None
        raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    if raw.count(b"{") + raw.count(b"[") > MAX_JSON_DEPTH and _deeper_than(body, MAX_JSON_DEPTH):
        raise _too_deep()
    return body


def _too_deep() -> ApiError:
    return ApiError(
        400, f"the body nests deeper than {MAX_JSON_DEPTH} levels of objects and arrays", code="invalid_json"
    )


def _deeper_than(value: dict[str, Any] | list[Any], limit: int) -> bool:
    """Whether objects and arrays nest more than `limit` levels in `value` (itself level 1); iterative,
    so that no depth costs a Python stack frame."""
    stack: list[tuple[dict[str, Any] | list[Any], int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _int(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_int(value):
        raise _bad(name, f"{name} must be an integer, got {json.dumps(value)}")
    if value < lo or (hi is not None and value > hi):
        bound = f"at least {lo}" if hi is None else f"between {lo} and {hi}"
        raise _bad(name, f"{name} must be {bound}, got {value}")
    return value


def _number(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not _is_number(value):
        raise _bad(name, f"{name} must be a number, got {json.dumps(value)}")
    if not lo <= value <= hi:
        raise _bad(name, f"{name} must be between {lo:g} and {hi:g}, got {value}")
    return float(value)


def _bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _bad(name, f"{name} must be true or false, got {json.dumps(value)}")
    return value


def _token_ids(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    if isinstance(value, list) and value and are_token_ids(value, vocab_size):
        return tuple(value)
    # Finding what is wrong, for the error message, can take the slow way.
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise _bad(name, f"{name} must be a list of integer token ids")
    if not value:
        raise _bad(name, f"{name} must not be empty")
    bad = next(t for t in value if not 0 <= t < vocab_size)
    raise _bad(name, f"{name} holds token id {bad}, outside this model's vocabulary [0, {vocab_size})")


def are_token_ids(value: list[Any], vocab_size: int = 2**32) -> bool:
    """Whether `value` is a non-empty list of token ids, checked in three C-level passes, because it
    runs on every token-id prompt (a per-id Python check cost ~0.1 µs per id). array("I") takes
    exactly the ints in [0, 2**32), and bools, which JSON's true and false become: those are the only
    values whose JSON has an "e" in it. numpy finds the largest id."""
    if not value:
        return False
    try:
        packed = array.array("I", value)
    except (TypeError, OverflowError):
        return False
    return b"e" not in orjson.dumps(value) and int(np.frombuffer(packed, np.uint32).max()) < vocab_size


def _check_model(body: Mapping[str, Any], model: ServedModel) -> None:
    """A missing model means the served one (as vLLM does); a different one is not here."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise _bad("model", "model must be a string")
    if name != model.name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist on this worker; it serves {model.name!r}",
            param="model",
            code="model_not_found",
        )


def _check_unsupported(body: Mapping[str, Any]) -> None:
    for name, is_off in _OFF_VALUES.items():
        if not is_off(body.get(name)):
            raise ApiError(400, f"{name} is not supported by this worker", param=name, code="unsupported")


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", "stop must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _bad("stop", f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
    return tuple(stops)


def _stream_options(body: Mapping[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options", "stream_options is only allowed when stream is true")
    if not isinstance(options, dict):
        raise _bad("stream_options", "stream_options must be an object")
    return bool(_bool(options, "include_usage"))


def _common(body: Mapping[str, Any], model: ServedModel, max_tokens_names: Sequence[str]) -> dict[str, Any]:
    """The fields completions and chat share, as GenerationRequest keyword arguments."""
    _check_model(body, model)
    _check_unsupported(body)
    given = [_int(body, name, 1, model.max_context_len) for name in max_tokens_names]
    max_tokens = next((value for value in given if value is not None), None)
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 0.0, 1.0)
    top_k = _int(body, "top_k", -1)
    stream = bool(_bool(body, "stream"))
    if not isinstance(body.get("user", ""), str | None):  # read by the gateway's session affinity
        raise _bad("user", "user must be a string")
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        # vLLM spells "no top-k" as -1, the engine as 0.
        "top_k": max(top_k or 0, 0),
        "seed": _int(body, "seed", *_SEED_RANGE),
        "stop": _stop(body),
        "ignore_eos": bool(_bool(body, "ignore_eos")),
        "stream": stream,
        "include_usage": _stream_options(body, stream),
        "n": _int(body, "n", 1, MAX_N) or 1,
    }
    # The nucleus of mass 0 is the single most likely token: greedy, as OpenAI treats it.
    if fields["top_p"] == 0.0:
        fields["temperature"], fields["top_p"] = 0.0, 1.0
    if "prefixgate_token_ids" in body:
        fields["token_ids"] = _token_ids(
            body["prefixgate_token_ids"], "prefixgate_token_ids", model.vocab_size
        )
    if "prefixgate_prefill" in body:
        fields["prefill_url"] = _prefill_url(body["prefixgate_prefill"])
    return fields


def _prefill_url(value: Any) -> str:
    url = value.get("url") if isinstance(value, dict) else None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise _bad("prefixgate_prefill", 'must be {"url": "http://HOST:PORT"} naming a prefill worker')
    return url


def parse_completion(body: Mapping[str, Any], model: ServedModel) -> GenerationRequest:
    """`POST /v1/completions`: `prompt` is a string, a list of token ids, or a one-element list of either."""
    fields = _common(body, model, ("max_tokens",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) > 1:
            raise _bad("prompt", "batched prompts are not supported: send one prompt per request")
        prompt = prompt[0]
    if prompt is None:
        if "token_ids" not in fields:
            raise _bad("prompt", "prompt is required")
    elif isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "prompt must not be empty")
        fields["prompt"] = prompt
    elif not isinstance(prompt, list):
        raise _bad("prompt", "prompt must be a string or a list of token ids")
    else:
        ids = _token_ids(prompt, "prompt", model.vocab_size)
        fields.setdefault("token_ids", ids)
    logprobs = _int(body, "logprobs", 0, MAX_LOGPROBS)
    return GenerationRequest(chat=False, logprobs=logprobs, **fields)


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise _bad(
                    "messages", f"{where}.content may only hold text parts ({{'type': 'text', 'text': ...}})"
                )
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("messages", f"{where}.content must be a string or a list of text parts")


def _function(value: Any, where: str) -> dict[str, str]:
    """A called function: its name and its arguments (a JSON text, as OpenAI sends them)."""
    if not (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and isinstance(value.get("arguments"), str)
    ):
        raise _bad("messages", f"{where} must be an object with a string name and string arguments")
    return {"name": value["name"], "arguments": value["arguments"]}


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", f"{where} must be a non-empty list of tool calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or not isinstance(call.get("id", ""), str):
            raise _bad("messages", f"{at} must be an object with a string id")
        if call.get("type", "function") != "function":
            raise _bad("messages", f'{at}.type must be "function"')
        calls.append(
            {
                "id": call.get("id", ""),
                "type": "function",
                "function": _function(call.get("function"), f"{at}.function"),
            }
        )
    return calls


def _message(message: Any, where: str) -> Message:
    if not isinstance(message, dict):
        raise _bad("messages", f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise _bad("messages", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}")
    out: Message = {"role": CHAT_ROLES[role]}
    content = message.get("content")
    calls = message.get("tool_calls")
    legacy_call = message.get("function_call")
    if role == "assistant" and content is None and (calls is not None or legacy_call is not None):
        out["content"] = None  # a turn that only called tools, as OpenAI allows
    else:
        out["content"] = _content(content, where)
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise _bad("messages", f"{where}.{key} must be a string")
            out[key] = value
    # Checked whatever the role; only an assistant's calls are history the template renders.
    if calls is not None:
        checked = _tool_calls(calls, f"{where}.tool_calls")
        if role == "assistant":
            out["tool_calls"] = checked
    if legacy_call is not None:
        function = _function(legacy_call, f"{where}.function_call")
        if role == "assistant":
            out["function_call"] = function
    return out


def chat_messages(value: Any) -> tuple[Message, ...]:
    """`messages` as the chat template reads them: roles mapped (CHAT_ROLES), text parts joined, and the
    fields of a tool-calling history kept (an assistant's `tool_calls`, a tool result's
    `tool_call_id` and `name`); raises ApiError naming what is wrong."""
    if not isinstance(value, list) or not value:
        raise _bad("messages", "messages must be a non-empty list of message objects")
    return tuple(_message(message, f"messages[{i}]") for i, message in enumerate(value))


def parse_chat(body: Mapping[str, Any], model: ServedModel) -> GenerationRequest:
    """`POST /v1/chat/completions`: `max_completion_tokens` wins over the older `max_tokens`."""
    fields = _common(body, model, ("max_completion_tokens", "max_tokens"))
    messages = chat_messages(body.get("messages"))
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs set to true")
    logprobs = (top or 0) if want_logprobs else None
    return GenerationRequest(chat=True, messages=messages, logprobs=logprobs, **fields)
