"""The block-hash chains of recent prompts, so that a prompt extending one already seen is hashed only
where it grew.

A chained hash costs a step of Python per block (about 0.8 µs): a 10k-token conversation re-sent
every turn would hash its 600 blocks again to find the few new ones. So a prompt's chain is kept at
checkpoints, every STRIDE blocks, each keyed by a digest of the packed ids up to it (xxh3-128 in one
pass over the bytes, read out at every checkpoint); a later prompt looks its own checkpoints up,
longest first, and chains on from the one it finds. Exact, not approximate: a key names the very
bytes the chain was computed over, with the root and the block size, so a hit gives what
block_hashes would.

A prompt keeps its last two checkpoints: the last for a prompt that extends it whole (an agent loop,
a completion re-sent longer), the one before for one whose tail changed (a conversation whose
generation prompt gave way to the answer). Prompts shorter than STRIDE blocks are hashed whole and
not kept: that costs no more than the tail a hit leaves to hash. Bounded in bytes (8 per hash), least
recently used out first. Not thread-safe: the gateway routes on its event loop alone.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from radix.hashing import chain_packed, pack_tokens, root_hash
from radix.packed_lru import PackedLRU

# Blocks between checkpoints: what a hit may still have to hash, at most, beyond what is new.
STRIDE = 16
# What an entry costs beside its hashes: key tuple, table slot, array header.
ENTRY_OVERHEAD_BYTES = 256

Key = tuple[int, int, int]


@dataclass(slots=True)
class ChainStats:
    hits: int = 0
    misses: int = 0
    # Blocks whose hash came from a kept chain, and blocks hashed.
    reused_blocks: int = 0
    hashed_blocks: int = 0
    bytes: int = 0
    entries: int = 0


class ChainCache:
    def __init__(self, max_bytes: int, stride: int = STRIDE) -> None:
        if max_bytes < 0 or stride < 1:
            raise ValueError(f"max_bytes must be >= 0 and stride >= 1, got {max_bytes} and {stride}")
        self.stride = stride
        self._chains: PackedLRU[Key] = PackedLRU(max_bytes, ENTRY_OVERHEAD_BYTES)
        self.stats = ChainStats()

    @property
    def max_bytes(self) -> int:
        return self._chains.max_bytes

    def block_hashes(
        self, token_ids: Sequence[int] | np.ndarray, block_size: int, model: str, adapter: str = ""
    ) -> list[int]:
        """radix.block_hashes(token_ids, block_size, model, adapter), from a kept chain where one fits."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        root = root_hash(model, adapter)
        data = pack_tokens(token_ids)
        step = 4 * block_size
        blocks = len(data) // step
        marks = range(self.stride, blocks + 1, self.stride)
        if not marks or self.max_bytes == 0:
            return chain_packed(root, data, block_size)
        keys = _checkpoint_keys(data, step, marks, root, block_size)
        found = self._chains.longest(keys)
        chain, start = ([], 0) if found is None else (found[1].tolist(), marks[found[0]])
        chain += chain_packed(chain[-1] if chain else root, data[start * step : blocks * step], block_size)
        self._keep(chain, marks[-2:], keys[-2:], start)
        return chain

    def _keep(self, chain: list[int], marks: Sequence[int], keys: Sequence[Key], start: int) -> None:
        stats = self.stats
        if start:
            stats.hits += 1
        else:
            stats.misses += 1
        stats.reused_blocks += start
        stats.hashed_blocks += len(chain) - start
        for mark, key in zip(marks, keys, strict=True):
            self._chains.keep(key, array("Q", chain[:mark]))
        stats.bytes, stats.entries = self._chains.bytes, len(self._chains)


def _checkpoint_keys(data: bytes, step: int, marks: range, root: int, block_size: int) -> list[Key]:
    """The key of data's first `mark` blocks, for every mark, in one pass over the bytes."""
    running = xxhash.xxh3_128()
    view = memoryview(data)
    keys = []
    done = 0
    for mark in marks:
        end = mark * step
        running.update(view[done:end])
        done = end
        keys.append((root, block_size, running.intdigest()))
    return keys
