"""The OpenAI request bodies a bundled worker accepts, validated at its edge (docs/design.md §4).

Pure: no I/O and no engine. The bodies are defined once, as models (protocol.openai_models); this module
reads a body with them, adds the checks that depend on the model behind the worker (its name, context
window and vocabulary), and turns every way a body can be wrong into an `ApiError` with a 4xx status
and OpenAI's error shape, so that nothing malformed ever reaches the engine thread (where a bad token id
would fail every request in the batch, not just its own). The gateway does not apply these checks to
what it forwards (it passes bodies through, docs/design.md §2); it reads the same messages with
`chat_messages` when it renders a prompt for routing, so a valid body becomes the same prompt on both
sides.

Extensions beyond OpenAI's fields, as vLLM spells them where it has them: `top_k`, `ignore_eos`, and
`prefixgate_token_ids` — the prompt's token ids as the gateway computed them (after the chat
template, for chat). When present they are used as the prompt and nothing is tokenized; the rest of
the body is still validated as usual. `prefixgate_prefill` — the gateway's grant naming the prefill
worker a decode worker pulls the prompt's KV from (prefill/decode disaggregation, signed:
protocol.transfer_auth; workers.kv_handoff checks it). The gateway refuses any `prefixgate_*`
field but `prefixgate_token_ids` from a client (gateway.forward.internal_fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from protocol.errors import ApiError
from protocol.errors import bad_value as _bad
from protocol.openai_models import (
    MESSAGES,
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    FunctionCalled,
    StreamOptions,
    TextPart,
    ToolCall,
)
from protocol.token_ids import TokenIds

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
# Levels of objects and arrays a body may nest: well under the 254 that orjson encodes.
MAX_JSON_DEPTH = 128
# One chat message as the template reads it (see chat_messages).
Message = dict[str, Any]
# The names a validation error's location may hold; anything else in it names a member of a union.
_FIELDS = frozenset(
    [
        *CompletionRequest.model_fields,
        *ChatRequest.model_fields,
        *StreamOptions.model_fields,
        *(
            name
            for part in (ChatMessage, TextPart, ToolCall, FunctionCalled)
            for name in part.__annotations__
        ),
    ]
)


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


def _where(loc: tuple[int | str, ...]) -> str:
    """A location as a client reads it: `messages[0].content`, union members left out."""
    where = ""
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif part in _FIELDS:
            where += f".{part}" if where else part
    return where


def _refusal(error: ValidationError, prefix: tuple[int | str, ...] = ()) -> ApiError:
    """The 400 for a body a model refused, naming the field to change. Of a union's errors, the one that
    went deepest into the value says best what is wrong with it."""
    details = error.errors(include_url=False, include_input=False)
    detail = max(details, key=lambda d: len(d["loc"]))
    loc = prefix + tuple(detail["loc"])
    ctx = detail.get("ctx") or {}
    if detail["type"] == "unsupported":
        name = str(loc[0])
        return ApiError(400, f"{name} is not supported by this worker", param=name, code="unsupported")
    if detail["type"] == "across_fields" and not loc:
        return _bad(ctx["param"], detail["msg"])
    if not loc:  # the body itself: not an object
        return ApiError(400, f"the body must be a JSON object: {detail['msg']}", code="invalid_json")
    where = _where(loc)
    return _bad(str(loc[0]), f"{where}: {detail['msg']}" if where else detail["msg"])


def _validated(model: type[BaseModel], body: Mapping[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise _refusal(error) from None


def _check_model(name: str | None, model: ServedModel) -> None:
    """A missing model means the served one (as vLLM does); a different one is not here."""
    if name is not None and name != model.name:
        raise ApiError(
            404,
            f"the model {name!r} does not exist on this worker; it serves {model.name!r}",
            param="model",
            code="model_not_found",
        )


def _in_vocabulary(ids: TokenIds, name: str, vocab_size: int) -> list[int]:
    if ids.largest >= vocab_size:
        bad = next(t for t in ids.ids if t >= vocab_size)
        raise _bad(name, f"{name} holds token id {bad}, outside this model's vocabulary [0, {vocab_size})")
    return ids.ids


def _max_tokens(
    request: CompletionRequest | ChatRequest, names: tuple[str, ...], model: ServedModel
) -> int | None:
    """The first of `names` given, within the context window."""
    for name in names:
        value = getattr(request, name)
        if value is not None:
            if value > model.max_context_len:
                raise _bad(name, f"{name} must be between 1 and {model.max_context_len}, got {value}")
            return value
    return None


def _common(
    request: CompletionRequest | ChatRequest, model: ServedModel, max_tokens_names: tuple[str, ...]
) -> dict[str, Any]:
    """The fields completions and chat share, as GenerationRequest keyword arguments."""
    _check_model(request.model, model)
    stop = request.stop
    fields: dict[str, Any] = {
        "max_tokens": _max_tokens(request, max_tokens_names, model),
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        # vLLM spells "no top-k" as -1, the engine as 0.
        "top_k": max(request.top_k or 0, 0),
        "seed": request.seed,
        "stop": () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop),
        "ignore_eos": bool(request.ignore_eos),
        "stream": bool(request.stream),
        "include_usage": bool(request.stream_options and request.stream_options.include_usage),
        "n": request.n or 1,
    }
    # The nucleus of mass 0 is the single most likely token: greedy, as OpenAI treats it.
    if fields["top_p"] == 0.0:
        fields["temperature"], fields["top_p"] = 0.0, 1.0
    if request.prefixgate_token_ids is not None:
        fields["token_ids"] = tuple(
            _in_vocabulary(request.prefixgate_token_ids, "prefixgate_token_ids", model.vocab_size)
        )
    if request.prefixgate_prefill is not None:
        fields["prefill_url"] = request.prefixgate_prefill.url
    return fields


def parse_completion(body: Mapping[str, Any], model: ServedModel) -> GenerationRequest:
    """`POST /v1/completions`: `prompt` is a string, a list of token ids, or a one-element list of either."""
    request: CompletionRequest = _validated(CompletionRequest, body)
    fields = _common(request, model, ("max_tokens",))
    prompt = request.prompt
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif prompt is not None:
        # Checked even beside the gateway's ids, copied only when they are the prompt.
        ids = _in_vocabulary(prompt, "prompt", model.vocab_size)
        if "token_ids" not in fields:
            fields["token_ids"] = tuple(ids)
    return GenerationRequest(chat=False, logprobs=request.logprobs, **fields)


def _template_message(message: ChatMessage) -> Message:
    content = message.get("content")
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    out: Message = {"role": CHAT_ROLES[message["role"]], "content": content}
    if len(message) == 2 and "content" in message:  # a role and its content, as most turns are
        return out
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None:
            out[key] = value
    # Checked whatever the role; only an assistant's calls are history the template renders.
    if message["role"] == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            out["tool_calls"] = [
                {
                    "id": call.get("id", ""),
                    "type": "function",
                    "function": {
                        "name": call["function"]["name"],
                        "arguments": call["function"]["arguments"],
                    },
                }
                for call in calls
            ]
        called = message.get("function_call")
        if called is not None:
            out["function_call"] = {"name": called["name"], "arguments": called["arguments"]}
    return out


def chat_messages(value: Any) -> tuple[Message, ...]:
    """`messages` as the chat template reads them: roles mapped (CHAT_ROLES), text parts joined, and the
    fields of a tool-calling history kept (an assistant's `tool_calls`, a tool result's
    `tool_call_id` and `name`); raises ApiError naming what is wrong."""
    try:
        messages = MESSAGES.validate_python(value)
    except ValidationError as error:
        raise _refusal(error, ("messages",)) from None
    return tuple(_template_message(m) for m in messages)


def parse_chat(body: Mapping[str, Any], model: ServedModel) -> GenerationRequest:
    """`POST /v1/chat/completions`: `max_completion_tokens` wins over the older `max_tokens`."""
    request: ChatRequest = _validated(ChatRequest, body)
    fields = _common(request, model, ("max_completion_tokens", "max_tokens"))
    messages = tuple(_template_message(m) for m in request.messages)
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    return GenerationRequest(chat=True, messages=messages, logprobs=logprobs, **fields)
