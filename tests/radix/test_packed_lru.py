"""PackedLRU: the longest held key of a list wins and is refreshed, a held key is not replaced, and the
least recently used entries go first when the bound is passed."""

from __future__ import annotations

from array import array

from radix.packed_lru import PackedLRU


def test_the_last_held_key_is_found_and_refreshed() -> None:
    lru: PackedLRU[str] = PackedLRU(max_bytes=10_000, overhead_bytes=0)
    lru.keep("a", array("I", [1]))
    lru.keep("ab", array("I", [1, 2]))
    assert lru.longest(["a", "ab", "abc"]) == (1, array("I", [1, 2]))
    assert lru.longest(["a"]) == (0, array("I", [1]))
    assert lru.longest(["x", "y"]) is None and lru.longest([]) is None


def test_a_held_key_keeps_its_values() -> None:
    lru: PackedLRU[str] = PackedLRU(max_bytes=10_000, overhead_bytes=10)
    lru.keep("a", array("Q", [1, 2]))
    lru.keep("a", array("Q", [9]))
    assert lru.longest(["a"]) == (0, array("Q", [1, 2])) and lru.bytes == 2 * 8 + 10 and len(lru) == 1


def test_the_least_recently_used_go_first_past_the_bound() -> None:
    lru: PackedLRU[int] = PackedLRU(max_bytes=3 * (4 * 4 + 8), overhead_bytes=8)
    for key in range(3):
        lru.keep(key, array("I", [key] * 4))
    assert lru.longest([0]) is not None  # 0 is now the most recent; 1 the least
    lru.keep(3, array("I", [3] * 4))
    assert lru.longest([1]) is None
    assert all(lru.longest([k]) is not None for k in (0, 2, 3))
    assert lru.bytes == 3 * (4 * 4 + 8) and len(lru) == 3


def test_an_entry_larger_than_the_bound_is_not_kept() -> None:
    lru: PackedLRU[int] = PackedLRU(max_bytes=16, overhead_bytes=0)
    lru.keep(1, array("I", [0] * 8))
    assert len(lru) == 0 and lru.bytes == 0
