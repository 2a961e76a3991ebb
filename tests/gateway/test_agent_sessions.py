"""Multi-turn tool-calling sessions in front of foreign backends (approximate mode): each turn's prompt,
tool calls and tool results included, extends the last one, so the gateway sees the session's prefix
and predicts that the replica which served the last turn holds all of it; alike whether it tokenizes
the prompt or routes on its text (`tokenizer: text`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.support.gateways import RecordingBackend, RunningGateway

MODEL = "foreign-m"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search_orders",
            "description": "Find a customer's orders",
            "parameters": {"type": "object", "properties": {"customer": {"type": "string"}}},
        },
    }
]


def _turn(messages: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The history after turn k: the agent called a tool, got its result, and the user asked again."""
    call = {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": "search_orders", "arguments": f'{{"customer": "c{k}"}}'},
    }
    return [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": f"call_{k}",
            "content": f"order {k}: " + "two boxes of screws, " * 20,
        },
        {"role": "user", "content": f"And what about order {k + 1}?"},
    ]


@pytest.mark.parametrize("tokenizer", ["default", "text"])
def test_each_turn_is_predicted_to_hit_the_last_turns_prompt(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
    tokenizer: str,
) -> None:
    backends = [recording_backend(f"b{i}") for i in range(3)]
    gateway = start_gateway([url for _, url in backends], models={MODEL: {"tokenizer": tokenizer}})
    assert {r.kind for r in gateway.state.replicas.all()} == {"openai"}, "approximate mode: no KV events"
    assert gateway.state.tokenizers.status()[MODEL] == ("loaded" if tokenizer == "default" else "text")
    messages = [
        {"role": "system", "content": "You are the order desk of a hardware store. " * 10},
        {"role": "user", "content": "What did customer c0 order?"},
    ]
    last_prompt, last_replica = 0, None
    for k in range(5):
        body = {"model": MODEL, "messages": messages, "tools": TOOLS}
        explained = httpx.post(f"{gateway.url}/debug/route", json=body).json()
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
        assert answer.status_code == 200
        predicted = int(answer.headers["x-prefixgate-predicted-cached-tokens"])
        replica = answer.headers["x-prefixgate-replica"]
        if k:
            assert replica == last_replica, "the session stays where its prefix is"
            # All of the last prompt but its end (its generation prompt; its closing bracket in text).
            assert predicted >= 16 * ((last_prompt - 1) // 16), f"turn {k}: the last turn's prompt must match"
        last_prompt, last_replica = explained["prompt_tokens"], replica
        messages = _turn(messages, k)
