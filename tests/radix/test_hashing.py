"""docs/design.md §3 block hashing: golden vectors, an independent reference, and the incremental form."""

import random
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from radix.hashing import block_hashes, chain_hashes, pack_tokens, root_hash


def reference(tokens: list[int], block_size: int, model: str, adapter: str = "") -> list[int]:
    h = xxhash.xxh3_64_intdigest(b"prefixgate/1\0" + model.encode() + b"\0" + adapter.encode())
    out = []
    for i in range(0, len(tokens) // block_size * block_size, block_size):
        h = xxhash.xxh3_64_intdigest(
            struct.pack("<Q", h) + struct.pack(f"<{block_size}I", *tokens[i : i + block_size])
        )
        out.append(h)
    return out


def test_golden_vectors() -> None:
    # Literal values: any change to the hash function, its byte layout or its root breaks these.
    assert root_hash("SmolLM2-135M-Instruct") == 0x8614DCE4FC4ECFDB
    assert root_hash("m", "a") == 0x6A1D83B04426EE4C
    assert block_hashes(list(range(40)), 16, "SmolLM2-135M-Instruct") == [
        0x5D98B0CD6FF654F8,
        0x942B7DEDECC47238,
    ]
    assert block_hashes([4294967295] * 4 + [0, 1, 2, 3], 4, "m", "lora-x") == [
        0x17EA61BBFD0B4403,
        0x9C8C7CDB1AADE378,
    ]
    assert block_hashes(list(range(1000, 1512)), 256, "Llama-3-8B") == [
        0x5F8FA3259D9F9D27,
        0x87BAA987B9475045,
    ]


@pytest.mark.fuzz
@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    block_size=st.sampled_from([1, 4, 16, 64]),
    model=st.text(max_size=12),
    adapter=st.text(max_size=6),
)
def test_matches_reference(tokens: list[int], block_size: int, model: str, adapter: str) -> None:
    assert block_hashes(tokens, block_size, model, adapter) == reference(tokens, block_size, model, adapter)


def test_only_full_blocks_and_unsigned_64() -> None:
    tokens = [random.Random(3).randrange(50_000) for _ in range(47)]
    hashes = block_hashes(tokens, 16, "m")
    assert len(hashes) == 2
    assert all(0 <= h < 2**64 for h in hashes)
    assert block_hashes(tokens[:15], 16, "m") == []


def test_hash_names_the_whole_prefix() -> None:
    a = list(range(64))
    b = [999, *a[1:]]
    # Same second block, different first block: every hash differs.
    assert not set(block_hashes(a, 16, "m")) & set(block_hashes(b, 16, "m"))
    # Models and adapters are kept apart from the root.
    assert block_hashes(a, 16, "m")[0] != block_hashes(a, 16, "n")[0]
    assert block_hashes(a, 16, "m")[0] != block_hashes(a, 16, "m", "lora")[0]


def test_incremental_chain_equals_one_shot() -> None:
    tokens = list(range(100))
    whole = block_hashes(tokens, 16, "m")
    first = chain_hashes(root_hash("m"), tokens[:48], 16)
    rest = chain_hashes(first[-1], tokens[48:96], 16)
    assert first + rest == whole


def test_pack_layout_is_little_endian_uint32() -> None:
    assert pack_tokens([1, 0x01020304]) == b"\x01\x00\x00\x00\x04\x03\x02\x01"


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_token_ids_out_of_uint32_range_fail_loudly(bad: list[int]) -> None:
    with pytest.raises(OverflowError):
        block_hashes(bad * 16, 16, "m")


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0, "m")


def test_numpy_input_hashes_like_a_list() -> None:
    tokens = [random.Random(9).randrange(2**32) for _ in range(100)]
    for dtype in (np.uint32, np.int64, np.uint64):
        assert block_hashes(np.array(tokens, dtype=dtype), 16, "m") == block_hashes(tokens, 16, "m")
    with pytest.raises(OverflowError):
        block_hashes(np.array([-1] * 16, dtype=np.int64), 16, "m")
    with pytest.raises(OverflowError):
        block_hashes(np.array([2**32] * 16, dtype=np.int64), 16, "m")
