"""What the gateway reads of a request to route it — and nothing more (docs/design.md §2 step 2).

In front of any OpenAI-compatible server the gateway is transparent: the body goes upstream byte for
byte and the backend judges it. Routing still needs the prompt's tokens, so this reads, leniently,
what a prompt is made of in each API: a chat's messages and tools, a completion's prompt (text or
ids), a Responses request's instructions and input. Anything it cannot read only means less to
route on; it never refuses a request. Only the model, which decides who may serve the request at
all, must be a string.

Pure: a parsed body in, a RequestView out; tokenizing it is `prompt_ids`, run on the tokenizer thread.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from protocol.errors import ApiError, bad_value
from protocol.openai_api import chat_messages
from protocol.prompts import chat_prompt_ids
from protocol.token_ids import are_token_ids
from protocol.tokenizer import Tokenizer

# How a route is routed: by the prompt's prefix, or by load alone.
Route = Literal["chat", "completions", "responses", "embeddings", "score", "tokenize", "detokenize", "other"]
PREFIX_ROUTES: frozenset[Route] = frozenset({"chat", "completions", "responses"})
# Roles a Responses input message may have (its system prompt may also come as `instructions`).
_RESPONSE_ROLES = frozenset({"system", "developer", "user", "assistant"})


@dataclass(frozen=True, slots=True)
class RequestView:
    route: Route
    # The model named in the body (None: absent, or a body that is not JSON).
    model: str | None = None
    stream: bool = False
    # The OpenAI `user` field, a session key for affinity routing.
    user: str | None = None
    # The prompt, in whichever form the request gave it.
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    text: str | None = None
    token_ids: list[int] | None = None
    # A Responses request continuing an earlier response: only the replica that produced it holds it.
    previous_response_id: str | None = None

    @property
    def has_prompt(self) -> bool:
        return self.messages is not None or self.text is not None or self.token_ids is not None


def model_name(body: dict[str, Any]) -> str | None:
    name = body.get("model")
    if name is not None and not isinstance(name, str):
        raise bad_value("model", "model must be a string")
    return name


def read_request(route: Route, body: dict[str, Any] | None) -> RequestView:
    """What routing uses of a parsed JSON body (None: the body is not JSON, e.g. a file upload)."""
    if body is None:
        return RequestView(route)
    user = body.get("user")
    common: dict[str, Any] = {
        "model": model_name(body),
        "stream": body.get("stream") is True,
        "user": user if isinstance(user, str) else None,
    }
    attached = body.get("prefixgate_token_ids")
    if attached is not None and route in ("chat", "completions"):
        # A client that tokenized for the workers itself: its ids are the prompt (and, when they are
        # not ids, its request is the worker's to refuse).
        ids = _ids(attached) if isinstance(attached, list) else None
        return RequestView(route, token_ids=ids, **common)
    if route == "chat":
        return RequestView(
            route, messages=_chat(body.get("messages")), tools=_list(body.get("tools")), **common
        )
    if route == "completions":
        text, ids = _completion_prompt(body.get("prompt"))
        return RequestView(route, text=text, token_ids=ids, **common)
    if route == "responses":
        previous = body.get("previous_response_id")
        return RequestView(
            route,
            messages=_responses_messages(body.get("instructions"), body.get("input")),
            tools=_list(body.get("tools")),
            previous_response_id=previous if isinstance(previous, str) and previous else None,
            **common,
        )
    return RequestView(route, **common)


def prompt_ids(view: RequestView, tokenizer: Tokenizer) -> list[int] | None:
    """The prompt's ids for routing (None: nothing to route on). Runs on a tokenizer thread, or on the
    event loop when little is left to encode (gateway.forward.tokenizers)."""
    if view.token_ids is not None:
        return view.token_ids
    if view.text is not None:
        return tokenizer.encode(view.text)
    if view.messages is not None:
        return chat_prompt_ids(tokenizer, view.messages, view.tools)
    return None


def _list(value: Any) -> list[Any] | None:
    return value if isinstance(value, list) and value else None


def _chat(value: Any) -> list[Any] | None:
    """The messages as a bundled worker reads them when they are valid (the same prompt on both
    sides), else as sent: the template, or its canonical fallback, still makes a prefix of them."""
    try:
        return list(chat_messages(value))
    except ApiError:
        return _list(value)


def _completion_prompt(prompt: Any) -> tuple[str | None, list[int] | None]:
    """A string, a list of token ids, or a batch of either (routed on its first prompt)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return (prompt or None), None
    if isinstance(prompt, list) and prompt:
        return None, _ids(prompt)
    return None, None


def _ids(value: list[Any]) -> list[int] | None:
    """The list as token ids when it is one (hashing packs them as uint32), else None."""
    return value if are_token_ids(value) else None


def _responses_messages(instructions: Any, given: Any) -> list[Any] | None:
    """A Responses request as a conversation: `instructions` as the system message, then `input` (a
    string, or a list of items). Message items whose content is text become template messages; the
    other items (function calls, their outputs, reasoning) stay as sent, for the canonical form."""
    messages: list[Any] = []
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        messages += [_response_item(item) for item in given]
    return messages or None


def _response_item(item: Any) -> Any:
    if not (isinstance(item, dict) and item.get("type", "message") == "message"):
        return item
    role, content = item.get("role"), item.get("content")
    if not isinstance(role, str) or role not in _RESPONSE_ROLES:
        return item
    if isinstance(content, list) and all(
        isinstance(p, dict) and isinstance(p.get("text"), str) for p in content
    ):
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        return item
    return {"role": "system" if role == "developer" else role, "content": content}
