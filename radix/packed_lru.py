"""Arrays of ids or hashes by key, least recently used out first, within a bound in bytes: what the
gateway's two prefix caches keep (gateway.forward.prefix_cache's token ids of known texts,
radix.chain_cache's block hashes of known prompts). Not thread-safe: a caller shared by threads
holds its own lock around it."""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class PackedLRU(Generic[K]):
    def __init__(self, max_bytes: int, overhead_bytes: int) -> None:
        """`overhead_bytes`: what an entry costs beside its array (key, table slot, array header)."""
        self.max_bytes = max_bytes
        self.overhead_bytes = overhead_bytes
        self.bytes = 0
        self._entries: OrderedDict[K, array[int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, keys: Sequence[K]) -> tuple[int, array[int]] | None:
        """Of `keys` (shortest prefix first), the last one held, as (its position in `keys`, its values:
        the array held, which the caller must not change), now the most recently used; None when none
        is held."""
        entries = self._entries
        for i in range(len(keys) - 1, -1, -1):
            found = entries.get(keys[i])
            if found is not None:
                entries.move_to_end(keys[i])
                return i, found
        return None

    def keep(self, key: K, values: array[int]) -> None:
        """Hold `values` under `key` unless it is held already, then drop the least recently used
        entries until the bound holds again."""
        entries = self._entries
        if key in entries:
            return
        entries[key] = values
        self.bytes += self._cost(values)
        while self.bytes > self.max_bytes and entries:
            _, dropped = entries.popitem(last=False)
            self.bytes -= self._cost(dropped)

    def _cost(self, values: array[int]) -> int:
        return values.itemsize * len(values) + self.overhead_bytes
