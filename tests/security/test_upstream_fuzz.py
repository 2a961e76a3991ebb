"""Replicas that frame their answers at random, against a real gateway (issue 20, item 7): hypothesis
draws each answer's framing (a length, chunked, or the connection's close), its SSE line endings,
where it is split into writes, informational answers before it, garbage inside it, an early close,
and bytes after its end. Several clients ask at once, each with a marker of its own.

Whatever the replicas send: no 5xx but a clean 502 or 504, no client ever sees another's marker or
bytes a replica sent after an answer, a well-framed answer arrives whole, and the gateway answers
the next client after it all. PREFIXGATE_FUZZ_SCALE=10 runs ten times the examples,
PREFIXGATE_FUZZ_RANDOM=1 draws new ones each run (as in tests/gateway/test_fuzz.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.gateways import RunningGateway
from tests.support.raw_replicas import (
    OK_JSON,
    OK_SSE,
    Answer,
    Posted,
    RawReplica,
    completion,
    events,
    gateway_for,
    reply,
    said,
)

pytestmark = pytest.mark.fuzz

SCALE = float(os.environ.get("PREFIXGATE_FUZZ_SCALE", "1"))
EXAMPLES = max(1, int(40 * SCALE))
CLIENTS = 4
# The replica's silence the gateway waits out: garbage can leave its parser waiting for more.
SILENCE_S = 2.0
POISON = "POISON"


@dataclass(frozen=True)
class Plan:
    """How the replica frames one answer."""

    stream: bool
    framing: str
    line_end: bytes
    informational: tuple[int, ...]
    # Where the answer is cut into writes, as fractions of its length.
    splits: tuple[float, ...]
    garbage: bytes | None
    garbage_at: float
    # The fraction of the answer sent before the replica closes, if it does.
    early_close: float | None
    # What follows the answer's end in the same write: a whole second answer, the start of one, junk.
    trailing: str | None

    @property
    def well_framed(self) -> bool:
        return self.garbage is None and self.early_close is None


PLANS = st.builds(
    Plan,
    stream=st.booleans(),
    framing=st.sampled_from(["length", "chunked", "close"]),
    line_end=st.sampled_from([b"\n", b"\r\n", b"\r"]),
    informational=st.lists(st.sampled_from([100, 102, 103]), max_size=3).map(tuple),
    splits=st.lists(st.floats(0, 1), max_size=5).map(lambda cuts: tuple(sorted(cuts))),
    garbage=st.one_of(st.none(), st.binary(min_size=1, max_size=12)),
    garbage_at=st.floats(0, 1),
    early_close=st.one_of(st.none(), st.floats(0, 0.99)),
    trailing=st.one_of(st.none(), st.sampled_from(["whole", "partial", "junk"])),
)


def body_of(plan: Plan, posted: Posted, text: str) -> list[bytes]:
    if plan.stream:
        return events(posted, text, plan.line_end)
    return [completion(text)]


def framed_answer(plan: Plan, posted: Posted, text: str) -> bytes:
    """The answer saying `text`, framed as `plan` says, informational answers first."""
    pieces = body_of(plan, posted, text)
    head = OK_SSE if plan.stream else OK_JSON
    if plan.framing == "length":
        body = b"".join(pieces)
        answer = head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    elif plan.framing == "chunked":
        chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces)
        answer = head + b"Transfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n"
    else:
        answer = head + b"\r\n" + b"".join(pieces)
    hints = b"".join(b"HTTP/1.1 %d Info\r\nLink: </x>\r\n\r\n" % status for status in plan.informational)
    return hints + answer


def writes_of(plan: Plan, posted: Posted) -> list[bytes]:
    """What the replica writes, piece by piece, for one request."""
    data = framed_answer(plan, posted, reply(posted.marker))
    if plan.garbage is not None:
        at = int(plan.garbage_at * len(data))
        data = data[:at] + plan.garbage + data[at:]
    if plan.early_close is not None:
        data = data[: int(plan.early_close * len(data))]
    elif plan.trailing is not None and plan.framing != "close":  # a close-framed body takes all
        poison = framed_answer(plan, posted, POISON)
        data += {"whole": poison, "partial": poison[:30], "junk": b"\x00junk\r\n"}[plan.trailing]
    cuts = [0, *(int(f * len(data)) for f in plan.splits), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(cuts) if b > a]


def answering(plans: dict[str, Plan]) -> Answer:
    async def answer(posted: Posted) -> None:
        plan = plans[posted.marker]
        for piece in writes_of(plan, posted):
            posted.send(piece)
            await posted.writer.drain()
            await asyncio.sleep(0.001)
        if plan.framing == "close" or plan.early_close is not None:
            posted.writer.close()

    return answer


def ask(gateway: RunningGateway, marker: str, stream: bool) -> tuple[int, bytes]:
    body = {"model": "foreign-m", "messages": [{"role": "user", "content": marker}], "stream": stream}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as response:
        return response.status_code, response.read()


def test_random_framings_from_replicas_never_cross_clients_or_break_the_gateway(
    start_gateway: Callable[..., RunningGateway],
) -> None:
    plans: dict[str, Plan] = {}
    replicas = [RawReplica(answering(plans)) for _ in range(2)]
    urls = [replica.start() for replica in replicas]
    statuses: list[int] = []
    try:
        gateway = gateway_for(start_gateway, urls, request_timeout_s=SILENCE_S, max_attempts=2)
        pool = ThreadPoolExecutor(CLIENTS)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=os.environ.get("PREFIXGATE_FUZZ_RANDOM") != "1",
            suppress_health_check=list(HealthCheck),
        )
        @given(st.lists(PLANS, min_size=CLIENTS, max_size=CLIENTS))
        def example(drawn: list[Plan]) -> None:
            markers = [f"client-{uuid.uuid4().hex}" for _ in drawn]
            plans.update(zip(markers, drawn, strict=True))
            answers = list(pool.map(ask, [gateway] * CLIENTS, markers, [p.stream for p in drawn]))
            for marker, plan, (status, raw) in zip(markers, drawn, answers, strict=True):
                statuses.append(status)
                where = f"{plan}: {status} {raw[:400]!r}"
                assert status in (200, 502, 504), where
                if status != 200:
                    error = json.loads(raw)["error"]
                    assert error["message"] and error["type"], where
                others = [m for m in markers if m != marker]
                assert not any(m.encode() in raw for m in others), f"cross-talk: {where}"
                assert POISON.encode() not in raw, f"bytes after an answer reached a client: {where}"
                if plan.well_framed:
                    assert status == 200 and said(raw, plan.stream) == reply(marker), where

        example()
        pool.shutdown()
        # Healthy after it all: the next client gets its own answer, and /metrics reads.
        marker = "after-the-fuzz"
        plans[marker] = Plan(False, "length", b"\n", (), (), None, 0.0, None, None)
        status, raw = ask(gateway, marker, stream=False)
        assert status == 200 and said(raw, False) == reply(marker), raw
        assert httpx.get(f"{gateway.url}/metrics", timeout=10).status_code == 200
        assert statuses.count(200) > len(statuses) // 2  # the draws were not all failures
    finally:
        for replica in replicas:
            replica.stop()
