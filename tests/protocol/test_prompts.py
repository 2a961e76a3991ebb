"""protocol.prompts: a request's prompt ids through the chat template, or, where the template refuses
the conversation, the head it accepts through the template and the rest canonically serialized —
deterministic, and prefix-stable so that a growing agent session keeps matching the cache it built."""

from __future__ import annotations

import json
from typing import Any

import pytest

from protocol.errors import ApiError
from protocol.models import default_gguf_path
from protocol.openai_api import ServedModel, parse_chat, parse_completion
from protocol.prompts import canonical_ids, chat_prompt_ids, prompt_token_ids
from protocol.tokenizer import ChatTemplateError, Tokenizer

MODEL = ServedModel(name="m", vocab_size=49152, max_context_len=4096, kv_capacity_tokens=4096)
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}:{{ m.content }}|{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
STRICT_TEMPLATE = "{{ raise_exception('roles must alternate') }}"
# Reads a call's arguments as an object, as Hub templates for tool-calling models do.
CALLS_TEMPLATE = (
    "{% for m in messages %}{% for c in m.tool_calls or [] %}"
    "{{ c.function.name }}({{ c.function.arguments.city }}) {{ c.function.arguments | tojson }};"
    "{% endfor %}{% endfor %}"
)
ODD_REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'odd' %}{{ raise_exception('odd') }}{% endif %}"
    "{{ m.role }}:{{ m.content }}|{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(default_gguf_path())


def templated(tokenizer: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tokenizer.backend, template, tokenizer.special_tokens)


def call(number: int, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{number}",
        "type": "function",
        "function": {"name": "search", "arguments": arguments},
    }


def agent_session(turns: int) -> list[dict[str, Any]]:
    """An agent loop as OpenAI clients send it: every assistant turn only calls a tool (content None,
    which SmolLM2's template cannot concatenate), and every call's result follows it."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a research agent. Use the tools."},
        {"role": "user", "content": "Find the boiling point of water at 2000 m, and cite it."},
    ]
    for turn in range(1, turns + 1):
        arguments = json.dumps({"query": f"boiling point altitude step {turn}", "page": turn})
        messages.append({"role": "assistant", "content": None, "tool_calls": [call(turn, arguments)]})
        messages.append(
            {"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn}: ~93 °C 🌡\n\n"}
        )
    return messages


def test_a_conversation_the_template_renders_is_its_rendered_text(smol: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    ids = chat_prompt_ids(smol, messages)
    assert ids == smol.encode(smol.render_chat(messages))
    assert smol.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")


def test_chat_messages_are_normalised_and_templated(smol: Tokenizer) -> None:
    req = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ]
        },
        MODEL,
    )
    assert req.messages == ({"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"})
    ids = prompt_token_ids(req, templated(smol, PLAIN_TEMPLATE))
    assert smol.decode(ids) == "system:be brief|user:a\nb|assistant:"
    assert prompt_token_ids(parse_completion({"prompt": "hey"}, MODEL), smol) == smol.encode("hey")


def test_a_template_that_refuses_the_messages_means_the_canonical_form(smol: Tokenizer) -> None:
    strict = templated(smol, STRICT_TEMPLATE)
    req = parse_chat(
        {"messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}]}, MODEL
    )
    ids = prompt_token_ids(req, strict)
    assert ids == canonical_ids(strict, req.messages)
    assert smol.decode(ids) == '{"content":"x","role":"user"}\n{"content":"y","role":"user"}\n'
    # The tools, then the messages as sent (a call's arguments stay the JSON text the client wrote).
    messages = agent_session(1)
    text = smol.decode(chat_prompt_ids(strict, messages, TOOLS), skip_special_tokens=False)
    assert [json.loads(line) for line in text.splitlines()] == [{"tools": TOOLS}, *messages]


def test_smollm2_renders_the_head_it_accepts_and_the_rest_canonically(smol: Tokenizer) -> None:
    """SmolLM2's template concatenates a message's content, which a turn of tool calls alone lacks."""
    messages = agent_session(1)
    with pytest.raises(ChatTemplateError):
        smol.render_chat(messages)
    head = smol.render_chat(messages[:2], add_generation_prompt=False)
    expected = smol.encode(head) + canonical_ids(smol, messages[2:])
    assert chat_prompt_ids(smol, messages, TOOLS) == chat_prompt_ids(smol, messages) == expected


def test_the_head_is_the_longest_run_the_template_accepts(
    smol: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in a few renders, wherever in a long conversation the refused message sits."""
    picky = templated(smol, ODD_REFUSING_TEMPLATE)
    renders = []
    render_chat = Tokenizer.render_chat
    monkeypatch.setattr(Tokenizer, "render_chat", lambda *a, **k: renders.append(1) or render_chat(*a, **k))
    for refused_at in (0, 1, 2, 9, 10, 31, 39):
        messages = [{"role": "user", "content": str(i)} for i in range(40)]
        messages[refused_at] = {"role": "odd", "content": str(refused_at)}
        renders.clear()
        ids = chat_prompt_ids(picky, messages)
        assert len(renders) <= 2 + 2 * 6, "gallop and bisect: logarithmic in the conversation"
        head = "".join(f"user:{i}|" for i in range(refused_at))
        assert picky.decode(ids) == head + "".join(
            json.dumps(m, sort_keys=True, separators=(",", ":")) + "\n" for m in messages[refused_at:]
        )


