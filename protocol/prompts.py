"""A request's prompt as token ids: the chat template where it can render the conversation, a canonical
serialization where it cannot (docs/design.md §2 step 2).

The gateway hashes these ids to route, and attaches them to what it forwards to a bundled worker;
the worker computes the same ids when a client calls it directly. A conversation the template refuses
(a history of tool calls a template was not written for, content it does not expect) is not refused
for that. The template renders the longest leading run of messages it accepts, and every message
after it is serialized canonically — compact, sorted JSON, tokenized on its own — and the ids
concatenated. That is deterministic and prefix-stable: turn k+1's ids extend turn k's, and the turn
where the template first gives up still extends the templated turn before it (less its generation
prompt), so a growing agent session, and the system prompt that many sessions share, keep matching
the cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from protocol.errors import ApiError
from protocol.openai_api import GenerationRequest
from protocol.tokenizer import ChatTemplateError, Tokenizer


def chat_prompt_ids(
    tokenizer: Tokenizer, messages: Sequence[Any], tools: Sequence[Any] | None = None
) -> Sequence[int]:
    """The ids of a conversation (and its tools): through the template when it renders it, else its
    accepted head through the template and the rest canonically."""
    shaped = [_parsed_arguments(m) for m in messages]
    tools = list(tools) if tools is not None else None
    try:
        return tokenizer.encode(tokenizer.render_chat(shaped, tools))
    except ChatTemplateError:
        pass
    head, text = _template_head(tokenizer, shaped, tools)
    if head == 0:
        return canonical_ids(tokenizer, messages, tools)
    # The tools went where the template puts them (or nowhere, as for the whole conversation).
    return [*tokenizer.encode(text), *canonical_ids(tokenizer, messages[head:])]


def _template_head(tokenizer: Tokenizer, messages: list[Any], tools: list[Any] | None) -> tuple[int, str]:
    """How many leading messages the template renders (with no generation prompt: more follows), and
    their text. A template refuses a conversation for a message in it, so once a prefix is refused
    every longer one is: galloping then bisecting finds the first refused prefix in a few renders,
    the same one on every later turn."""

    def render(count: int) -> str | None:
        try:
            return tokenizer.render_chat(messages[:count], tools, add_generation_prompt=False)
        except ChatTemplateError:
            return None

    good, good_text, refused, step = 0, "", len(messages), 1
    while good + step < refused:
        text = render(good + step)
        if text is None:
            refused = good + step
            break
        good, good_text, step = good + step, text, 2 * step
    while refused - good > 1:
        middle = (good + refused) // 2
        text = render(middle)
        if text is None:
            refused = middle
        else:
            good, good_text = middle, text
    return good, good_text


def canonical_ids(
    tokenizer: Tokenizer, messages: Sequence[Any], tools: Sequence[Any] | None = None
) -> list[int]:
    """Each item (the tools first, when there are any; then every message as sent) as compact JSON with
    sorted keys and a newline, tokenized on its own."""
    parts = ([{"tools": list(tools)}] if tools else []) + list(messages)
    ids: list[int] = []
    for part in parts:
        ids += tokenizer.encode(
            json.dumps(part, sort_keys=True, ensure_ascii=False, separators=(",", ":")) + "\n"
        )
    return ids


def _parsed_arguments(message: Any) -> Any:
    """A message as HF templates expect it: a tool call's arguments as an object, not the JSON text
    OpenAI sends (as vLLM passes them), where they parse as one."""
    if not isinstance(message, dict) or not isinstance(message.get("tool_calls"), list):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                arguments = json.loads(function["arguments"])
            except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
                arguments = None
            if isinstance(arguments, dict):
                call = {**call, "function": {**function, "arguments": arguments}}
        calls.append(call)
    return {**message, "tool_calls": calls}


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
        return chat_prompt_ids(tokenizer, request.messages)
    assert request.prompt is not None
    return tokenizer.encode(request.prompt)
