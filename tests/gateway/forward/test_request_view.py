"""What the gateway reads of a request to route it (gateway.forward.request_view), in-process and
without a model.

The gateway is transparent: a request goes upstream as sent, and only its prompt, model, stream flag and
session key are read, leniently, to route it. These tests pin each route's prompt (chat messages with
their tool calls and results, a completion's text, ids or batch, a Responses request's instructions and
input), that odd shapes mean less to route on rather than a refusal (only a model that is not a string
is refused, with a 400), and which routes are routed by prefix. Prompts are tokenized with a byte-level
tokenizer built here, so that the ids decode back to the text the template rendered.
"""

from __future__ import annotations

import json
from typing import Any, get_args

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from gateway.forward.pd_legs import PAIRED_ROUTES
from gateway.forward.request_view import (
    PREFIX_ROUTES,
    RequestView,
    Route,
    model_name,
    prompt_ids,
    read_request,
)
from protocol.errors import ApiError
from protocol.openai_api import parse_json
from protocol.tokenizer import Tokenizer

ROUTES: tuple[Route, ...] = get_args(Route)
# A template in the manner of HF chat templates: tools first, each message as <role>content, an
# assistant's calls after it, and an unknown role refused (as templates refuse what they were not
# written for).
TEMPLATE = (
    "{% if tools %}{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('bad role') }}"
    "{% endif %}"
    "<{{ m.role }}>{% if m.content %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}"
    "[call {{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
GET_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
TOOL_HISTORY = [
    {"role": "system", "content": "You answer about the weather."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "minus four and snowing"},
]


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


# Values a client may send in any field: of the wrong type, empty, huge, or nested (within what the
# gateway's JSON parser lets through, MAX_JSON_DEPTH).
ODD_VALUES: list[Any] = [
    None,
    0,
    -1,
    2**70,
    1.5,
    True,
    "",
    "x" * 100_000,
    [],
    [None],
    [[]],
    [{}],
    {},
    {"role": "user"},
    [{"role": "user", "content": {"text": "x"}}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
    [{"type": "message", "role": "user", "content": [{"type": "input_image"}]}],
    [{"type": "function_call_output", "call_id": 7, "output": None}],
    nested(100),
    [nested(100)],
    list(range(10_000)),
    [-1, 2**40],
    ["a", 1],
    [[1, 2], "b"],
]
PROMPT_FIELDS = (
    "messages",
    "tools",
    "prompt",
    "input",
    "instructions",
    "previous_response_id",
    "user",
    "stream",
    "prefixgate_token_ids",
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """One token per byte (a BPE with no merges over the byte-level alphabet): any text encodes, and
    decodes back exactly."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, TEMPLATE, {})


def prompt_text(view: RequestView, tokenizer: Tokenizer) -> str:
    ids = prompt_ids(view, tokenizer)
    assert ids is not None
    return tokenizer.decode(ids)


# -- routes ------------------------------------------------------------------------------------------


def test_chat_completions_and_responses_are_the_routes_routed_by_prefix() -> None:
    assert {"chat", "completions", "responses"} == PREFIX_ROUTES
    assert set(ROUTES) >= PREFIX_ROUTES
    for route in set(ROUTES) - PREFIX_ROUTES:
        view = read_request(route, {"messages": TOOL_HISTORY, "prompt": "p", "input": "i"})
        assert not view.has_prompt


def test_chat_and_completions_are_paired_for_disaggregation_and_responses_is_not() -> None:
    assert {"chat", "completions"} == PAIRED_ROUTES
    assert PAIRED_ROUTES < PREFIX_ROUTES


def test_a_body_that_is_not_json_is_read_as_nothing_but_its_route() -> None:
    for route in ROUTES:
        assert read_request(route, None) == RequestView(route)
        assert not RequestView(route).has_prompt


def test_an_embeddings_input_is_not_read_as_a_prompt() -> None:
    view = read_request("embeddings", {"model": "m", "input": ["a", "b"], "user": "u"})
    assert (view.model, view.user, view.has_prompt) == ("m", "u", False)


# -- the model, the stream flag and the session key --------------------------------------------------


def test_the_model_is_read_on_every_route_and_may_be_absent() -> None:
    for route in ROUTES:
        assert read_request(route, {"model": "llama"}).model == "llama"
        assert read_request(route, {}).model is None
        assert read_request(route, {"model": None}).model is None
    assert model_name({"model": ""}) == ""


@pytest.mark.parametrize("model", [1, 1.5, True, ["m"], {"id": "m"}])
def test_a_model_that_is_not_a_string_is_a_400_on_every_route(model: Any) -> None:
    for route in ROUTES:
        with pytest.raises(ApiError) as refused:
            read_request(route, {"model": model, "messages": TOOL_HISTORY})
        error = refused.value
        assert (error.status, error.param, error.code) == (400, "model", "invalid_value")
    with pytest.raises(ApiError):
        model_name({"model": model})


def test_only_a_json_true_makes_a_stream() -> None:
    assert read_request("chat", {"stream": True}).stream is True
    for value in (False, None, 1, "true", [True], {}):
        assert read_request("chat", {"stream": value}).stream is False


def test_the_user_field_is_the_session_key_when_it_is_a_string() -> None:
    for route in ROUTES:
        assert read_request(route, {"user": "alice"}).user == "alice"
        for value in (None, 7, ["alice"], {"id": "alice"}):
            assert read_request(route, {"user": value}).user is None


# -- chat ----------------------------------------------------------------------------------------------


def test_a_chat_keeps_the_tool_calls_and_tool_results_of_its_history() -> None:
    view = read_request("chat", {"model": "m", "messages": TOOL_HISTORY, "tools": [GET_WEATHER]})
    assert view.messages is not None and len(view.messages) == len(TOOL_HISTORY)
    assistant, result = view.messages[2], view.messages[3]
    assert assistant["content"] is None and assistant["tool_calls"] == [CALL]
    assert result == {"role": "tool", "tool_call_id": "call_1", "content": TOOL_HISTORY[3]["content"]}
    assert view.tools == [GET_WEATHER]
    assert view.has_prompt and view.text is None and view.token_ids is None


def test_a_chat_prompt_includes_the_tools_the_calls_and_the_tool_results(tokenizer: Tokenizer) -> None:
    view = read_request("chat", {"messages": TOOL_HISTORY, "tools": [GET_WEATHER]})
    text = prompt_text(view, tokenizer)
    assert text.startswith("[tool get_weather]<system>You answer about the weather.")
    assert '[call get_weather {"city": "Oslo"}]' in text  # the arguments as an object, as templates get them
    assert text.endswith(f"<tool>{TOOL_HISTORY[3]['content']}<assistant>")


def test_a_chat_prompt_is_its_template_rendered_and_tokenized(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "héllo, wörld ✓"}]
    view = read_request("chat", {"messages": messages})
    assert prompt_ids(view, tokenizer) == tokenizer.encode(tokenizer.render_chat(messages))


def test_chat_roles_and_text_parts_are_read_as_the_workers_template_reads_them() -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": parts},
        {"role": "function", "name": "lookup", "content": "42"},
    ]
    view = read_request("chat", {"messages": messages})
    assert view.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first\nsecond"},
        {"role": "tool", "name": "lookup", "content": "42"},
    ]


def test_a_chat_the_worker_would_refuse_is_still_routed_on_its_messages_as_sent(tokenizer: Tokenizer) -> None:
    messages = [
        {"role": "user", "content": "look at this"},
        {"role": "robot", "content": "beep"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]},
    ]
    view = read_request("chat", {"messages": messages})
    assert view.messages == messages
    # The template renders the head it accepts; the rest is serialized canonically.
    text = prompt_text(view, tokenizer)
    assert text.startswith("<user>look at this") and '"beep"' in text and '"image_url"' in text


@pytest.mark.parametrize("messages", [None, [], {}, "hello", 3])
def test_a_chat_without_a_list_of_messages_has_no_prompt(messages: Any, tokenizer: Tokenizer) -> None:
    view = read_request("chat", {"model": "m", "messages": messages})
    assert view.messages is None and not view.has_prompt
    assert prompt_ids(view, tokenizer) is None


@pytest.mark.parametrize("tools", [None, [], {}, "get_weather", 0])
def test_tools_that_are_not_a_non_empty_list_are_not_read(tools: Any) -> None:
    for route in ("chat", "responses"):
        assert read_request(route, {"messages": TOOL_HISTORY, "input": "hi", "tools": tools}).tools is None


# -- completions -------------------------------------------------------------------------------------


def test_a_completion_text_is_the_prompt(tokenizer: Tokenizer) -> None:
    view = read_request("completions", {"prompt": "Once upon a time"})
    assert view.text == "Once upon a time" and view.token_ids is None and view.messages is None
    assert prompt_ids(view, tokenizer) == tokenizer.encode("Once upon a time")


def test_completion_token_ids_are_the_prompt_as_given(tokenizer: Tokenizer) -> None:
    ids = list(range(200_000))
    view = read_request("completions", {"prompt": ids})
    assert view.token_ids is ids and view.text is None
    assert prompt_ids(view, tokenizer) is ids
    assert read_request("completions", {"prompt": [0, 2**32 - 1]}).token_ids == [0, 2**32 - 1]


def test_a_completion_batch_is_routed_on_its_first_prompt() -> None:
    assert read_request("completions", {"prompt": ["first", "second"]}).text == "first"
    assert read_request("completions", {"prompt": [[5, 6], [7]]}).token_ids == [5, 6]
    assert read_request("completions", {"prompt": [[5, 6], "mixed"]}).token_ids == [5, 6]


@pytest.mark.parametrize(
    "prompt",
    [
        "",
        [],
        [""],
        [[]],
        [True, 1],
        [1, False],
        [-1, 2],
        [2**32],
        [2**70],
        [1.0, 2.0],
        [1, None],
        [1, [2]],
        [["a"]],
        [{"id": 1}],
        {"text": "x"},
        7,
        None,
    ],
)
def test_a_completion_prompt_that_is_neither_text_nor_ids_has_no_prompt(prompt: Any) -> None:
    view = read_request("completions", {"model": "m", "prompt": prompt})
    assert (view.text, view.token_ids, view.has_prompt) == (None, None, False)


def test_ids_a_client_tokenized_itself_are_the_prompt_over_the_text() -> None:
    for route, field, value in (("chat", "messages", TOOL_HISTORY), ("completions", "prompt", "text")):
        view = read_request(route, {field: value, "prefixgate_token_ids": [3, 1, 4]})
        assert (view.token_ids, view.messages, view.text) == ([3, 1, 4], None, None)
        # Attached ids that are not ids are the worker's to refuse: nothing else is read as the prompt.
        for bad in ([1, -1], ["a"], [], "3 1 4", {"ids": [3]}):
            assert not read_request(route, {field: value, "prefixgate_token_ids": bad}).has_prompt
    # A Responses request has no such field: its input is its prompt.
    view = read_request("responses", {"input": "hi", "prefixgate_token_ids": [3, 1, 4]})
    assert view.token_ids is None and view.messages == [{"role": "user", "content": "hi"}]


# -- responses ---------------------------------------------------------------------------------------


def test_a_responses_prompt_is_its_instructions_then_its_input(tokenizer: Tokenizer) -> None:
    view = read_request("responses", {"instructions": "Talk like a pirate.", "input": "Hello"})
    assert view.messages == [
        {"role": "system", "content": "Talk like a pirate."},
        {"role": "user", "content": "Hello"},
    ]
    assert prompt_text(view, tokenizer) == "<system>Talk like a pirate.<user>Hello<assistant>"


def test_responses_input_items_become_messages_and_the_other_items_stay_as_sent() -> None:
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"}
    output = {"type": "function_call_output", "call_id": "c1", "output": "snow"}
    reasoning = {"type": "reasoning", "summary": []}
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}
    items = [
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}, {"text": "b"}]},
        call,
        output,
        reasoning,
        {"role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        image,
        {"role": "tool", "content": "not a Responses role"},
        "not an item",
    ]
    view = read_request("responses", {"input": items})
    assert view.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        call,
        output,
        reasoning,
        {"role": "assistant", "content": "done"},
        image,
        items[7],
        items[8],
    ]


def test_a_responses_prompt_includes_the_function_call_outputs(tokenizer: Tokenizer) -> None:
    output = {"type": "function_call_output", "call_id": "c1", "output": "minus four and snowing"}
    view = read_request("responses", {"input": [{"role": "user", "content": "Weather?"}, output]})
    # The template refuses an item that is not a message; the canonical form still carries it.
    text = prompt_text(view, tokenizer)
    assert text.startswith("<user>Weather?") and '"output":"minus four and snowing"' in text


@pytest.mark.parametrize("instructions", [None, "", 3, ["be brief"]])
def test_responses_instructions_that_are_not_text_are_left_out(instructions: Any) -> None:
    view = read_request("responses", {"instructions": instructions, "input": "hi"})
    assert view.messages == [{"role": "user", "content": "hi"}]
    assert read_request("responses", {"instructions": instructions}).messages is None


@pytest.mark.parametrize("given", [None, [], 3, {"role": "user", "content": "hi"}])
def test_a_responses_request_without_input_is_its_instructions_alone(given: Any) -> None:
    view = read_request("responses", {"instructions": "be brief", "input": given})
    assert view.messages == [{"role": "system", "content": "be brief"}]


def test_a_responses_continuation_names_the_response_it_continues() -> None:
    view = read_request("responses", {"input": "and then?", "previous_response_id": "resp_abc"})
    assert view.previous_response_id == "resp_abc"
    for value in (None, "", 12, ["resp_abc"], {"id": "resp_abc"}):
        assert read_request("responses", {"previous_response_id": value}).previous_response_id is None
    # Only a Responses request continues a stored response.
    assert read_request("chat", {"previous_response_id": "resp_abc"}).previous_response_id is None


@pytest.mark.parametrize("role", [["user"], {"name": "user"}])
def test_a_responses_item_whose_role_is_not_a_string_is_kept_as_sent(role: Any) -> None:
    item = {"type": "message", "role": role, "content": "hi"}
    assert read_request("responses", {"input": [item]}).messages == [item]


# -- odd shapes --------------------------------------------------------------------------------------


def test_odd_shapes_in_any_field_mean_less_to_route_on_never_an_error(tokenizer: Tokenizer) -> None:
    for route in ROUTES:
        for field in PROMPT_FIELDS:
            for value in ODD_VALUES:
                view = read_request(route, {"model": "m", field: value})
                assert isinstance(view, RequestView) and view.route == route and view.model == "m"
                if route not in PREFIX_ROUTES:
                    assert not view.has_prompt
                    continue
                ids = prompt_ids(view, tokenizer)
                assert (ids is not None) == view.has_prompt, (route, field)
                assert ids is None or all(isinstance(i, int) for i in ids)


def test_a_deeply_nested_body_the_parser_accepts_is_routed_on_what_it_holds(tokenizer: Tokenizer) -> None:
    deep = nested(120)
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": deep}]
    body = parse_json(json.dumps({"model": "m", "messages": messages, "tools": [deep]}).encode())
    view = read_request("chat", body)
    assert view.messages == messages and view.tools == [deep]
    # The template cannot render these tools: all of the prompt is canonical, the tools first.
    assert prompt_text(view, tokenizer).startswith('{"tools":[[[[')


def test_tool_call_arguments_nested_past_the_recursion_limit_still_give_ids(tokenizer: Tokenizer) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}
    messages = [{"role": "assistant", "content": None, "tool_calls": [call]}]
    body = parse_json(json.dumps({"messages": messages}).encode())
    view = read_request("chat", body)
    assert view.messages is not None and view.messages[0]["tool_calls"] == [call]
    assert prompt_ids(view, tokenizer)
