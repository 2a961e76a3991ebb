"""KV stores for KV transfer tests: plain bytes in place of a model runner's cache."""

from __future__ import annotations

BLOCK = 64


class ArrayStore:
    """A KV store over a plain bytearray: `num_blocks` blocks of BLOCK bytes."""

    def __init__(self, num_blocks: int, layout: str = "bytes[64]") -> None:
        self.data = bytearray(num_blocks * BLOCK)
        self.kv_layout = layout
        self.kv_block_bytes = BLOCK
        self.writes = 0

    def staging(self, num_bytes: int) -> memoryview:
        return memoryview(bytearray(num_bytes))

    def read_blocks(self, blocks: list[int]) -> memoryview:
        return memoryview(b"".join(bytes(self.data[b * BLOCK : (b + 1) * BLOCK]) for b in blocks))

    def write_blocks(self, blocks: list[int], data: memoryview) -> None:
        self.writes += 1
        for i, b in enumerate(blocks):
            self.data[b * BLOCK : (b + 1) * BLOCK] = data[i * BLOCK : (i + 1) * BLOCK]

    def block(self, b: int) -> bytes:
        return bytes(self.data[b * BLOCK : (b + 1) * BLOCK])


def filled(num_blocks: int) -> ArrayStore:
    store = ArrayStore(num_blocks)
    for b in range(num_blocks):
        store.data[b * BLOCK : (b + 1) * BLOCK] = bytes([b % 251]) * BLOCK
    return store
