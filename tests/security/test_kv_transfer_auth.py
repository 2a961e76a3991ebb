"""Worker-to-worker KV transfers authenticate (issue 20, item 1, and the transfer port's part of item 8).

A decode worker pulls only for a grant its gateway signed, once; a prefill worker pushes only for an
order a decode worker signed; the receiver writes only blocks a secret holder pushed for a reservation it
holds. Each test sends the forged, unsigned, stalled or oversized input to real workers (or a real
receiver) over loopback and checks what was written, what was cached, what the client was told, and
that every reserved block came back."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from bench.probes import wait_for
from protocol.disaggregation import PREFILL_ERROR_HEADER, TRANSFERRED_TOKENS_HEADER
from protocol.transfer_auth import grant, order_signature, push_signature
from radix import block_hashes
from tests.support.gateways import SIM_MODEL, SimWorker
from tests.support.kv_stores import ArrayStore, filled
from tests.support.servers import ServerThread
from workers.app_state import RUNTIME
from workers.kv_transfer import MAGIC, NoKV, TransferError, TransferServer, send_blocks

SECRET = "a-test-kv-transfer-secret"
BLOCK = 16
PROMPT = list(range(2000, 2041))  # 41 token ids: 2 reusable blocks of 16
HASHES = block_hashes(PROMPT[:32], BLOCK, SIM_MODEL)


def completion(worker: SimWorker, prefill: Any = None) -> httpx.Response:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    if prefill is not None:
        body["prefixgate_prefill"] = prefill
    return httpx.post(f"{worker.url}/v1/completions", json=body, timeout=30)


def signed(url: str, secret: str = SECRET, ttl_s: float = 30.0) -> dict[str, Any]:
    return grant(secret.encode(), url, uuid.uuid4().hex, ttl_s)


def cached_tokens(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@dataclass
class FakePrefill:
    """What answers a decode worker's `POST /kv/prefill`: a peer that `mode` says how to play. "hang"
    never answers; "idle" answers 200 at once without pushing; "push" pushes the prompt's blocks
    signed with `push_secret` (None: no MAC at all) before answering. Records each order and the
    receiver's reply to its push."""

    mode: str
    push_secret: str | None = SECRET
    orders: list[dict[str, Any]] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    server: ServerThread | None = None
    url: str = ""

    def start(self) -> FakePrefill:
        app = web.Application()
        app.router.add_post("/kv/prefill", self._prefill)
        self.server = ServerThread(app)
        self.url = self.server.start()
        return self

    async def _prefill(self, request: web.Request) -> web.Response:
        order = await request.json()
        self.orders.append(order)
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "push":
            target = order["transfer"]
            hashes = HASHES[order["skip_blocks"] :]
            self.replies.append(
                await _push(target["host"], target["port"], target["id"], hashes, self.push_secret)
            )
        return web.json_response({"blocks": 0, "bytes": 0, "prefill_s": 0.0, "transfer_s": 0.0})


async def _push(host: str, port: int, transfer_id: str, hashes: list[int], secret: str | None) -> str:
    """Push `hashes` as a prefill worker would, signed with `secret`, or with no MAC (None)."""
    if secret is not None:
        try:
            got = await send_blocks(
                host, port, transfer_id, hashes, [0] * len(hashes), NoKV(), secret=secret.encode()
            )
        except TransferError as error:
            return f"refused: {error}"
        return f"accepted {got}"
    reader, writer = await asyncio.open_connection(host, port)
    header = orjson.dumps(
        {"id": transfer_id, "layout": "sim", "block_bytes": 0, "group_blocks": 32, "hashes": hashes}
    )
    writer.write(MAGIC + struct.pack("<I", len(header)) + header)
    (length,) = struct.unpack("<I", await reader.readexactly(4))
    reply = orjson.loads(await reader.readexactly(length))
    writer.close()
    return "accepted" if reply.get("ok") else f"refused: {reply.get('error')}"


@pytest.fixture
def fake_prefill() -> Iterator[Callable[..., FakePrefill]]:
    started: list[FakePrefill] = []

    def start(mode: str, **fields: Any) -> FakePrefill:
        fake = FakePrefill(mode, **fields).start()
        started.append(fake)
        return fake

    yield start
    for fake in started:
        assert fake.server is not None
        fake.server.stop()


