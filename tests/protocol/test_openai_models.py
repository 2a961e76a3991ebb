"""The request models alone: strict types, the rules across fields, and refusals that name the place
to change (protocol.openai_api turns them into OpenAI's errors; its own tests cover every field)."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.errors import ApiError
from protocol.openai_api import ServedModel, chat_messages, parse_chat, parse_completion
from protocol.openai_models import ChatRequest, CompletionRequest

MODEL = ServedModel(name="m", vocab_size=100, max_context_len=64, kv_capacity_tokens=48)
USER = [{"role": "user", "content": "hi"}]


def refusal(parse: Any, body: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODEL)
    return info.value


@pytest.mark.parametrize(
    ("field", "value"), [("n", True), ("n", 2.0), ("max_tokens", "9"), ("temperature", False), ("user", 7)]
)
def test_types_are_strict(field: str, value: Any) -> None:
    assert refusal(parse_completion, {"prompt": "x", field: value}).param == field


def test_an_integer_is_a_number_and_null_is_absent() -> None:
    request = parse_completion({"prompt": "x", "temperature": 1, "top_p": None, "n": None}, MODEL)
    assert (request.temperature, request.top_p, request.n) == (1.0, 1.0, 1)


def test_a_refusal_names_the_deepest_place_without_union_members() -> None:
    body = {"messages": [*USER, {"role": "user", "content": [{"type": "image_url", "url": "x"}]}]}
    error = refusal(parse_chat, body)
    assert error.param == "messages" and error.message.startswith("messages[1].content[0].type: ")
    assert refusal(parse_chat, {"messages": [{"role": "robot", "content": "x"}]}).message.startswith(
        "messages[0].role: "
    )


def test_a_refusal_never_echoes_the_value() -> None:
    error = refusal(parse_completion, {"prompt": "x", "prefixgate_token_ids": [1] * 10_000 + [-1]})
    assert error.param == "prefixgate_token_ids" and len(error.message) < 200


def test_unsupported_options_are_refused_as_such_and_their_off_values_accepted() -> None:
    error = refusal(parse_chat, {"messages": USER, "tools": [{"type": "function"}]})
    assert (error.param, error.code) == ("tools", "unsupported")
    off = {"echo": False, "best_of": 1, "logit_bias": {}, "response_format": {"type": "text"}, "suffix": ""}
    parse_completion({"prompt": "x", **off}, MODEL)
    assert refusal(parse_completion, {"prompt": "x", "echo": 0}).code == "unsupported"


@pytest.mark.parametrize(
    ("parse", "body", "param"),
    [
        (parse_completion, {"stream_options": {"include_usage": True}, "prompt": "x"}, "stream_options"),
        (parse_completion, {"max_tokens": 3}, "prompt"),
        (parse_chat, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (parse_chat, {"messages": [{"role": "user"}]}, "messages"),
    ],
)
def test_rules_across_fields_name_the_field(parse: Any, body: dict[str, Any], param: str) -> None:
    assert refusal(parse, body).param == param


def test_an_assistant_turn_that_only_calls_tools_has_no_content() -> None:
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}", "extra": 1}}
    (turn,) = chat_messages([{"role": "assistant", "tool_calls": [call], "vendor": True}])
    assert turn == {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    assert chat_messages(
        [
            {
                "role": "tool",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "tool_call_id": "c1",
            }
        ]
    ) == ({"role": "tool", "content": "a\nb", "tool_call_id": "c1"},)


def test_the_schemas_state_the_rules_across_fields() -> None:
    chat = ChatRequest.model_json_schema()
    completion = CompletionRequest.model_json_schema()
    assert {"stream_options", "top_logprobs"} <= {rule["if"]["required"][0] for rule in chat["allOf"]}
    assert completion["if"]["required"] == ["stream_options"] and len(completion["anyOf"]) == 2
    assert "prefixgate_prefill" not in completion["properties"], "the gateway's own field is not offered"
