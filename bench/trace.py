"""Mooncake-format request traces (shared/traces): one JSON object a line."""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import numpy as np

from bench.workloads import Session, Turn

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    # One id per 512-token block of the prompt; an id names its block and every block before it.
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> tuple[int, ...]:
        """The cacheable blocks: a partial trailing block is never cached (docs/design.md §3)."""
        return self.hash_ids[: self.input_length // MOONCAKE_BLOCK_TOKENS]


_POSITIONS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)


@functools.lru_cache(maxsize=65_536)
def trace_block_tokens(hash_id: int, vocab_size: int) -> np.ndarray:
    """The 512 tokens a Mooncake hash id stands for: fixed per id, so shared ids share tokens.

    A splitmix64-style mix of (id, position), one vectorised pass: seeding a generator per id cost
    more than the rest of a fleet simulation's request handling."""
    x = _POSITIONS + np.uint64((hash_id * 0x9E3779B97F4A7C15) % 2**64)
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return (x % np.uint64(vocab_size)).astype(np.int64)


def prompt_tokens(request: TraceRequest, vocab_size: int) -> list[int]:
    blocks = [trace_block_tokens(h, vocab_size) for h in request.hash_ids]
    return np.concatenate(blocks)[: request.input_length].tolist()


class TracePrompt(Sequence[int]):
    """A trace request's prompt tokens, expanded only when read: a whole trace's prompts expanded at
    once would take gigabytes (the conversation trace averages 12k tokens over 12k requests)."""

    __slots__ = ("request", "vocab_size")

    def __init__(self, request: TraceRequest, vocab_size: int) -> None:
        self.request = request
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return self.request.input_length

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        return prompt_tokens(self.request, self.vocab_size)[index]

    def __iter__(self) -> Iterator[int]:
        return iter(prompt_tokens(self.request, self.vocab_size))


def trace_sessions(trace: Sequence[TraceRequest], vocab_size: int) -> list[Session]:
    """Each request a session of one turn at its own time (a trace is open loop). Its session key is
    its second block's id: a conversation's turns share it, requests that share only the first
    block (a system prompt) do not."""
    return [
        Session(
            r.arrival_s,
            (Turn(TracePrompt(r, vocab_size), max(r.output_length, 1)),),
            key=str(r.hash_ids[1] if len(r.hash_ids) > 1 else r.hash_ids[0]),
        )
        for r in trace
    ]


def load_trace(path: str | Path, speed: float = 1.0, limit: int | None = None) -> list[TraceRequest]:
    """Requests in arrival order, with arrival times divided by `speed` (2 replays twice as fast)."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                requests.append(
                    TraceRequest(
                        arrival_s=row["timestamp"] / 1000.0 / speed,
                        input_length=int(row["input_length"]),
                        output_length=int(row["output_length"]),
                        hash_ids=tuple(int(h) for h in row["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({error})") from None
    requests.sort(key=lambda r: r.arrival_s)
    return requests


def write_conversation_trace(
    path: str | Path, conversations: int = 60, turns: int = 5, seed: int = 0
) -> Path:
    """A generated Mooncake-format trace: multi-turn chats over one shared system block, starting at
    random times within a minute, each turn extending its chat's previous prompt by 1-4 blocks after
    a few seconds of thought. Small, with a known structure, for tests and quick comparisons."""
    rng = random.Random(seed)
    rows = []
    next_id = 1
    for _ in range(conversations):
        t = rng.uniform(0, 60_000)
        history = [0]
        for _turn in range(turns):
            history = history + list(range(next_id, next_id + rng.randint(1, 4)))
            next_id += 4
            rows.append(
                {
                    "timestamp": int(t),
                    "input_length": len(history) * 512 - 100,
                    "output_length": 50,
                    "hash_ids": history,
                }
            )
            t += rng.uniform(2_000, 10_000)
    rows.sort(key=lambda r: r["timestamp"])
    path = Path(path)
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path