@pytest.fixture
def decode(start_sim_worker: Callable[..., SimWorker]) -> SimWorker:
    return start_sim_worker("d", "--role", "decode", "--transfer-secret", SECRET)


def blocks_used(worker: SimWorker) -> int:
    return int(worker.load()["kv_blocks_used"])


def cached_hashes(worker: SimWorker) -> set[int]:
    return set(httpx.get(f"{worker.url}/kv/snapshot").json()["hashes"])


@pytest.mark.parametrize("push_secret", [None, "another-fleet's-secret-0000"])
def test_a_forged_push_for_an_observed_transfer_writes_nothing(
    decode: SimWorker, fake_prefill: Callable[..., FakePrefill], push_secret: str | None
) -> None:
    """The order's transfer id is all an eavesdropper or a rogue peer learns: a push under it with no
    MAC or another secret's is refused, and the decode worker's cache gets nothing it did not compute."""
    peer = fake_prefill("push", push_secret=push_secret)
    served = completion(decode, signed(peer.url))
    assert served.status_code == 200, served.text
    (reply,) = peer.replies
    assert reply.startswith("refused") and "expected here from this sender" in reply
    assert served.headers[TRANSFERRED_TOKENS_HEADER] == "0" and cached_tokens(served) == 0
    assert "pushed nothing" in served.headers[PREFILL_ERROR_HEADER]
    wait_for(lambda: blocks_used(decode) == 0, "the decode worker to hold no blocks")
    # What it holds now it computed itself; and asked again, it reports that, not forged blocks.
    assert set(HASHES) <= cached_hashes(decode)


def test_the_same_push_signed_with_the_fleets_secret_lands(
    decode: SimWorker, fake_prefill: Callable[..., FakePrefill]
) -> None:
    """The control for the test above: the push it forges is a valid one, but for the MAC."""
    peer = fake_prefill("push", push_secret=SECRET)
    served = completion(decode, signed(peer.url))
    assert peer.replies == ["accepted 2"]
    assert served.headers[TRANSFERRED_TOKENS_HEADER] == "32" and cached_tokens(served) == 32
    wait_for(lambda: blocks_used(decode) == 0, "the decode worker to hold no blocks")


@pytest.mark.parametrize(
    "prefill",
    [
        pytest.param(lambda url: {"url": url}, id="unsigned"),
        pytest.param(lambda url: signed(url, secret="another-fleet's-secret-0000"), id="other-secret"),
        pytest.param(lambda url: signed(url, ttl_s=-1.0), id="expired"),
        pytest.param(lambda url: {**signed(url), "url": url + "/evil"}, id="url-changed"),
        pytest.param(lambda url: {**signed(url), "sig": "é" * 64}, id="non-ascii-sig"),
    ],
)
def test_a_decode_worker_pulls_for_no_grant_but_its_gateways(
    decode: SimWorker, fake_prefill: Callable[..., FakePrefill], prefill: Callable[[str], dict[str, Any]]
) -> None:
    peer = fake_prefill("idle")
    refused = completion(decode, prefill(peer.url))
    assert refused.status_code == 403, refused.text
    error = refused.json()["error"]
    assert error["param"] == "prefixgate_prefill" and error["code"] == "transfer_not_authorised"
    assert peer.orders == [], "the URL the body named was never called"
    assert blocks_used(decode) == 0
    assert completion(decode).status_code == 200, "the next client is served"


def test_a_grant_is_good_for_one_pull(decode: SimWorker, fake_prefill: Callable[..., FakePrefill]) -> None:
    peer = fake_prefill("push")
    once = signed(peer.url)
    assert completion(decode, once).headers[TRANSFERRED_TOKENS_HEADER] == "32"
    replayed = completion(decode, once)
    assert replayed.status_code == 403 and "used already" in replayed.json()["error"]["message"]
    assert len(peer.orders) == 1


