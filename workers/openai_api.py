"""The OpenAI wire format of a worker: request bodies in, response bodies and SSE chunks out.

Pure: no I/O and no engine. Every way a body can be wrong becomes an `ApiError` with a 4xx status
and OpenAI's error shape here, at the edge, so that nothing malformed ever reaches the engine thread
(where a bad token id would fail every request in the batch, not just its own).

Extensions beyond OpenAI's fields, as vLLM spells them where it has them: `top_k`, `ignore_eos`, and
`prefixgate_token_ids` — the prompt's token ids as the gateway computed them (after the chat
template, for chat). When present they are used as the prompt and nothing is tokenized; the rest of
the body is still validated as usual.
"""

from __future__ import annotations

import array
import json
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import orjson
from jinja2 import TemplateError

from workers.engine.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# The default of OpenAI's legacy completions endpoint; chat defaults to whatever fits instead.
DEFAULT_COMPLETION_MAX_TOKENS = 16
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_SEED_RANGE = (-(2**63), 2**64 - 1)
# Response header with the prompt tokens served from the prefix cache, known at the first token: the
# gateway reads it instead of parsing the stream for the usage chunk.
CACHED_TOKENS_HEADER = "x-prefixgate-cached-tokens"
_ERROR_TYPES = {429: "rate_limit_exceeded", 503: "service_unavailable"}

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


class ApiError(Exception):
    """A request the worker refuses, with its HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = dict(headers or {})
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        default = "invalid_request_error" if status < 500 else "server_error"
        self.type = type or _ERROR_TYPES.get(status, default)

    def to_json(self) -> dict[str, Any]:
        return error_json(self.message, self.type, self.param, self.code)


def error_json(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_value")


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
    messages: tuple[dict[str, str], ...] = ()
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


# -- parsing --------------------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object. orjson is a strict RFC 8259 parser, and several times faster than
    the standard library's on the long id lists of token prompts: it refuses NaN and Infinity, numbers
    beyond a double, unpaired surrogates (escaped or not), text that is not UTF-8, and nesting past
    1,024 levels, all of which would otherwise travel on into tokenizers, hashing and the engine."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as error:
        raise ApiError(400, f"the body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    return body


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
    if isinstance(value, list) and value and _fast_ids_ok(value, vocab_size):
        return tuple(value)
    # Finding what is wrong, for the error message, can take the slow way.
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise _bad(name, f"{name} must be a list of integer token ids")
    if not value:
        raise _bad(name, f"{name} must not be empty")
    bad = next(t for t in value if not 0 <= t < vocab_size)
    raise _bad(name, f"{name} holds token id {bad}, outside this model's vocabulary [0, {vocab_size})")


def _fast_ids_ok(value: list[Any], vocab_size: int) -> bool:
    """Whether every item is a token id, checked in three C-level passes, because it runs on every
    token-id prompt (a per-id Python check cost ~0.1 µs per id). array("I") takes exactly the ints in
    [0, 2**32), and bools, which JSON's true and false become: those are the only values whose JSON
    has an "e" in it. numpy finds the largest id."""
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
    n = _int(body, "n", 1)
    if n is not None and n > 1:
        raise ApiError(
            400,
            f"n={n} is not supported: this worker returns one choice per request; send {n} requests",
            param="n",
            code="unsupported",
        )


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
    }
    # The nucleus of mass 0 is the single most likely token: greedy, as OpenAI treats it.
    if fields["top_p"] == 0.0:
        fields["temperature"], fields["top_p"] = 0.0, 1.0
    if "prefixgate_token_ids" in body:
        fields["token_ids"] = _token_ids(
            body["prefixgate_token_ids"], "prefixgate_token_ids", model.vocab_size
        )
    return fields


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


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "messages must be a non-empty list of message objects")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _bad("messages", f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(
                "messages", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)}"
            )
        messages.append({"role": CHAT_ROLES[role], "content": _content(message.get("content"), where)})
    return tuple(messages)


def parse_chat(body: Mapping[str, Any], model: ServedModel) -> GenerationRequest:
    """`POST /v1/chat/completions`: `max_completion_tokens` wins over the older `max_tokens`."""
    fields = _common(body, model, ("max_completion_tokens", "max_tokens"))
    messages = _messages(body.get("messages"))
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "top_logprobs needs logprobs set to true")
    logprobs = (top or 0) if want_logprobs else None
    return GenerationRequest(chat=True, messages=messages, logprobs=logprobs, **fields)


# -- prompt and sampling --------------------------------------------------------------------------


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...


def prompt_token_ids(request: GenerationRequest, tokenizer: Tokenizer | None) -> list[int]:
    """The prompt as the engine sees it: the attached ids, or the (templated) text tokenized.

    No special tokens are added to a plain prompt (the offline LLM does the same), so a completion
    and the gateway's tokenization of the same string agree.
    """
    if request.token_ids is not None:
        return list(request.token_ids)
    if tokenizer is None:
        raise ApiError(
            400,
            "this worker has no tokenizer (a simulated engine): send the prompt as token ids "
            "(`prompt` as a list of ids, or `prefixgate_token_ids`)",
            param="messages" if request.chat else "prompt",
            code="token_ids_required",
        )
    if request.chat:
        try:
            text = tokenizer.apply_chat_template(
                list(request.messages), add_generation_prompt=True, tokenize=False
            )
        except (TemplateError, ValueError) as error:
            raise _bad("messages", f"the chat template refused these messages: {error}") from None
    else:
        assert request.prompt is not None
        text = request.prompt
    return tokenizer.encode(text, add_special_tokens=False)


def sampling_params(request: GenerationRequest, prompt_len: int, model: ServedModel) -> SamplingParams:
    """The engine's parameters, with the context window checked against the real prompt length."""
    window = model.max_context_len
    param = "messages" if request.chat else "prompt"
    if prompt_len >= window:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens, but this model's context window is {window} tokens "
            "(and it must leave room for at least one generated token)",
            param=param,
            code="context_length_exceeded",
        )
    max_tokens = request.max_tokens
    if max_tokens is None:
        room = window - prompt_len
        default = room if request.chat else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = max(1, min(default, room, model.kv_capacity_tokens - prompt_len))
    elif prompt_len + max_tokens > window:
        raise ApiError(
            400,
            f"this model's context window is {window} tokens, but the request needs "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt + {max_tokens} max_tokens)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
    )


