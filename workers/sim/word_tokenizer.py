"""A tokenizer whose tokens are words: a simulated worker that counts prompts in another unit than
the gateway in front of it.

A gateway before foreign backends (vLLM, SGLang, a hosted API) tokenizes with its own tokenizer,
while each backend caches and reports usage in its own. With this tokenizer a simulated worker is
such a backend: its prompt_tokens, cached_tokens and KV blocks count whitespace-separated words,
where the gateway, reading the same text with SmolLM2's tokenizer, counts about 2.8 tokens for each
of bench.token_text' made-up words. Each word's id is a stable hash of it (xxh3, not Python's per-process
salted `hash`), so every worker and every run gives a text the same ids and a repeated prefix of
words hits the worker's cache as a real tokenizer's ids would.

It offers what workers.openai_routes asks of protocol.tokenizer.Tokenizer: `encode` for completions,
`render_chat` for chats (a plain rendering, one line per message: word counts are all it is for),
and `decode`, which cannot invert a hash and names each id instead.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash


@dataclass(frozen=True, slots=True)
class WordTokenizer:
    """Words as tokens, each id a hash of the word into [0, vocab_size)."""

    vocab_size: int

    def __post_init__(self) -> None:
        if self.vocab_size < 1:
            raise ValueError(f"vocab_size must be at least 1, got {self.vocab_size}")

    def encode(self, text: str) -> list[int]:
        return [xxhash.xxh3_64_intdigest(word.encode()) % self.vocab_size for word in text.split()]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Each id's name, as the simulated engine names the tokens it makes up."""
        return " ".join(f"t{token_id}" for token_id in token_ids)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """`role: content` a line per message (content that is not text, and tool calls, as JSON),
        the tools first, and `assistant:` last when an answer is to follow. Prefix-stable: a longer
        conversation's text extends a shorter one's, less its generation prompt."""
        lines = [f"tools: {_json(list(tools))}"] if tools else []
        for message in messages:
            if not isinstance(message, dict):
                lines.append(_json(message))
                continue
            content = message.get("content")
            text = content if isinstance(content, str) else "" if content is None else _json(content)
            calls = message.get("tool_calls")
            lines.append(f"{message.get('role', '')}: {text}" + (f" {_json(calls)}" if calls else ""))
        if add_generation_prompt:
            lines.append("assistant:")
        return "\n".join(lines)


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