def test_a_worker_without_a_secret_refuses_both_sides(
    start_sim_worker: Callable[..., SimWorker], fake_prefill: Callable[..., FakePrefill]
) -> None:
    decode = start_sim_worker("d0", "--role", "decode")
    prefill = start_sim_worker("p0", "--role", "prefill")
    peer = fake_prefill("idle")
    refused = completion(decode, signed(peer.url))
    assert refused.status_code == 403 and "--transfer-secret" in refused.json()["error"]["message"]
    order = {"token_ids": PROMPT, "transfer": {"host": "127.0.0.1", "port": 9, "id": "t"}}
    pushed = httpx.post(f"{prefill.url}/kv/prefill", json=order, timeout=10)
    assert pushed.status_code == 403 and "--transfer-secret" in pushed.json()["error"]["message"]
    assert peer.orders == []


class Listener:
    """A TCP port that counts the connections made to it: where a forged order would have a push go."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


@pytest.mark.parametrize("forgery", ["unsigned", "other-secret", "host-changed", "expired"])
def test_a_prefill_worker_pushes_only_where_a_signed_order_says(
    start_sim_worker: Callable[..., SimWorker], forgery: str
) -> None:
    prefill = start_sim_worker("p", "--role", "prefill", "--transfer-secret", SECRET)
    target = Listener()
    expires = time.time() + (-1 if forgery == "expired" else 30)
    secret = "another-fleet's-secret-0000" if forgery == "other-secret" else SECRET
    sig = order_signature(secret.encode(), "t", "127.0.0.1", target.port, 0, expires, PROMPT)
    order: dict[str, Any] = {
        "token_ids": PROMPT,
        "transfer": {"host": "127.0.0.1", "port": target.port, "id": "t"},
        "expires": expires,
        "sig": sig,
    }
    if forgery == "unsigned":
        del order["sig"]
    if forgery == "host-changed":
        order["transfer"]["host"] = "localhost"
    refused = httpx.post(f"{prefill.url}/kv/prefill", json=order, timeout=10)
    assert refused.status_code == 403, refused.text
    assert target.accepted == 0, "nothing was pushed"
    assert prefill.load()["running"] == 0 and not cached_hashes(prefill), "nothing was computed"
    target.sock.close()


@pytest.mark.parametrize("mode", ["idle", "hang"])
def test_a_prefill_that_never_pushes_frees_the_reservation_soon(
    decode: SimWorker, fake_prefill: Callable[..., FakePrefill], mode: str
) -> None:
    """Answering without a push frees it at once; never answering, after a deadline scaled to the two
    blocks (seconds, not the 120 s cap); either way the prompt is computed on the decode worker."""
    peer = fake_prefill(mode)
    seen: list[int] = []
    watching = threading.Thread(
        target=lambda: (
            wait_for(lambda: len(peer.orders) == 1, "the order to reach the peer"),
            seen.append(blocks_used(decode)),
        )
    )
    watching.start()
    start = time.monotonic()
    served = completion(decode, signed(peer.url))
    took = time.monotonic() - start
    watching.join()
    assert served.status_code == 200 and served.headers[TRANSFERRED_TOKENS_HEADER] == "0"
    assert seen == [2], "the prompt's two blocks were reserved while the prefill worker was waited for"
    puller = decode.server.app[RUNTIME].puller
    assert puller is not None and took < puller.deadline_s(2) + 3 < 30
    if mode == "idle":
        assert took < 3 and "pushed nothing" in served.headers[PREFILL_ERROR_HEADER]
    else:
        assert (
            took >= puller.deadline_s(2) - 0.5
            and "did not push within" in served.headers[PREFILL_ERROR_HEADER]
        )
    wait_for(lambda: blocks_used(decode) == 0, "the decode worker to hold no blocks")
    assert not puller.transfer._expected, "the receiver expects nothing any more"


# -- the transfer port itself, on a receiver of its own --------------------------------------------


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _receiver(**options: Any) -> tuple[TransferServer, ArrayStore]:
    target = ArrayStore(8)
    receiver = TransferServer(target, SECRET.encode(), **options)
    await receiver.start()
    return receiver, target


async def _raw(port: int, data: bytes) -> bytes:
    """Send `data`, then read until the receiver closes: its answer, if any."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    answer = await reader.read()
    writer.close()
    return answer


