"""A prompt routed on its text (gateway.forward.text_ids, `tokenizer: text`): a conversation's next
turn begins with all of the last one's ids but the one that closes it, whatever the messages hold;
the ids are the text's bytes, bounded by the routed limit; and such a model loads nothing, is routed
on the event loop, and never hands its ids to a worker as tokens."""

from __future__ import annotations

import asyncio
import string
from collections.abc import Callable
from typing import Any

import httpx
import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.forward.request_view import RequestView, read_request
from gateway.forward.text_ids import BYTES_PER_ID, text_ids
from gateway.forward.tokenizers import Tokenizers
from gateway.gateway_config import Limits
from protocol.openai_api import MAX_JSON_DEPTH, parse_json
from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker

TEXTS = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60)
MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": TEXTS},
        optional={"name": st.text(string.ascii_letters, min_size=1, max_size=5)},
    ),
    min_size=2,
    max_size=8,
)
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> RequestView:
    return read_request("chat", {"model": "m", "messages": messages, "tools": tools})


@settings(max_examples=200, deadline=None)
@given(MESSAGES, st.booleans())
def test_a_turn_begins_with_the_last_turns_ids_but_its_closing_one(
    messages: list[dict[str, Any]], tools: bool
) -> None:
    for k in range(1, len(messages)):
        before = text_ids(chat(messages[:k], TOOLS if tools else None), 10**6)
        after = text_ids(chat(messages[: k + 1], TOOLS if tools else None), 10**6)
        assert before is not None and after is not None
        assert after[: len(before) - 1] == before[:-1]


def test_the_ids_are_the_texts_bytes_four_to_one_within_the_limit() -> None:
    view = RequestView("completions", text="héllo wörld, " * 40)
    data = view.text.encode() if view.text else b""
    ids = text_ids(view, 10**6)
    assert ids is not None and len(ids) == len(data) // BYTES_PER_ID
    assert ids.tobytes() == data[: len(ids) * BYTES_PER_ID]  # this machine is little-endian
    head = text_ids(view, 16)
    assert head is not None and list(head) == list(ids[:16])


def test_a_messages_key_order_does_not_change_its_ids_and_the_tools_come_first() -> None:
    one = [{"role": "user", "content": "hi", "name": "a"}]
    other = [{"name": "a", "content": "hi", "role": "user"}]
    assert text_ids(chat(one), 100) == text_ids(chat(other), 100)
    with_tools = text_ids(chat(one, TOOLS), 100)
    assert with_tools is not None and with_tools.tobytes().startswith(b'[{"tools":[')


def test_the_deepest_and_largest_body_the_gateway_accepts_still_encodes() -> None:
    """A client's tools nested as deep as parse_json lets through, and numbers at its bounds: the list
    the ids are dumped from nests two levels deeper than the body, and orjson still encodes it."""
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(MAX_JSON_DEPTH - 3):  # the deepest parse_json accepts in a tool
        inner["a"] = inner = {}
    numbers = [18446744073709551615, -9223372036854775808, 10**30, 1.7e308]
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [%s, %s]}' % (
        orjson.dumps(deep),
        b"[" + b",".join(str(n).encode() for n in numbers) + b"]",
    )
    ids = text_ids(read_request("chat", parse_json(raw)), 10**6)
    assert ids is not None and ids.tobytes().startswith(b'[{"tools":[{"a":{"a":')


def test_a_text_model_loads_nothing_and_its_ids_are_never_a_workers_tokens() -> None:
    tokenizers = Tokenizers({"m": "text"}, cache_bytes=2**20)
    try:
        asyncio.run(tokenizers.load(["m"]))
        assert tokenizers.status() == {"m": "text"}
        view = chat([{"role": "user", "content": "What is the capital of France? " * 10}])
        prompt = asyncio.run(tokenizers.prompt(view, "m", Limits()))
        assert prompt is not None and list(prompt.ids) == list(text_ids(view, 10**6) or [])
        assert not prompt.tokenized and not prompt.whole and prompt.token_ids is None
        given_ids = asyncio.run(
            tokenizers.prompt(RequestView("completions", token_ids=[5, 6, 7]), "m", Limits())
        )
        assert given_ids is not None and given_ids.token_ids == [5, 6, 7], "a client's ids are its tokens"
    finally:
        tokenizers.close()


def test_a_bundled_worker_of_a_text_routed_model_is_predicted_not_followed(
    start_sim_worker: Callable[..., SimWorker],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    worker = start_sim_worker("w0", "--sim-tokenizer", "words")
    gateway = start_gateway([worker.url], models={SIM_MODEL: {"tokenizer": "text"}})
    (replica,) = gateway.state.replicas.all()
    assert replica.kind == "bundled" and not replica.precise
    assert not gateway.gw.sync.states, "its KV events name token blocks: not followed"
    history = "the quick brown fox jumps over the lazy dog " * 30
    predicted = []
    for turn in ("and then?", "and after that?"):
        body = {"model": SIM_MODEL, "prompt": history + turn, "max_tokens": 1}
        answer = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        predicted.append(int(answer.headers["x-prefixgate-predicted-cached-tokens"]))
    assert predicted[0] == 0 and predicted[1] >= len(history) // BYTES_PER_ID - 16, predicted
