"""The OpenAI request bodies the bundled workers accept, defined once (docs/design.md §4): the workers
validate bodies with these models (protocol.openai_api), and the gateway's /openapi.json states them
(gateway.http.openapi), so the document and the checks cannot drift apart.

Pydantic v2 in strict mode, as vLLM's protocol module: `1.0` is no integer, `"9"` no number, `true`
neither; unknown fields are allowed (a foreign backend's vendor fields pass the gateway untouched).
`null` means "absent" for every optional field, as in OpenAI's API. A rule across fields is a
validator, stated in the schema beside it (`json_schema_extra`) so that generators respect it too.

Prompts as token ids are the hot path (a long id list per request): they are custom types checked by
protocol.token_ids in C-level passes, not item by item. What depends on the model behind the worker
(its name, context window and vocabulary) is checked by protocol.openai_api, after these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, NotRequired

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    WithJsonSchema,
    model_validator,
)
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

from protocol.token_ids import MAX_TOKEN_ID, TokenIds, checked_token_ids

MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
# Choices per request: each is a sequence of its own in the running batch.
MAX_N = 64
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
Role = Literal["system", "developer", "user", "assistant", "tool", "function"]

_STRICT = ConfigDict(extra="allow", strict=True)
_TOKEN_IDS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
    "description": "token ids, each below the model's vocabulary size",
}
_TEXT_SCHEMA: dict[str, Any] = {"type": "string", "minLength": 1}


def _across(param: str, message: str) -> PydanticCustomError:
    """A rule across fields broken: the error names the field a client should change."""
    return PydanticCustomError("across_fields", message, {"param": param})


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid", message)


def _token_ids(value: Any) -> TokenIds:
    ids = checked_token_ids(value)
    if ids is None:
        raise _invalid("must be a non-empty list of integer token ids")
    return ids


def _prompt(value: Any) -> str | TokenIds:
    """Text, token ids, or a list of exactly one of those, unwrapped."""
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > 1:
            raise _invalid("batched prompts are not supported: send one prompt per request")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _invalid("must not be empty")
        return value
    if not isinstance(value, list):
        raise _invalid("must be a string or a list of token ids")
    return _token_ids(value)


TokenIdsField = Annotated[
    TokenIds,
    PlainValidator(_token_ids),
    WithJsonSchema(
        _TOKEN_IDS_SCHEMA
        | {"description": "the prompt as token ids, already templated: used instead of prompt or messages"}
    ),
]
PromptField = Annotated[
    str | TokenIds,
    PlainValidator(_prompt),
    WithJsonSchema(
        {
            "description": "text, token ids, or a list of exactly one of those (batches are refused)",
            "anyOf": [
                _TEXT_SCHEMA,
                _TOKEN_IDS_SCHEMA,
                {"type": "array", "minItems": 1, "maxItems": 1, "items": _TEXT_SCHEMA},
                {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKEN_IDS_SCHEMA},
            ],
        }
    ),
]
Text = Annotated[str, Field(min_length=1)]


def _off(is_off: Callable[[Any], bool], schema: dict[str, Any]) -> Any:
    """An option the workers do not implement, accepted only with the value that turns it off. The type
    counts too: `"echo": 0` or `"logit_bias": false` is refused, as OpenAI refuses them."""

    def check(value: Any) -> Any:
        if not is_off(value):
            raise PydanticCustomError("unsupported", "not supported by this worker")
        return value

    return Annotated[Any, PlainValidator(check), WithJsonSchema(schema | {"description": "not supported"})]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_zero(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and value == 0


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = None


class PrefillGrant(BaseModel):
    """The gateway's grant naming the prefill worker a decode worker pulls the prompt's KV from (its
    signature is checked by workers.kv_handoff)."""

    model_config = _STRICT

    url: Annotated[str, Field(pattern=r"^https?://")]


class _Generation(BaseModel):
    """What completions and chat share."""

    model_config = ConfigDict(
        extra="allow",
        strict=True,
        json_schema_extra={
            "if": {"required": ["stream_options"], "properties": {"stream_options": {"type": "object"}}},
            "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
        },
    )

    model: str | None = Field(
        None, description="a model some replica serves (GET /v1/models); optional when the gateway serves one"
    )
    max_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="at most the context window minus the prompt"
    )
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = Field(None, description="vLLM's extension: -1 or 0 for none")
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: Text | Annotated[list[Text], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = Field(
        None, description="choices, forked from one prefill of the prompt"
    )
    user: str | None = Field(None, description="the session key of session_affinity routing")
    ignore_eos: bool | None = None
    prefixgate_token_ids: TokenIdsField | None = None
    # The gateway's own field, refused from clients (gateway.forward.internal_fields): not in the document.
    prefixgate_prefill: SkipJsonSchema[PrefillGrant | None] = None

    best_of: _off(lambda v: v is None or (_is_int(v) and v == 1), {"enum": [1, None]}) = None
    echo: _off(lambda v: v is None or v is False, {"enum": [False, None]}) = None
    suffix: _off(lambda v: v is None or v == "", {"enum": ["", None]}) = None
    logit_bias: _off(lambda v: v is None or v == {}, {"type": ["object", "null"], "maxProperties": 0}) = None
    presence_penalty: _off(lambda v: v is None or _is_zero(v), {"enum": [0, None]}) = None
    frequency_penalty: _off(lambda v: v is None or _is_zero(v), {"enum": [0, None]}) = None
    tools: _off(lambda v: v is None or v == [], {"type": ["array", "null"], "maxItems": 0}) = None
    functions: _off(lambda v: v is None or v == [], {"type": ["array", "null"], "maxItems": 0}) = None
    response_format: _off(
        lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
        {
            "anyOf": [
                {"type": "object", "required": ["type"], "properties": {"type": {"const": "text"}}},
                {"type": "null"},
            ]
        },
    ) = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Generation:
        if self.stream_options is not None and not self.stream:
            raise _across("stream_options", "stream_options is only allowed when stream is true")
        return self


class CompletionRequest(_Generation):
    """`POST /v1/completions`: a prompt, or the token ids instead of one."""

    model_config = ConfigDict(
        json_schema_extra={
            "anyOf": [
                {"required": ["prompt"], "properties": {"prompt": {"not": {"type": "null"}}}},
                {
                    "required": ["prefixgate_token_ids"],
                    "properties": {"prefixgate_token_ids": {"type": "array"}},
                },
            ],
            **_Generation.model_config["json_schema_extra"],  # type: ignore[dict-item]
        }
    )

    prompt: PromptField | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="top alternatives reported per token"
    )

    @model_validator(mode="after")
    def _has_a_prompt(self) -> CompletionRequest:
        if self.prompt is None and self.prefixgate_token_ids is None:
            raise _across("prompt", "prompt is required")
        return self


# Messages are TypedDicts, validated into plain dicts: a long conversation's hundred messages as model
# instances cost four times as much, on every routed request the gateway renders. Their unknown fields
# are accepted and left out.
_MESSAGE_PART = ConfigDict(extra="ignore", strict=True)


class TextPart(TypedDict):
    __pydantic_config__ = _MESSAGE_PART  # type: ignore[misc]

    type: Literal["text"]
    text: str


class FunctionCalled(TypedDict):
    """A called function: its name and its arguments (a JSON text, as OpenAI sends them)."""

    __pydantic_config__ = _MESSAGE_PART  # type: ignore[misc]

    name: str
    arguments: str


class ToolCall(TypedDict):
    __pydantic_config__ = _MESSAGE_PART  # type: ignore[misc]

    id: NotRequired[str]
    type: NotRequired[Literal["function"]]
    function: FunctionCalled


class ChatMessage(TypedDict):
    """One message; its content may be null (or absent) only in an assistant turn that calls tools."""

    __pydantic_config__ = ConfigDict(  # type: ignore[misc]
        extra="ignore",
        strict=True,
        json_schema_extra={
            "anyOf": [
                {
                    "required": ["content"],
                    "properties": {"content": {"anyOf": [{"type": "string"}, {"type": "array"}]}},
                },
                {
                    "properties": {"role": {"const": "assistant"}},
                    "anyOf": [
                        {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array"}}},
                        {"required": ["function_call"], "properties": {"function_call": {"type": "object"}}},
                    ],
                },
            ]
        },
    )

    role: Role
    content: NotRequired[str | list[TextPart] | None]
    name: NotRequired[str | None]
    tool_call_id: NotRequired[str | None]
    tool_calls: NotRequired[Annotated[list[ToolCall], Field(min_length=1)] | None]
    function_call: NotRequired[FunctionCalled | None]


def _content_or_calls(message: ChatMessage) -> ChatMessage:
    calls = message.get("tool_calls") is not None or message.get("function_call") is not None
    if message.get("content") is None and not (message["role"] == "assistant" and calls):
        raise _across("content", "content must be a string or a list of text parts")
    return message


Messages = Annotated[list[Annotated[ChatMessage, AfterValidator(_content_or_calls)]], Field(min_length=1)]
MESSAGES = TypeAdapter(Messages)


class ChatRequest(_Generation):
    """`POST /v1/chat/completions`: `max_completion_tokens` wins over the older `max_tokens`."""

    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                _Generation.model_config["json_schema_extra"],
                {
                    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
                    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
                },
            ]
        }
    )

    messages: Messages
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = Field(
        None, description="wins over max_tokens"
    )
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="needs logprobs: true"
    )

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise _across("top_logprobs", "top_logprobs needs logprobs set to true")
        return self