# -- responses ------------------------------------------------------------------------------------

# One generated token's (id, logprob, top alternatives as (id, logprob)).
TokenLogprob = tuple[int, float | None, list[tuple[int, float]] | None]


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def sse(payload: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
# The status counted for a request whose client left before its answer was complete (nginx's code).
CLIENT_GONE = 499
# Seconds a client refused for overload (429) is told to wait, by workers and gateways alike.
RETRY_AFTER_S = 1


def new_response_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


@dataclass(slots=True)
class ResponseShaper:
    """Builds one request's response body or its stream of chunks, in the endpoint's flavour.

    `decode_token` turns one token id into its text for logprobs; the completion flavour's
    `text_offset` runs across chunks, so one shaper serves exactly one request.
    """

    chat: bool
    model: str
    created: int
    decode_token: Callable[[int], str]
    include_usage: bool = False
    id: str = ""
    _text_offset: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.id = self.id or new_response_id(self.chat)

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def response(
        self,
        text: str,
        finish_reason: str | None,
        usage: dict[str, Any],
        logprobs: Sequence[TokenLogprob] | None,
    ) -> dict[str, Any]:
        """The whole non-streaming body."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        body = self._envelope("chat.completion" if self.chat else "text_completion", [choice])
        body["usage"] = usage
        return body

    def chunk(
        self,
        text: str,
        finish_reason: str | None,
        logprobs: Sequence[TokenLogprob] | None = None,
        role: bool = False,
    ) -> dict[str, Any]:
        """One streamed delta; `role` marks chat's opening chunk, which announces the assistant."""
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = (
                {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
            )
        else:
            choice["text"] = text
        choice["logprobs"] = self._logprobs(logprobs)
        choice["finish_reason"] = finish_reason
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk when the client asked for usage: no choices, only the totals."""
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage
        return body

    def _logprobs(self, entries: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(token_id, lp, top) for token_id, lp, top in entries]}
        tokens = [self.decode_token(token_id) for token_id, _, _ in entries]
        offsets = []
        for token in tokens:
            offsets.append(self._text_offset)
            self._text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in entries],
            "top_logprobs": [
                None if top is None else {self.decode_token(i): v for i, v in top} for _, _, top in entries
            ],
            "text_offset": offsets,
        }

    def _chat_entry(
        self, token_id: int, logprob: float | None, top: list[tuple[int, float]] | None
    ) -> dict[str, Any]:
        entry = self._token_entry(token_id, logprob)
        entry["top_logprobs"] = [self._token_entry(i, v) for i, v in top or []]
        return entry

    def _token_entry(self, token_id: int, logprob: float | None) -> dict[str, Any]:
        token = self.decode_token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