def test_a_forged_header_leaves_the_transfer_to_its_real_sender() -> None:
    async def main() -> None:
        receiver, target = await _receiver()
        arrived = receiver.expect("t", [1, 2], [3, 4])
        header = {"id": "t", "layout": "bytes[64]", "block_bytes": 64, "group_blocks": 2, "hashes": [1, 2]}
        forged = orjson.dumps({**header, "mac": "0" * 64})
        answer = await _raw(receiver.port, MAGIC + struct.pack("<I", len(forged)) + forged + b"x" * 128)
        assert b'"ok":false' in answer and target.writes == 0 and not arrived.done()
        source = filled(2)
        assert (
            await send_blocks("127.0.0.1", receiver.port, "t", [1, 2], [0, 1], source, secret=SECRET.encode())
            == 2
        )
        assert await arrived == 2 and target.block(3) == source.block(0)
        await receiver.close()

    run(main())


def test_a_header_longer_than_the_expected_hashes_need_is_refused_unread() -> None:
    async def main() -> None:
        receiver, target = await _receiver()
        arrived = receiver.expect("t", [1, 2], [3, 4])
        limit = receiver.header_limit()
        assert limit < 8192, "the cap follows the two hashes expected, not a fixed megabytes"
        answer = await _raw(receiver.port, MAGIC + struct.pack("<I", 2**31) + b"{")
        assert b"exceeds" in answer and not arrived.done() and target.writes == 0
        source = filled(2)
        assert (
            await send_blocks("127.0.0.1", receiver.port, "t", [1, 2], [0, 1], source, secret=SECRET.encode())
            == 2
        )
        await receiver.close()

    run(main())


@pytest.mark.parametrize("stall", ["header", "payload"])
def test_a_slow_frame_closes_its_connection_only(stall: str) -> None:
    async def main() -> None:
        receiver, target = await _receiver(read_timeout_s=0.5)
        arrived = receiver.expect("t", [1, 2], [3, 4])
        other = receiver.expect("u", [7], [5])
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        if stall == "header":
            writer.write(MAGIC + struct.pack("<I", 100) + b'{"id":')  # and then nothing
        else:
            mac = push_signature(SECRET.encode(), "t", "bytes[64]", 64, 2, [1, 2])
            header = orjson.dumps(
                {
                    "id": "t",
                    "layout": "bytes[64]",
                    "block_bytes": 64,
                    "group_blocks": 2,
                    "hashes": [1, 2],
                    "mac": mac,
                }
            )
            writer.write(MAGIC + struct.pack("<I", len(header)) + header + b"x" * 10)  # 118 bytes short
        # Meanwhile another transfer is served.
        assert (
            await send_blocks("127.0.0.1", receiver.port, "u", [7], [0], filled(1), secret=SECRET.encode())
            == 1
        )
        assert await other == 1
        start = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 5)
        assert time.monotonic() - start < 2 and b"within 0.5 s" in answer
        writer.close()
        if stall == "payload":
            with pytest.raises(TransferError):
                await arrived  # an authenticated sender that stalls fails its own transfer
        else:
            assert not arrived.done()
        assert target.writes == 1, "only the other transfer's group was written"
        await receiver.close()

    run(main())


def test_connections_past_the_cap_are_closed_at_once() -> None:
    async def main() -> None:
        receiver, _ = await _receiver(max_connections=4, read_timeout_s=1.0)
        arrived = receiver.expect("t", [1], [3])
        idle = [await asyncio.open_connection("127.0.0.1", receiver.port) for _ in range(4)]
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        assert await asyncio.wait_for(reader.read(), 0.5) == b"", "refused without being read"
        writer.close()
        # The idle ones time out, and the port serves again.
        for idle_reader, _ in idle:
            await asyncio.wait_for(idle_reader.read(), 3)
        assert (
            await send_blocks("127.0.0.1", receiver.port, "t", [1], [0], filled(1), secret=SECRET.encode())
            == 1
        )
        assert await arrived == 1
        for _, idle_writer in idle:
            idle_writer.close()
        await receiver.close()

    run(main())