def test_the_canonical_form_is_deterministic(smol: Tokenizer) -> None:
    messages = agent_session(2)
    reordered = [dict(reversed(list(m.items()))) for m in messages]
    assert chat_prompt_ids(smol, messages, TOOLS) == chat_prompt_ids(smol, reordered, TOOLS)
    assert chat_prompt_ids(smol, messages) == chat_prompt_ids(smol, json.loads(json.dumps(messages)))


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_a_growing_agent_session_keeps_its_prefix(
    smol: Tokenizer, tools: list[dict[str, Any]] | None
) -> None:
    sessions = [chat_prompt_ids(smol, agent_session(k), tools) for k in range(1, 6)]
    for k in range(4):
        assert len(sessions[k]) < len(sessions[k + 1])
        assert sessions[k + 1][: len(sessions[k])] == sessions[k], (
            f"turn {k + 1} is not a prefix of turn {k + 2}"
        )


def test_the_first_turn_the_template_refuses_extends_the_templated_one(smol: Tokenizer) -> None:
    """The templated turn's ids, less its generation prompt, open the next turn's."""
    opening = agent_session(0)
    templated_turn = chat_prompt_ids(smol, opening)
    generation_prompt = smol.encode("<|im_start|>assistant\n")
    assert templated_turn[-len(generation_prompt) :] == generation_prompt
    kept = templated_turn[: -len(generation_prompt)]
    assert chat_prompt_ids(smol, agent_session(1))[: len(kept)] == kept


def test_tool_call_arguments_reach_templates_as_objects(smol: Tokenizer) -> None:
    calls = templated(smol, CALLS_TEMPLATE)
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [call(1, '{"city": "Zürich"}'), call(2, "[1, 2]"), call(3, "{not json")],
        },
    ]
    text = calls.decode(chat_prompt_ids(calls, messages))
    # An object where the text parses as one; otherwise the text as sent.
    assert text == 'search(Zürich) {"city": "Zürich"};search() "[1, 2]";search() "{not json";'
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Zürich"}', "not mutated"


def test_attached_ids_need_no_tokenizer() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "prefixgate_token_ids": [4]}, MODEL)
    assert prompt_token_ids(req, tokenizer=None) == [4]
    assert prompt_token_ids(parse_completion({"prompt": [5, 6]}, MODEL), tokenizer=None) == [5, 6]
    for req in (
        parse_chat({"messages": [{"role": "user", "content": "hi"}]}, MODEL),
        parse_completion({"prompt": "hi"}, MODEL),
    ):
        with pytest.raises(ApiError) as info:
            prompt_token_ids(req, tokenizer=None)
        assert info.value.status == 400 and info.value.code == "token_ids_required"
        assert info.value.param == ("messages" if req.chat else "prompt")
