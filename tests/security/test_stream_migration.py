"""A replica killed mid-answer (issue 20 item 9): the stream goes on from another replica, and the
client, through the official openai client, sees one unbroken answer — one id, one role preamble, one
finish_reason, usage as if one replica had answered — counted in /metrics as one migration. Real
SmolLM2 workers give the greedy text of an unbroken run; simulated ones show the structure at speed;
foreign backends continue where their model's `foreign_continuation` allows, and end with a clean
error event where it does not."""

from __future__ import annotations

import dataclasses
import json
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from bench.chaos_fleet import WORKER, sim_profile
from bench.chaos_streams import streams_replica_killed
from bench.local_fleet import Child, Fleet, cli, spawn, start_worker, wait_healthy
from gateway.forward.migration import MAX_EVENT_BYTES, Sent, StreamTap, continuation_body
from protocol.loopback_ports import free_port
from tests.support.gateways import SIM_MODEL, RunningGateway
from tests.support.servers import ServerThread

SMOLLM2 = "SmolLM2-135M-Instruct"
# Slow simulated steps: a 48-token answer streams for about 2.5 s, long enough to be cut.
STEP_S = 0.05


def migrations(gateway_url: str, outcome: str) -> float:
    """prefixgate_gateway_stream_migrations_total for one outcome (0 when never counted)."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("prefixgate_gateway_stream_migrations_total{") and f'outcome="{outcome}"' in line:
            total += float(line.split()[-1])
    return total


@dataclass
class Streamed:
    """What the client read of one stream."""

    replica: str
    chunks: list[Any] = field(default_factory=list)

    def texts(self) -> list[str]:
        out = []
        for chunk in self.chunks:
            for choice in chunk.choices:
                delta = getattr(choice, "delta", None)
                out.append((delta.content if delta is not None else choice.text) or "")
        return out

    @property
    def text(self) -> str:
        return "".join(self.texts())

    def finishes(self) -> list[str]:
        return [c.finish_reason for chunk in self.chunks for c in chunk.choices if c.finish_reason]

    def roles(self) -> list[str]:
        return [
            c.delta.role
            for chunk in self.chunks
            for c in chunk.choices
            if getattr(c, "delta", None) and c.delta.role
        ]

    @property
    def usage(self) -> Any:
        return next(chunk.usage for chunk in self.chunks if chunk.usage is not None)


def stream(
    client: openai.OpenAI,
    chat: bool,
    kill: Callable[[str], None] | None = None,
    after: int = 8,
    **request: Any,
) -> Streamed:
    """One streaming request through the official client; `kill(replica)` once `after` chunks have come."""
    create = client.chat.completions if chat else client.completions
    raw = create.with_raw_response.create(stream=True, stream_options={"include_usage": True}, **request)
    got = Streamed(raw.headers["x-prefixgate-replica"])
    for chunk in raw.parse():
        got.chunks.append(chunk)
        if kill is not None and len(got.chunks) == after:
            kill(got.replica)
    return got


def killer(workers: dict[str, Child]) -> Callable[[str], None]:
    def kill(replica: str) -> None:
        proc = workers[replica].proc
        proc.send_signal(signal.SIGKILL)
        proc.wait()

    return kill


def assert_one_stream(got: Streamed, chat: bool, completion_tokens: int, prompt_tokens: int) -> None:
    assert len({chunk.id for chunk in got.chunks}) == 1
    assert len({chunk.created for chunk in got.chunks}) == 1
    assert got.finishes() == ["length"]
    if chat:
        assert got.roles() == ["assistant"]
    usage = got.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, completion_tokens)
    assert usage.total_tokens == prompt_tokens + completion_tokens


# -- simulated workers: the structure ----------------------------------------------------------------


@pytest.fixture
def sim_workers(fleet: Fleet) -> dict[str, Child]:
    slow = dataclasses.replace(WORKER, profile=sim_profile(fleet.workdir, "slow", step_s=STEP_S))
    workers = {rid: fleet.add(start_worker(fleet.workdir, slow, rid)) for rid in ("s0", "s1", "s2")}
    wait_healthy(list(workers.values()))
    return workers


def test_a_sim_stream_whose_worker_is_killed_goes_on_from_another_as_one_stream(
    sim_workers: dict[str, Child], start_gateway: Callable[..., RunningGateway]
) -> None:
    gateway = start_gateway([w.url for w in sim_workers.values()], routing={"policy": "least_load"})
    client = gateway.client()
    kill = killer(sim_workers)
    prompt = list(range(1000, 1100))
    got = stream(
        client, False, kill, model=SIM_MODEL, prompt=prompt, max_tokens=48, extra_body={"ignore_eos": True}
    )
    # The simulated engine writes a word per token: 48 of them, from two workers.
    assert len(got.text.split()) == 48
    assert_one_stream(got, chat=False, completion_tokens=48, prompt_tokens=100)
    assert migrations(gateway.url, "continued") == 1
    chat = stream(
        client, True, kill,
        model=SIM_MODEL, messages=[{"role": "user", "content": "Tell me a long story."}], max_tokens=48,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.replica != got.replica
    assert len(chat.text.split()) == 48
    assert_one_stream(chat, chat=True, completion_tokens=48, prompt_tokens=chat.usage.prompt_tokens)
    assert chat.usage.prompt_tokens < 100  # the chat prompt, not the prompt plus the tokens carried over
    assert migrations(gateway.url, "continued") == 2
    # The one worker left serves the next client whole; /metrics still answers.
    after = stream(
        client, False, model=SIM_MODEL, prompt=prompt, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert len(after.text.split()) == 8 and after.finishes() == ["length"]
    assert migrations(gateway.url, "failed") == 0


def test_a_stream_with_nowhere_to_go_ends_with_a_clean_error_event(
    fleet: Fleet, start_gateway: Callable[..., RunningGateway]
) -> None:
    slow = dataclasses.replace(WORKER, profile=sim_profile(fleet.workdir, "slow", step_s=STEP_S))
    only = fleet.add(start_worker(fleet.workdir, slow, "alone"))
    wait_healthy([only])
    gateway = start_gateway([only.url])
    body = {
        "model": SIM_MODEL,
        "prompt": list(range(1000, 1100)),
        "max_tokens": 48,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        next(lines)
        only.proc.kill()
        tail = [line for line in lines if line]
    assert tail[-1] == "data: [DONE]" and "upstream_failed" in tail[-2]
    assert not any("prefixgate-token-ids" in line for line in tail)
    assert migrations(gateway.url, "failed") == 1


def test_the_workers_token_ids_never_reach_the_client(
    sim_workers: dict[str, Child], start_gateway: Callable[..., RunningGateway]
) -> None:
    gateway = start_gateway([sim_workers["s0"].url])
    body = {"model": SIM_MODEL, "prompt": list(range(1000, 1040)), "max_tokens": 6, "stream": True}
    raw = httpx.post(
        f"{gateway.url}/v1/completions", json=body, headers={"x-prefixgate-stream-token-ids": "1"}
    ).text
    assert raw.count("data: ") == 7 and "prefixgate-token-ids" not in raw
    direct = httpx.post(
        f"{sim_workers['s0'].url}/v1/completions", json=body, headers={"x-prefixgate-stream-token-ids": "1"}
    ).text
    assert direct.count(":prefixgate-token-ids ") == 6


# -- real SmolLM2 workers: the greedy text of an unbroken run ------------------------------------------


@pytest.fixture
def smollm2_workers(fleet: Fleet) -> dict[str, Child]:
    workers = {}
    fleet.workdir.mkdir(parents=True, exist_ok=True)
    for rid in ("m0", "m1"):
        port = free_port()
        command = cli(
            "worker", "--id", rid, "--port", str(port), "--num-blocks", "256", "--threads", "1",
            "--log-level", "WARNING",
        )  # fmt: skip
        workers[rid] = fleet.add(spawn(f"worker-{rid}", command, f"http://127.0.0.1:{port}", fleet.workdir))
    wait_healthy(list(workers.values()))
    return workers


def test_a_real_models_stream_continued_elsewhere_is_the_greedy_text_of_an_unbroken_run(
    smollm2_workers: dict[str, Child], start_gateway: Callable[..., RunningGateway]
) -> None:
    gateway = start_gateway(
        [w.url for w in smollm2_workers.values()], models={SMOLLM2: {"tokenizer": "default"}}
    )
    client = gateway.client()
    messages = [{"role": "user", "content": "Describe how a river reaches the sea, step by step."}]
    request: dict[str, Any] = {"model": SMOLLM2, "messages": messages, "max_tokens": 32, "temperature": 0}
    unbroken = stream(client, True, **request)
    continued = stream(client, True, killer(smollm2_workers), after=8, **request)
    assert migrations(gateway.url, "continued") == 1
    assert continued.text == unbroken.text and len(continued.texts()) > 8
    assert continued.finishes() == unbroken.finishes()
    assert continued.usage.prompt_tokens == unbroken.usage.prompt_tokens
    assert continued.usage.completion_tokens == unbroken.usage.completion_tokens
    assert len({chunk.id for chunk in continued.chunks}) == 1 and continued.roles() == ["assistant"]


# -- foreign backends ------------------------------------------------------------------------------

FOREIGN = "vllm-like"
ANSWER = [f" w{i}" for i in range(30)]


@dataclass
class FakeVllm:
    """A vLLM-like server whose answer is ANSWER, continued from the words a request already holds
    (a completion's prompt, or a chat's final assistant message with continue_final_message); the
    first answer of all, whichever backend gives it, breaks off after `die_after` events."""

    deaths: list[int]
    die_after: int = 6
    received: list[dict[str, Any]] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/v1/completions", self._answer)
        app.router.add_post("/v1/chat/completions", self._answer)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": FOREIGN, "object": "model"}]})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.received.append(body)
        chat = "messages" in body
        held = (
            body["messages"][-1]["content"]
            if chat and body.get("continue_final_message")
            else body.get("prompt", "")
        )
        done = max(k for k in range(len(ANSWER) + 1) if held.endswith("".join(ANSWER[:k])))
        words = ANSWER[done : done + body.get("max_tokens", 16)]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        name = f"{'chatcmpl' if chat else 'cmpl'}-{len(self.received)}-{id(self)}"
        dies = bool(self.deaths)
        if dies:
            self.deaths.pop()

        def event(payload: dict[str, Any]) -> bytes:
            return (
                b"data: "
                + json.dumps({"id": name, "created": len(self.received), **payload}).encode()
                + b"\n\n"
            )

        if chat:
            await response.write(
                event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            )
        for n, word in enumerate(words):
            if dies and n == self.die_after:
                request.transport.abort()
                return response
            last = n == len(words) - 1
            choice = {"index": 0, "finish_reason": "length" if last else None}
            choice |= {"delta": {"content": word}} if chat else {"text": word}
            await response.write(event({"choices": [choice]}))
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {
                "prompt_tokens": 10 + done,
                "completion_tokens": len(words),
                "total_tokens": 10 + done + len(words),
            }
            await response.write(event({"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        return response


@pytest.fixture
def fake_vllms() -> Iterator[tuple[list[FakeVllm], list[str]]]:
    deaths = [1]
    backends = [FakeVllm(deaths), FakeVllm(deaths)]
    servers = [ServerThread(b.app()) for b in backends]
    urls = [s.start() for s in servers]
    yield backends, urls
    for server in servers:
        server.stop()


@pytest.mark.parametrize("chat", [False, True])
def test_a_vllm_stream_is_continued_from_the_text_so_far(
    fake_vllms: tuple[list[FakeVllm], list[str]], start_gateway: Callable[..., RunningGateway], chat: bool
) -> None:
    backends, urls = fake_vllms
    gateway = start_gateway(
        urls,
        replicas=[{"url": u, "kind": "openai"} for u in urls],
        models={FOREIGN: {"tokenizer": "none", "foreign_continuation": "vllm"}},
    )
    request: dict[str, Any] = {"model": FOREIGN, "max_tokens": 20}
    request |= {"messages": [{"role": "user", "content": "count"}]} if chat else {"prompt": "count:"}
    got = stream(gateway.client(), chat, **request)
    assert got.text == "".join(ANSWER[:20])
    assert_one_stream(got, chat=chat, completion_tokens=20, prompt_tokens=10)
    assert migrations(gateway.url, "continued") == 1
    bodies = [b for backend in backends for b in backend.received]
    assert len(bodies) == 2
    continuation = next(b for b in bodies if b["max_tokens"] != 20)
    assert continuation["max_tokens"] == 14
    if chat:
        assert continuation["messages"][-1] == {"role": "assistant", "content": "".join(ANSWER[:6])}
        assert (
            continuation["continue_final_message"] is True and continuation["add_generation_prompt"] is False
        )
    else:
        assert continuation["prompt"] == "count:" + "".join(ANSWER[:6])


def test_a_foreign_stream_is_not_continued_unless_its_model_allows(
    fake_vllms: tuple[list[FakeVllm], list[str]], start_gateway: Callable[..., RunningGateway]
) -> None:
    backends, urls = fake_vllms
    gateway = start_gateway(
        urls, replicas=[{"url": u, "kind": "openai"} for u in urls], models={FOREIGN: {"tokenizer": "none"}}
    )
    body = {
        "model": FOREIGN,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 20,
        "stream": True,
    }
    lines = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30).text.splitlines()
    events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and "upstream_failed" in events[-2]
    assert sum(len(b.received) for b in backends) == 1  # nothing was sent to continue it
    assert migrations(gateway.url, "unsupported") == 1


# -- the replica-kill replay ---------------------------------------------------------------------


@pytest.mark.fleet
def test_a_streaming_replay_with_a_worker_killed_and_restarted_truncates_no_stream(tmp_path: Path) -> None:
    result = streams_replica_killed(tmp_path, requests=30, kill_at_s=1.5, restart_at_s=3.0)
    assert result.passed, result.details
    for variant in ("bundled", "foreign"):
        assert result.details[variant]["truncated"] == result.details[variant]["failed"] == 0
        assert result.details[variant]["migrations"] >= 1  # the kill did cut streams mid-answer
    assert result.requests == result.succeeded == 60


def test_the_tap_reads_any_sse_line_ends_and_passes_an_unbounded_event_through_unread() -> None:
    sent = Sent(chat=False)
    tap = StreamTap(sent, read_text=True)
    events = b'data: {"id":"cmpl-1","created":7,"choices":[{"index":0,"text":" a"}]}\r\n\r\n'
    events += b'data: {"id":"cmpl-1","created":7,"choices":[{"index":0,"text":" b"}]}\r\r'
    # Split anywhere, a replica's framing comes back as it came.
    assert b"".join(tap.feed(events[i : i + 7]) for i in range(0, len(events), 7)) + tap.flush() == events
    assert "".join(sent.text) == " a b" and sent.id == "cmpl-1" and not sent.opaque
    body = continuation_body(
        {"prompt": "x", "max_tokens": 5}, sent, "completions", prompt_ids=None, ask_usage=False
    )
    assert body == {"prompt": "x a b", "max_tokens": 3}
    huge = b"data: " + b"x" * (MAX_EVENT_BYTES + 1)
    assert tap.feed(huge) == huge and sent.opaque
    assert continuation_body({"prompt": "x"}, sent, "completions", prompt_ids=None, ask_usage=False) is None
