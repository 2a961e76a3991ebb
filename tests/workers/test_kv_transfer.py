"""The KV transfer protocol on loopback: bytes land in exactly the reserved blocks, and every way a
transfer can go wrong (another layout, other hashes, given up, cut off) writes nothing and says why."""

from __future__ import annotations

import asyncio
import struct

import orjson
import pytest
import torch

from protocol.transfer_auth import push_signature
from tests.support.kv_stores import BLOCK, ArrayStore, filled
from workers.engine.model_runner import ModelRunner
from workers.kv_transfer import GROUP_BLOCKS, MAGIC, TransferError, TransferServer, send_blocks

SECRET = b"a-test-kv-transfer-secret"


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_blocks_land_where_their_hashes_were_reserved() -> None:
    async def main() -> None:
        source, target = filled(128), ArrayStore(128)
        receiver = TransferServer(target, SECRET)
        await receiver.start()
        count = 2 * GROUP_BLOCKS + 3  # more than one staging group
        hashes = list(range(1000, 1000 + count))
        dest = list(range(127, 127 - count, -1))
        arrived = receiver.expect("t1", hashes, dest)
        sent = await send_blocks(
            "127.0.0.1", receiver.port, "t1", hashes, list(range(count)), source, secret=SECRET
        )
        assert sent == count and await arrived == count
        assert all(target.block(d) == source.block(s) for s, d in enumerate(dest))
        assert target.block(0) == bytes(BLOCK), "no block outside the reservation is written"
        await receiver.close()

    run(main())


def test_a_prefix_of_the_reserved_hashes_is_accepted() -> None:
    async def main() -> None:
        source, target = filled(8), ArrayStore(8)
        receiver = TransferServer(target, SECRET)
        await receiver.start()
        arrived = receiver.expect("t", [1, 2, 3], [5, 6, 7])
        assert await send_blocks("127.0.0.1", receiver.port, "t", [1, 2], [0, 1], source, secret=SECRET) == 2
        assert await arrived == 2 and target.block(7) == bytes(BLOCK)
        await receiver.close()

    run(main())


@pytest.mark.parametrize("case", ["layout", "hashes", "unknown", "forgotten"])
def test_refused_transfers_write_nothing(case: str) -> None:
    async def main() -> None:
        source, target = filled(8), ArrayStore(8)
        if case == "layout":
            source.kv_layout = "bytes[32]"
        receiver = TransferServer(target, SECRET)
        await receiver.start()
        arrived = receiver.expect("t", [1, 2], [3, 4])
        hashes = [2, 1] if case == "hashes" else [1, 2]
        transfer_id = "other" if case == "unknown" else "t"
        if case == "forgotten":
            receiver.forget("t")
        with pytest.raises(TransferError):
            await send_blocks("127.0.0.1", receiver.port, transfer_id, hashes, [0, 1], source, secret=SECRET)
        assert target.writes == 0
        if case in ("layout", "hashes", "forgotten"):
            with pytest.raises(TransferError):
                await arrived
        await receiver.close()

    run(main())


def test_a_sender_cut_off_mid_payload_fails_the_transfer() -> None:
    async def main() -> None:
        target = ArrayStore(8)
        receiver = TransferServer(target, SECRET)
        await receiver.start()
        arrived = receiver.expect("t", [1, 2], [3, 4])
        _, writer = await asyncio.open_connection("127.0.0.1", receiver.port)
        mac = push_signature(SECRET, "t", "bytes[64]", 64, 2, [1, 2])
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
        writer.write(MAGIC + struct.pack("<I", len(header)) + header + b"x" * (BLOCK + 5))
        await writer.drain()
        writer.close()
        with pytest.raises(TransferError, match="closed after"):
            await arrived
        assert target.writes == 0, "a group cut short is never written"
        await receiver.close()

    run(main())


def test_unreachable_receiver_is_a_transfer_error() -> None:
    async def main() -> None:
        receiver = TransferServer(ArrayStore(1), SECRET)
        await receiver.start()
        port = receiver.port
        await receiver.close()
        with pytest.raises(TransferError, match="cannot reach"):
            await send_blocks("127.0.0.1", port, "t", [1], [0], filled(1), secret=SECRET)

    run(main())


def test_model_runner_blocks_round_trip_as_bytes(tiny) -> None:  # type: ignore[no-untyped-def]
    model = tiny[1].model
    a = ModelRunner(model, num_blocks=6, block_size=4)
    b = ModelRunner(model, num_blocks=6, block_size=4)
    a.kv_cache.copy_(torch.randn_like(a.kv_cache))
    assert a.kv_layout == b.kv_layout and a.kv_block_bytes == a.kv_bytes_per_token * 4
    data = a.read_blocks([4, 1])
    assert len(data) == 2 * a.kv_block_bytes
    staging = b.staging(len(data))
    staging[:] = data
    b.write_blocks([0, 5], staging)
    assert torch.equal(b.kv_cache[:, :, 0], a.kv_cache[:, :, 4])
    assert torch.equal(b.kv_cache[:, :, [0, 5]], a.kv_cache[:, :, [4, 1]])
    assert torch.equal(b.kv_cache[:, :, 5], a.kv_cache[:, :, 1])
    assert not b.kv_cache[:, :, 1:5].any()
