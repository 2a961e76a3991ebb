"""Precise mode over ZMQ: the index follows vLLM-format KV events, re-hashed with docs/design.md §3.

Against a publisher written in the test (a PUB and a ROUTER sending vLLM-format bytes built by
hand), against bundled workers publishing with --kv-events-zmq in-process (with a test-only
publisher that drops messages), and against a fleet of worker processes behind a gateway that
declares them foreign (`kind: openai`) with `kv_events`: the index for each replica is exactly what
re-hashing the stored tokens gives, through gaps, restarts and malformed batches."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from bench.probes import wait_for, wait_for_async
from gateway.sync.state import SyncState
from gateway.sync.zmq_events import ZmqSettings, ZmqSource, ZmqSync
from prefixgate.cli import build_parser
from radix.hashing import block_hashes, chain_hashes, root_hash
from radix.index import RadixIndex
from tests.support.gateways import SIM_MODEL, RunningGateway, foreign_backend
from tests.support.servers import ServerThread, distinct_ports
from workers.app_state import RUNTIME
from workers.worker_app import create_app
from workers.worker_cli import build_worker
from workers.zmq_publisher import ZmqPublisher, ZmqPublisherConfig

MODEL = "test-model"
BS = 16
FAST = {"replay_timeout_s": 0.5, "idle_check_s": 0.3, "retry_max_s": 0.2}


def ours(tokens: list[int], model: str = MODEL) -> list[int]:
    """docs/design.md §3's hashes of a prompt's full blocks: what the index must hold for it."""
    return block_hashes(tokens, BS, model)


def assert_holds_exactly(index: RadixIndex, replica: str, hashes: Iterable[int]) -> None:
    expected = set(hashes)
    held = {h for h in expected if index.holds(replica, h)}
    assert (index.blocks_of(replica), len(held)) == (len(expected), len(expected))


# -- a publisher written in the test ---------------------------------------------------------------


def wire(*events: list[Any] | dict[str, Any]) -> bytes:
    """A batch as vLLM encodes it, positional: its events as arrays (vLLM before PR #42892, SGLang)
    or as tagged maps (vLLM 0.26)."""
    return msgspec.msgpack.encode([time.time(), list(events), 0])


def map_stored(hashes: list[Any], parent: Any, tokens: list[int]) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }


class HandPublisher:
    """vLLM's publisher as a test writes it, on the test's loop: messages `[topic, seq, payload]` on a
    PUB, numbered from 0, each kept for the ROUTER that answers replay requests."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_port: int, replay_port: int) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self._serving = asyncio.create_task(self._serve())

    async def publish(self, payload: bytes, *, send: bool = True, keep: bool = True) -> int:
        """Publish the next batch; `send=False` leaves it off the wire (a subscriber misses it),
        `keep=False` out of the replay buffer too (lost for good)."""
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        if keep:
            self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        return seq

    async def _serve(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    async def close(self) -> None:
        self._serving.cancel()
        await asyncio.gather(self._serving, return_exceptions=True)
        self.pub.close(linger=0)
        self.router.close(linger=0)


@asynccontextmanager
async def followed(
    history: Iterable[bytes] = (), replay: bool = True, **settings: float
) -> AsyncIterator[tuple[HandPublisher, SyncState, RadixIndex, Callable[[], HandPublisher]]]:
    """A test publisher that published `history` already, and a ZmqSync following it into an index as
    replica "r". The last item restarts the publisher on the same ports (a new process: its numbers
    start over)."""
    pub_port, replay_port = distinct_ports(2)
    ctx = zmq.asyncio.Context()
    publishers = [HandPublisher(ctx, pub_port, replay_port)]
    for payload in history:
        await publishers[0].publish(payload)
    index = RadixIndex()
    index.add_replica("r")
    sync = ZmqSync(index, ZmqSettings(**(FAST | settings)))
    source = ZmqSource(f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}" if replay else None)

    def restart() -> HandPublisher:
        publishers.append(HandPublisher(ctx, pub_port, replay_port))
        return publishers[-1]

    try:
        yield publishers[0], sync.start("r", MODEL, BS, source), index, restart
    finally:
        await sync.close()
        for publisher in publishers:
            await publisher.close()
        ctx.destroy(linger=0)


def test_vllm_format_bytes_at_a_gateway_index_re_hashed() -> None:
    """Batches as vLLM 0.9, SGLang and vLLM 0.26 send them, some before the follower connects (it
    replays them), some after: the index holds exactly docs/design.md §3's hashes of the tokens."""
    a = [random.Random(1).randrange(50_000) for _ in range(80)]
    b = [*a[:48], *range(7000, 7032)]

    history = [
        wire(["AllBlocksCleared"]),
        wire(["BlockStored", [11, 12, 13], None, a[:48], BS, None]),
        wire(["BlockStored", [14, 15], 13, a[48:80], BS, None, "GPU"]),
    ]

    async def main() -> None:
        async with followed(history) as (pub, state, index, _):
            await wait_for_async(lambda: state.seq == 2, "the replayed history")
            assert_holds_exactly(index, "r", ours(a))
            await pub.publish(
                wire(
                    map_stored([21, 22], 13, b[48:80]),
                    {"type": "BlockRemoved", "block_hashes": [15], "medium": "GPU"},
                )
            )
            await pub.publish(wire(map_stored([b"\x02" * 32], None, list(range(5, 21)))))
            await wait_for_async(lambda: state.seq == 4, "the live batches")
            assert_holds_exactly(index, "r", {*ours(a)[:4], *ours(b), *ours(list(range(5, 21)))})
            await pub.publish(wire(["BlockRemoved", [11, 12, 13, 14, 21, 22, b"\x02" * 32]]))
            await wait_for_async(lambda: index.blocks_of("r") == 0, "the removals")
            assert (state.resyncs, state.errors, state.last_error, state.lag_s()) == (1, 0, None, 0.0)
            assert state.to_json()["transport"] == "zmq" and state.synced

    asyncio.run(main())


@pytest.mark.parametrize("lost", [False, True], ids=["replayed", "lost"])
def test_a_gap_is_replayed_or_else_cleared(lost: bool) -> None:
    """A batch missed on the wire is fetched from the replay socket; one the publisher no longer
    holds clears the entries, and following goes on from the batch after it."""
    prompts = [list(range(100 * i, 100 * i + 32)) for i in range(3)]

    def batch(i: int) -> bytes:
        return wire(["BlockStored", [10 * i, 10 * i + 1], None, prompts[i], BS, None])

    async def main() -> None:
        async with followed() as (pub, state, index, _):
            await pub.publish(batch(0))
            await wait_for_async(lambda: state.seq == 0, "the first batch")
            await asyncio.sleep(0.2)  # the subscription reaches the publisher
            await pub.publish(batch(1), send=False, keep=not lost)
            await pub.publish(batch(2))
            await wait_for_async(lambda: state.seq == 2, "the batch after the gap")
            if lost:
                # Batch 1 might have removed blocks: nothing before the hole is trusted.
                assert (state.resyncs, state.repairs) == (2, 0)
                assert_holds_exactly(index, "r", ours(prompts[2]))
            else:
                assert (state.resyncs, state.repairs) == (1, 1)
                assert_holds_exactly(index, "r", ours(prompts[0]) + ours(prompts[1]) + ours(prompts[2]))
            assert state.lag_s() == 0.0

    asyncio.run(main())


def test_silence_is_checked_against_the_replay_buffer() -> None:
    """The last batches never arrived and nothing follows them: the idle check finds them."""
    tokens = list(range(300, 332))

    async def main() -> None:
        async with followed() as (pub, state, index, _):
            await pub.publish(wire(["AllBlocksCleared"]))
            await wait_for_async(lambda: state.seq == 0, "the first batch")
            await pub.publish(wire(["BlockStored", [1, 2], None, tokens, BS, None]), send=False)
            await wait_for_async(lambda: state.seq == 1, "the idle check")
            assert_holds_exactly(index, "r", ours(tokens))
            assert (state.resyncs, state.repairs) == (1, 1)

    asyncio.run(main())


def test_a_restarted_publisher_is_told_from_a_blip_by_its_bytes() -> None:
    """The new process has published more than the old one by the time the follower reconnects, so
    its numbers alone look like a gap: the bytes of the last batch applied show the restart."""
    old, new = list(range(16)), list(range(500, 532))

    async def main() -> None:
        async with followed() as (pub, state, index, restart):
            await pub.publish(wire(["AllBlocksCleared"]))
            await pub.publish(wire(["BlockStored", [1], None, old, BS, None]))
            await wait_for_async(lambda: state.seq == 1, "the old publisher's batches")
            await pub.close()
            await wait_for_async(lambda: not state.connected, "the disconnect")
            assert state.lag_s() > 0
            fresh = restart()
            await fresh.publish(wire(["AllBlocksCleared"]))
            await fresh.publish(wire(["BlockStored", [1, 2], None, new, BS, None]))
            await fresh.publish(wire(["BlockRemoved", [2]]))
            await wait_for_async(lambda: state.seq == 2 and state.resyncs == 2, "the resync")
            assert_holds_exactly(index, "r", ours(new)[:1])
            assert state.lag_s() == 0.0

    asyncio.run(main())


def test_a_malformed_batch_clears_loudly_and_following_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    tokens = list(range(40, 72))

    async def main() -> None:
        async with followed() as (pub, state, index, _):
            await pub.publish(wire(["BlockStored", [1], None, tokens[:16], BS, None]))
            await wait_for_async(lambda: state.seq == 0, "the first batch")
            await asyncio.sleep(0.2)
            await pub.publish(msgspec.msgpack.encode([1.0, [["BlockStored", "not a list"]]]))
            await pub.publish(wire(["BlockStored", [2], None, tokens[16:], BS, None]))
            await wait_for_async(lambda: state.seq == 2, "the batch after it")
            assert_holds_exactly(index, "r", chain_hashes(root_hash(MODEL), tokens[16:], BS))
            assert (state.resyncs, state.errors) == (2, 1)

    asyncio.run(main())
    assert any("malformed KV event message" in r.getMessage() for r in caplog.records)


def test_without_a_replay_socket_only_the_live_stream_is_followed() -> None:
    before, after = list(range(16)), list(range(900, 916))

    async def main() -> None:
        history = [wire(["BlockStored", [1], None, before, BS, None])]
        async with followed(history, replay=False) as (pub, state, index, _):
            await wait_for_async(lambda: state.connected, "the connection")
            await asyncio.sleep(0.2)
            await pub.publish(wire(["BlockStored", [2], None, after, BS, None]))
            await wait_for_async(lambda: state.seq == 1, "the live batch")
            assert_holds_exactly(index, "r", ours(after))
            await pub.publish(wire(["BlockRemoved", [2]]), send=False)
            await pub.publish(wire(["AllBlocksCleared"]))
            await wait_for_async(lambda: state.seq == 3, "the batch after the gap")
            assert state.resyncs == 2

    asyncio.run(main())


# -- bundled workers publishing with --kv-events-zmq ------------------------------------------------


class LossyPublisher(ZmqPublisher):
    """Test-only: while `drop` is set, messages stay off the wire but go to the replay buffer (a
    subscriber missed them), or with `forget` nowhere (a buffer that moved past them)."""

    drop = False
    forget = False

    async def publish(self, seq: int, payload: bytes) -> None:
        if not self.drop:
            await super().publish(seq, payload)
        elif not self.forget:
            self.buffer.append((seq, payload))


def completions(url: str, prompts: list[list[int]], model: str | None = None) -> None:
    with httpx.Client(base_url=url, timeout=30) as client, ThreadPoolExecutor(4) as pool:

        def one(ids: list[int]) -> None:
            body = {"prompt": ids, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body | ({"model": model} if model else {}))
            assert response.status_code == 200, response.text

        list(pool.map(one, prompts))


def family_prompts(seed: int, count: int) -> list[list[int]]:
    """Prompts sharing a few prefixes, long enough for a small pool to evict."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1000, 40000) for _ in range(64)] for _ in range(3)]
    return [
        [*rng.choice(heads)[: rng.randrange(16, 65)], *(rng.randrange(1000, 40000) for _ in range(96))]
        for _ in range(count)
    ]


def snapshot(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/kv/snapshot", timeout=10).json()


@pytest.mark.parametrize("forget", [False, True], ids=["replayed", "lost"])
def test_a_workers_dropped_messages_are_replayed_or_else_cleared(forget: bool) -> None:
    """A bundled worker whose publisher (a test-only subclass) leaves a workload's messages off the
    wire: replayed, the index is exact again; lost, it is cleared and holds only what followed."""
    port, pub, replay = distinct_ports(3)
    args = build_parser().parse_args(
        ["worker", "--sim", "--sim-profile", "h100-8b", "--block-size", str(BS), "--num-blocks", "64",
         "--port", str(port), "--kv-events-zmq", f"tcp://127.0.0.1:{pub}"]
    )  # fmt: skip
    worker = build_worker(args)
    made: list[LossyPublisher] = []

    async def lossy(app: web.Application) -> AsyncIterator[None]:
        made.append(
            LossyPublisher(app[RUNTIME], ZmqPublisherConfig(args.kv_events_zmq, f"tcp://127.0.0.1:{replay}"))
        )
        made[0].start()
        yield
        await made[0].stop()

    server = ServerThread(create_app(worker, contexts=[lossy]), port=port)
    url = server.start()
    model = worker.info.model

    async def main() -> None:
        index = RadixIndex()
        index.add_replica("w")
        sync = ZmqSync(index, ZmqSettings(**(FAST | {"idle_check_s": 2.0})))
        state = sync.start("w", model, BS, ZmqSource(args.kv_events_zmq, f"tcp://127.0.0.1:{replay}"))
        try:
            await wait_for_async(lambda: state.seq == 0, "the worker's first batch")
            await asyncio.sleep(0.2)  # the subscription reaches the publisher
            await asyncio.to_thread(completions, url, family_prompts(1, 20))
            snap = await asyncio.to_thread(snapshot, url)
            await wait_for_async(lambda: state.seq == snap["seq"] - 1, "the first workload")
            assert_holds_exactly(index, "w", snap["hashes"])
            repairs = state.repairs
            made[0].drop, made[0].forget = True, forget
            await asyncio.to_thread(completions, url, family_prompts(2, 20))
            dropped = (await asyncio.to_thread(snapshot, url))["seq"]
            await wait_for_async(lambda: made[0].published_seq >= dropped, "the dropped batches")
            made[0].drop = False
            fresh = list(range(60000, 60032))
            await asyncio.to_thread(completions, url, [fresh])
            snap = await asyncio.to_thread(snapshot, url)
            await wait_for_async(lambda: state.seq == snap["seq"] - 1, "the batches after the gap")
            if forget:
                assert (state.resyncs, state.repairs) == (2, repairs)
                held = [h for h in snap["hashes"] if index.holds("w", h)]
                assert index.blocks_of("w") == len(held), "nothing the worker does not cache"
                assert all(index.holds("w", h) for h in ours(fresh, model))
            else:
                assert state.resyncs == 1 and state.repairs > repairs
                assert_holds_exactly(index, "w", snap["hashes"])
        finally:
            await sync.close()

    try:
        asyncio.run(main())
    finally:
        server.stop()


# -- a gateway in front of worker processes declared foreign --------------------------------------


class WorkerProcess:
    """`prefixgate worker --sim ... --kv-events-zmq` in a process of its own, so that it can be killed
    and started again on the same ports."""

    def __init__(self, worker_id: str) -> None:
        self.id = worker_id
        self.port, self.pub, self.replay = distinct_ports(3)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def entry(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "id": self.id,
            "kind": "openai",
            "block_size": BS,
            "kv_events": f"tcp://127.0.0.1:{self.pub}",
            "kv_events_replay": f"tcp://127.0.0.1:{self.replay}",
        }

    def start(self) -> None:
        args = [
            "worker", "--sim", "--sim-profile", "h100-8b", "--block-size", str(BS), "--num-blocks", "256",
            "--id", self.id, "--port", str(self.port), "--log-level", "WARNING",
            "--kv-events-zmq", f"tcp://127.0.0.1:{self.pub}", "--kv-events-replay", f"tcp://127.0.0.1:{self.replay}",
        ]  # fmt: skip
        self.proc = subprocess.Popen([sys.executable, "-m", "prefixgate", *args])
        deadline = time.monotonic() + 60
        while True:
            assert self.proc.poll() is None, f"worker {self.id} exited with {self.proc.returncode}"
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"worker {self.id} did not start"
            time.sleep(0.1)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def worker_processes() -> Iterator[Callable[[str], WorkerProcess]]:
    made: list[WorkerProcess] = []

    def make(worker_id: str) -> WorkerProcess:
        made.append(WorkerProcess(worker_id))
        made[-1].start()
        return made[-1]

    yield make
    for worker in made:
        worker.kill()


def on_loop(gateway: RunningGateway, read: Callable[[], Any]) -> Any:
    """Read the gateway's state on its own event loop, between two of its steps."""

    async def call() -> Any:
        return read()

    return asyncio.run_coroutine_threadsafe(call(), gateway.server.loop).result(10)


def exact(gateway: RunningGateway, worker: WorkerProcess) -> bool:
    """The gateway's index for the worker is the worker's cached set, no more and no less."""
    hashes = snapshot(worker.url)["hashes"]
    index = gateway.state.index
    return on_loop(
        gateway,
        lambda: index.blocks_of(worker.id) == len(hashes) and all(index.holds(worker.id, h) for h in hashes),
    )


@pytest.mark.timeout(180)
def test_a_gateway_follows_foreign_worker_processes_exactly_through_a_restart(
    worker_processes: Callable[[str], WorkerProcess],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    workers = [worker_processes("zmq-a"), worker_processes("zmq-b")]
    gateway = start_gateway([], wait_for=2, replicas=[w.entry for w in workers])
    states = gateway.gw.zmq_sync.states
    assert set(states) == {"zmq-a", "zmq-b"} and not gateway.gw.sync.states, "ZMQ, not HTTP or Redis"
    assert all(on_loop(gateway, lambda r=r: r.precise) for r in gateway.state.replicas.all())

    prompts = family_prompts(3, 100)
    distinct = {h for p in prompts for h in block_hashes(p, BS, SIM_MODEL)}
    assert len(distinct) > 2 * 256, "the two pools of 256 blocks were meant to evict"
    completions(gateway.url, prompts, SIM_MODEL)
    for worker in workers:
        wait_for(
            lambda w=worker: exact(gateway, w),
            f"{worker.id}'s index to equal its cache",
            timeout=20,
            interval=0.05,
        )
    before = snapshot(workers[0].url)["hashes"]
    assert before and all(s.skipped == Counter() for s in states.values())

    workers[0].kill()
    workers[0].start()  # a new process on the same ports: its numbers start over at 0
    wait_for(
        lambda: states["zmq-a"].resyncs == 2,
        "the restarted publisher to be noticed",
        timeout=20,
        interval=0.05,
    )
    wait_for(
        lambda: exact(gateway, workers[0]),
        "zmq-a's index to equal its empty cache",
        timeout=20,
        interval=0.05,
    )
    assert not any(on_loop(gateway, lambda h=h: gateway.state.index.holds("zmq-a", h)) for h in before)
    gateway.wait_routable(2, timeout=20)
    completions(gateway.url, family_prompts(4, 40), SIM_MODEL)
    for worker in workers:
        wait_for(
            lambda w=worker: exact(gateway, w),
            f"{worker.id}'s index to equal its cache again",
            timeout=20,
            interval=0.05,
        )
    assert states["zmq-b"].resyncs == 1


@contextmanager
def publisher_thread(pub_port: int, replay_port: int, payloads: list[bytes]) -> Iterator[None]:
    """A HandPublisher that has published `payloads`, answering replays from a loop of its own."""
    loop = asyncio.new_event_loop()
    ctx = zmq.asyncio.Context()

    async def make() -> HandPublisher:
        publisher = HandPublisher(ctx, pub_port, replay_port)
        for payload in payloads:
            await publisher.publish(payload)
        return publisher

    publisher = loop.run_until_complete(make())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        asyncio.run_coroutine_threadsafe(publisher.close(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
        ctx.destroy(linger=0)


def test_the_admin_api_and_the_metrics_show_a_zmq_follower(
    start_gateway: Callable[..., RunningGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreign backend publishing vLLM-format events: precise routing (the index holds what the
    events say, and no prediction), its follower listed by /admin/replicas and in the metrics."""
    monkeypatch.setenv("ZMQ_TEST_ADMIN", "secret")
    pub_port, replay_port = distinct_ports(2)
    tokens = list(range(3000, 3064))

    async def answer(request: web.Request) -> web.Response:
        return web.json_response({"id": "c", "object": "text_completion", "model": SIM_MODEL, "choices": []})

    batch = wire(map_stored([1, 2, 3, 4], None, tokens))
    with publisher_thread(pub_port, replay_port, [batch]), foreign_backend(SIM_MODEL, answer) as url:
        entry = {
            "url": url,
            "id": "vllm",
            "kind": "openai",
            "kv_events": f"tcp://127.0.0.1:{pub_port}",
            "kv_events_replay": f"tcp://127.0.0.1:{replay_port}",
        }
        gateway = start_gateway([], wait_for=1, replicas=[entry], auth={"admin_token_env": "ZMQ_TEST_ADMIN"})
        state = gateway.gw.zmq_sync.states["vllm"]
        wait_for(lambda: state.seq == 0, "the replayed batch", timeout=20, interval=0.05)
        body = {"model": SIM_MODEL, "prompt": [*tokens, *range(1, 33)], "max_tokens": 1}
        response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=10)
        assert response.headers["x-prefixgate-matched-blocks"] == "4"
        assert on_loop(gateway, lambda: gateway.state.index.blocks_of("vllm")) == 4, "no prediction added"
        listed = gateway.admin("GET", "/admin/replicas", token="secret").json()["replicas"]
        kv_sync = listed[0]["kv_sync"]
        assert (kv_sync["transport"], kv_sync["synced"], kv_sync["resyncs"]) == ("zmq", True, 1)
        metrics = httpx.get(f"{gateway.url}/metrics").text
        assert 'prefixgate_gateway_kv_resyncs{replica="vllm"} 1.0' in metrics
        assert 'prefixgate_gateway_kv_sync_lag_seconds{replica="vllm"} 0.0' in metrics
