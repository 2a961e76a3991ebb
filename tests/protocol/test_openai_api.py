"""Request validation, without a server: every refusal is a 4xx ApiError with OpenAI's error fields,
every accepted body maps to the engine's parameters as documented (response shapes:
test_openai_responses.py)."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.errors import ApiError
from protocol.openai_api import GenerationRequest, ServedModel, parse_chat, parse_completion, parse_json
from workers.openai_sampling import sampling_params

MODEL = ServedModel(name="m", vocab_size=100, max_context_len=64, kv_capacity_tokens=48)


def refused(parse: Any, body: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODEL)
    error = info.value
    assert 400 <= error.status < 500
    assert set(error.to_json()["error"]) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": 7}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [1, True]}, "prompt"),
        ({"prompt": [1, 100]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": [2, False]}, "prompt"),
        ({"prompt": [2, 1.0]}, "prompt"),
        ({"prompt": [2, None]}, "prompt"),
        ({"prompt": [2, [3]]}, "prompt"),
        ({"prompt": [2**32]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 65}, "max_tokens"),
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ({"prompt": "x", "temperature": -0.1}, "temperature"),
        ({"prompt": "x", "temperature": 2.5}, "temperature"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "top_p": 1.01}, "top_p"),
        ({"prompt": "x", "top_k": -2}, "top_k"),
        ({"prompt": "x", "seed": 2**64}, "seed"),
        ({"prompt": "x", "n": 65}, "n"),
        ({"prompt": "x", "n": 0}, "n"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "stop": ["a", ""]}, "stop"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "stream": True, "stream_options": []}, "stream_options"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "model": 5}, "model"),
        ({"prompt": "x", "prefixgate_token_ids": []}, "prefixgate_token_ids"),
        ({"prompt": "x", "prefixgate_token_ids": [1, 2, 999]}, "prefixgate_token_ids"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(body: dict, param: str) -> None:
    error = refused(parse_completion, body)
    assert error.status == 400
    assert error.param == param
    assert error.type == "invalid_request_error"


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": []},
        {"messages": "hi"},
        {"messages": ["hi"]},
        {"messages": [{"role": "robot", "content": "hi"}]},
        {"messages": [{"content": "hi"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "assistant", "content": None}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ],
)
def test_bad_messages_are_400(body: dict) -> None:
    assert refused(parse_chat, body).param == "messages"


def test_chat_specific_fields() -> None:
    user = [{"role": "user", "content": "hi"}]
    assert refused(parse_chat, {"messages": user, "top_logprobs": 2}).param == "top_logprobs"
    assert (
        refused(parse_chat, {"messages": user, "max_completion_tokens": 0}).param == "max_completion_tokens"
    )
    assert refused(parse_chat, {"messages": user, "tools": [{"type": "function"}]}).param == "tools"
    req = parse_chat({"messages": user, "max_tokens": 5, "max_completion_tokens": 7}, MODEL)
    assert req.max_tokens == 7
    req = parse_chat({"messages": user, "logprobs": True}, MODEL)
    assert req.logprobs == 0
    req = parse_chat({"messages": user, "logprobs": True, "top_logprobs": 3}, MODEL)
    assert req.logprobs == 3
    assert parse_chat({"messages": user, "logprobs": False}, MODEL).logprobs is None


def test_unknown_model_is_404_and_absent_model_means_the_served_one() -> None:
    error = refused(parse_completion, {"prompt": "x", "model": "gpt-9"})
    assert error.status == 404 and error.code == "model_not_found" and "gpt-9" in error.message
    assert parse_completion({"prompt": "x"}, MODEL).prompt == "x"
    assert parse_completion({"prompt": "x", "model": "m"}, MODEL).prompt == "x"


def test_malformed_json() -> None:
    for raw in (b"{", b"[1, 2]", b'"text"', b'{"prompt": NaN}', b"\xff\xfe"):
        with pytest.raises(ApiError) as info:
            parse_json(raw)
        assert info.value.status == 400 and info.value.code == "invalid_json"
    assert parse_json(b'{"a": 1}') == {"a": 1}


def test_accepted_completion_maps_to_engine_parameters() -> None:
    req = parse_completion(
        {
            "model": "m",
            "prompt": [[3, 4, 5]],
            "max_tokens": 9,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 11,
            "stop": "\n",
            "ignore_eos": True,
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "n": 1,
            "presence_penalty": 0,
            "user": "someone",
        },
        MODEL,
    )
    assert req.token_ids == (3, 4, 5) and req.stream and req.include_usage
    params = sampling_params(req, 3, MODEL)
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed) == (
        9,
        0.7,
        0.9,
        0,
        11,
    )
    assert params.stop == ("\n",) and params.ignore_eos and params.logprobs == 2


def test_top_p_zero_means_greedy() -> None:
    params = sampling_params(parse_completion({"prompt": "x", "top_p": 0}, MODEL), 1, MODEL)
    assert params.greedy and params.top_p == 1.0


def test_attached_token_ids_win_over_the_prompt() -> None:
    req = parse_completion({"prompt": [1, 2], "prefixgate_token_ids": [7, 8, 9]}, MODEL)
    assert req.token_ids == (7, 8, 9)
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "prefixgate_token_ids": [4]}, MODEL)
    assert req.token_ids == (4,)
    assert parse_completion({"prefixgate_token_ids": [5]}, MODEL).token_ids == (5,)


def test_context_window_errors_name_both_numbers() -> None:
    req = parse_completion({"prompt": "x", "max_tokens": 10}, MODEL)
    with pytest.raises(ApiError) as info:
        sampling_params(req, 64, MODEL)
    assert info.value.status == 400 and info.value.code == "context_length_exceeded"
    assert "64 tokens" in info.value.message and "context window is 64" in info.value.message
    with pytest.raises(ApiError) as info:
        sampling_params(req, 60, MODEL)
    assert "70" in info.value.message and "64" in info.value.message and info.value.param == "max_tokens"


def test_default_max_tokens() -> None:
    completion = parse_completion({"prompt": "x"}, MODEL)
    assert sampling_params(completion, 10, MODEL).max_tokens == 16
    roomy = ServedModel(name="m", vocab_size=100, max_context_len=64, kv_capacity_tokens=1000)
    assert sampling_params(completion, 60, roomy).max_tokens == 4, "never past the context window"
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}]}, MODEL)
    assert sampling_params(chat, 10, MODEL).max_tokens == 38, "chat: all that the KV pool can hold"


def test_generation_request_defaults_match_openai() -> None:
    req = GenerationRequest(chat=False)
    assert (req.temperature, req.top_p, req.stream, req.logprobs) == (1.0, 1.0, False, None)
