"""Prefill/decode disaggregation between our workers (docs/design.md §4): both ends of moving a prompt's KV.

The decode worker drives it. Given a request that names a prefill worker (the gateway's
`prefixgate_prefill` field), it reserves room for the prompt's reusable blocks it lacks
(BlockManager.reserve: its own cached prefix is pinned, so a prompt mostly here moves little), asks
the prefill worker over HTTP (`POST /kv/prefill`) to compute the prompt and push those blocks to its
transfer port (workers.kv_transfer), and once they are in, installs them as computed blocks, with
their KV events, right before the request joins its batch: the request then finds them as a prefix
hit (its `cached_tokens` counts them), computes only the last partial block, and decodes. They stay
cached there for later prompts with that prefix.

A prefill worker that fails, is unreachable or too slow costs the request nothing but time: the
decode worker releases what it reserved and computes the prompt itself, and says so in a response
header for the gateway. A client that leaves mid-transfer cancels the handler: the transfer is
given up (nothing is written to the blocks after), the reservation released, and the prefill worker,
whose request is cut, aborts its sequence.

Every hop is authenticated with the fleet's transfer secret (protocol.transfer_auth): a decode worker
pulls only for a grant the gateway signed (a body's own `prefixgate_prefill` is refused, 403), each
transfer id once; its order to the prefill worker is signed, and a prefill worker pushes only for an
order that verifies; the push itself carries a MAC the receiver checks. A worker with no secret takes
no part: it refuses both sides with a 403 that says how to give it one.

A pull has a deadline scaled to what it moves (PULL_BASE_S plus PULL_S_PER_BLOCK a block, at most
`timeout_s`), and a prefill worker that answers without having pushed ends it at once: a prefill
worker that never pushes pins the reserved blocks for seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from protocol.disaggregation import (
    PREFILL_ERROR_HEADER,
    PULL_MS_HEADER,
    TRANSFER_MS_HEADER,
    TRANSFERRED_TOKENS_HEADER,
)
from protocol.errors import ApiError
from protocol.token_ids import are_token_ids
from protocol.transfer_auth import (
    GRANT_TTL_S,
    SECRET_ENV,
    check_grant,
    digest,
    live,
    order_signature,
    verify,
)
from workers.engine.block_manager import Reservation
from workers.engine.engine_core import Engine
from workers.engine.llm import AsyncLLM
from workers.engine.sampling_params import SamplingParams
from workers.kv_transfer import KVStore, TransferError, TransferServer, send_blocks

DEFAULT_TRANSFER_TIMEOUT_S = 120.0
DEFAULT_ROOM_WAIT_S = 30.0
ROOM_POLL_S = 0.01
# A pull's deadline: a base for the round trip and the prefill worker's queue, plus its compute and push
# per block moved (a CPU SmolLM2 prefills a 16-token block in well under this).
PULL_BASE_S = 5.0
PULL_S_PER_BLOCK = 0.25
# How long after the prefill worker's answer its push may still be landing (it answers once the
# receiver acknowledged it, so normally none).
ARRIVAL_GRACE_S = 1.0
NO_SECRET = (
    f"this worker has no KV transfer secret (--transfer-secret, or {SECRET_ENV}): it takes no part in "
    "prefill/decode disaggregation"
)


def unauthorised(message: str, param: str | None = "prefixgate_prefill") -> ApiError:
    return ApiError(403, message, param=param, code="transfer_not_authorised")


@dataclass(slots=True)
class Pulled:
    """What a decode worker got of a prompt from its prefill worker: a reservation with `received`
    blocks arrived (None when nothing is to be installed), or why it computes the prompt itself."""

    reservation: Reservation | None
    received: int
    block_size: int
    error: str | None = None
    # The whole pull, and the push alone (the prefill worker's measure).
    seconds: float = 0.0
    transfer_seconds: float = 0.0
    bytes: int = 0
    # Whether the error is the prefill worker's (the gateway then marks it failed), not this one's.
    prefill_failed: bool = True

    @property
    def tokens(self) -> int:
        return self.received * self.block_size

    def prelude(self) -> Callable[[Engine], None] | None:
        """The install to run right before the request joins the batch (AsyncLLM.generate)."""
        reservation = self.reservation
        if reservation is None:
            return None
        received = self.received
        return lambda engine: engine.block_manager.install(reservation, received)

    def headers(self) -> dict[str, str]:
        headers = {TRANSFERRED_TOKENS_HEADER: str(self.tokens)}
        if self.tokens:
            headers[PULL_MS_HEADER] = f"{self.seconds * 1000:.2f}"
            headers[TRANSFER_MS_HEADER] = f"{self.transfer_seconds * 1000:.2f}"
        if self.error is not None and self.prefill_failed:
            headers[PREFILL_ERROR_HEADER] = self.error.replace("\n", " ")[:200]
        return headers


def _release(engine: Engine, reservation: Reservation | None) -> None:
    if reservation is not None:
        engine.block_manager.release(reservation)


@dataclass(slots=True)
class Puller:
    """The decode side: the transfer port it receives on, the HTTP client it asks prefill workers with."""

    front: AsyncLLM
    transfer: TransferServer
    session: aiohttp.ClientSession
    # The fleet's transfer secret: the gateway's grants are checked, and this worker's orders signed, with it.
    secret: bytes
    block_size: int
    # The KV pool's size: a prompt with more reusable blocks can never be received.
    num_blocks: int
    # The host prefill workers push to: the one this worker's transfer port is reachable at.
    advertise_host: str
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    # How long to wait for KV room before computing the prompt here after all.
    room_wait_s: float = DEFAULT_ROOM_WAIT_S
    # Pulls waiting for room take turns in arrival order (asyncio.Lock is fair): a long prompt at the
    # head is not overtaken forever by short ones that happen to fit.
    _room: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Transfer ids of the grants used, until they expire: a grant is good for one pull.
    _used: dict[str, float] = field(default_factory=dict)

    def authorise(self, value: object) -> tuple[str, str]:
        """The prefill worker's URL and the transfer id of a grant the gateway signed, used once; 403
        for anything else (a client's own field, a forged or expired grant, one used already)."""
        checked = check_grant(self.secret, value)
        if checked is None:
            raise unauthorised(
                "prefixgate_prefill is not a grant this worker's gateway signed (or it expired)"
            )
        url, transfer_id, expires = checked
        now = time.time()
        self._used = {used: until for used, until in self._used.items() if until >= now}
        if transfer_id in self._used:
            raise unauthorised(f"the grant for transfer {transfer_id} was used already")
        self._used[transfer_id] = expires
        return url, transfer_id

    def deadline_s(self, blocks: int) -> float:
        """How long a pull of `blocks` blocks may take before the prompt is computed here instead."""
        return min(self.timeout_s, PULL_BASE_S + PULL_S_PER_BLOCK * blocks)

    async def pull(self, prompt: list[int], prefill_url: str, transfer_id: str) -> Pulled:
        """Reserve, have the prefill worker compute and push the prompt's blocks, wait for them.

        Never raises for the prefill worker's failure (the error is in the result, the reservation
        already released); a cancellation (the client left) gives the transfer up and releases."""
        reservation = await self._reserve(prompt)
        if reservation is None:
            error = f"no KV room to receive the prompt into within {self.room_wait_s:g} s"
            return Pulled(None, 0, self.block_size, error=error, prefill_failed=False)
        if not reservation.blocks:  # everything reusable is cached here already
            self.front.post(lambda engine: _release(engine, reservation))
            return Pulled(None, 0, self.block_size)
        deadline_s = self.deadline_s(len(reservation.blocks))
        arrived = self.transfer.expect(transfer_id, reservation.hashes, reservation.blocks)
        body = self._order(prompt, len(reservation.held), transfer_id, deadline_s)
        start = time.monotonic()
        try:
            async with asyncio.timeout(deadline_s):
                report = await self._ask(prefill_url, body)
            try:
                async with asyncio.timeout(ARRIVAL_GRACE_S):
                    received = await arrived
            except TimeoutError:
                raise TransferError(f"prefill worker {prefill_url} answered but pushed nothing") from None
        except (TransferError, aiohttp.ClientError, TimeoutError, ValueError) as error:
            self.transfer.forget(transfer_id)
            self.front.post(lambda engine: _release(engine, reservation))
            reason = (
                f"prefill worker {prefill_url} did not push within {deadline_s:g} s"
                if isinstance(error, TimeoutError)
                else str(error)
            )
            return Pulled(None, 0, self.block_size, error=reason or type(error).__name__)
        except BaseException:
            self.transfer.forget(transfer_id)
            self.front.post(lambda engine: _release(engine, reservation))
            raise
        return Pulled(
            reservation,
            received,
            self.block_size,
            seconds=time.monotonic() - start,
            transfer_seconds=float(report.get("transfer_s", 0.0)),
            bytes=int(report.get("bytes", 0)),
        )

    async def _reserve(self, prompt: list[int]) -> Reservation | None:
        """Room for the prompt's blocks, waiting up to `room_wait_s` for running sequences to free
        some: computing a long prompt here instead would stall every decode in the batch, which is
        what disaggregation is for avoiding. None at once for a prompt the pool could never hold."""
        if (len(prompt) - 1) // self.block_size > self.num_blocks:
            return None
        deadline = time.monotonic() + self.room_wait_s
        async with self._room:
            while True:
                reservation = await self.front.call(
                    lambda engine: engine.block_manager.reserve(prompt), undo=_release
                )
                if reservation is not None or time.monotonic() >= deadline:
                    return reservation
                await asyncio.sleep(ROOM_POLL_S)

    def _order(self, prompt: list[int], skip: int, transfer_id: str, deadline_s: float) -> dict[str, Any]:
        """The signed `POST /kv/prefill` body: what to compute, and where to push it, until when."""
        host, port = self.advertise_host, self.transfer.port
        # Past the pull's own deadline by a grant's lifetime: room for the two workers' clocks to differ.
        expires = round(time.time() + deadline_s + GRANT_TTL_S, 3)
        return {
            "token_ids": prompt,
            "skip_blocks": skip,
            "transfer": {"host": host, "port": port, "id": transfer_id},
            "expires": expires,
            "sig": order_signature(self.secret, transfer_id, host, port, skip, expires, prompt),
        }

    async def _ask(self, prefill_url: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self.session.post(f"{prefill_url.rstrip('/')}/kv/prefill", json=body) as response:
            if response.status != 200:
                raise TransferError(
                    f"prefill worker {prefill_url} answered {response.status}{await _error_of(response)}"
                )
            report = await response.json()
        if not isinstance(report, dict):
            raise TransferError(f"prefill worker {prefill_url} answered {report!r}")
        return report


async def _error_of(response: aiohttp.ClientResponse) -> str:
    """A refusal's reason, when it is a worker's OpenAI error; nothing else of the answer is repeated
    (it goes into a response header)."""
    try:
        parsed = await response.json(content_type=None)
    except (aiohttp.ClientError, ValueError):
        return ""
    error = parsed.get("error") if isinstance(parsed, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return f": {message[:200]}" if isinstance(message, str) else ""


@dataclass(frozen=True, slots=True)
class PrefillOrder:
    """A validated `POST /kv/prefill` body: the prompt, the blocks the decode worker already holds,
    and where to push the rest."""

    token_ids: list[int]
    skip_blocks: int
    host: str
    port: int
    transfer_id: str

    @classmethod
    def parse(cls, body: Any, vocab_size: int, secret: bytes) -> PrefillOrder:
        """The order, once its signature (a decode worker's, with the fleet's secret) verifies: 400 for
        a malformed one, 403 for one no secret holder made, or made for a transfer that is over."""
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        ids = body.get("token_ids")
        if not isinstance(ids, list) or not are_token_ids(ids, vocab_size):
            message = f"token_ids must be a non-empty list of ids below {vocab_size}"
            raise ApiError(400, message, param="token_ids")
        skip = body.get("skip_blocks", 0)
        if type(skip) is not int or skip < 0:
            raise ApiError(400, "skip_blocks must be a non-negative integer", param="skip_blocks")
        target = body.get("transfer")
        if not isinstance(target, dict):
            raise ApiError(400, "transfer must be an object with host, port and id", param="transfer")
        host, port, transfer_id = target.get("host"), target.get("port"), target.get("id")
        if not isinstance(host, str) or not host or type(port) is not int or not 0 < port < 65536:
            raise ApiError(400, "transfer.host and transfer.port must name a TCP endpoint", param="transfer")
        if not isinstance(transfer_id, str) or not transfer_id:
            raise ApiError(400, "transfer.id must be a non-empty string", param="transfer")
        expires = body.get("expires")
        if not live(expires):
            raise unauthorised("the order has expired (or names no expiry)", param="expires")
        if not verify(secret, body.get("sig"), "order", transfer_id, host, port, skip, expires, digest(ids)):
            raise unauthorised("the order is not signed with this fleet's transfer secret", param="sig")
        return cls(ids, skip, host, port, transfer_id)


async def prefill_and_push(
    front: AsyncLLM, store: KVStore, block_size: int, order: PrefillOrder, secret: bytes
) -> dict[str, Any]:
    """The prefill side: compute the prompt's reusable blocks (its own prefix cache helping), hold
    them, push those the decode worker lacks, and report what moved. The held blocks are let go
    whatever happens; a cut request (the decode worker gave up) aborts the prefill."""
    start = time.monotonic()
    hashes = await front.call(lambda engine: engine.block_manager.prompt_hashes(order.token_ids))
    if order.skip_blocks > len(hashes):
        raise ApiError(400, f"skip_blocks {order.skip_blocks} exceeds the prompt's {len(hashes)} blocks")
    if len(hashes) > order.skip_blocks:
        usable = order.token_ids[: len(hashes) * block_size]
        # Greedy, so that the one token sampled (and dropped) draws nothing from the worker's RNG.
        prefill = SamplingParams(max_tokens=1, temperature=0.0)
        async with aclosing(front.generate(usable, prefill)) as outs:
            async for _ in outs:
                pass
    computed = time.monotonic()
    held = await front.call(
        lambda engine: engine.block_manager.hold(hashes),
        undo=lambda engine, blocks: engine.block_manager.unhold(blocks),
    )
    try:
        blocks = held[order.skip_blocks :]
        sent = hashes[order.skip_blocks : len(held)]
        received = 0
        if sent:
            received = await send_blocks(
                order.host, order.port, order.transfer_id, sent, blocks, store, secret=secret
            )
    except TransferError as error:
        raise ApiError(502, f"the KV transfer to {order.host}:{order.port} failed: {error}") from None
    finally:
        front.post(lambda engine: engine.block_manager.unhold(held))
    done = time.monotonic()
    return {
        "blocks": received,
        "bytes": received * store.kv_block_bytes,
        "prefill_s": round(computed - start, 6),
        "transfer_s": round(done - computed, 6),
    }
