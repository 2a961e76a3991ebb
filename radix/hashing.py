"""Chained token-block hashes (docs/design.md §3): the one function the gateway and the workers share.

A block's hash names the whole prefix up to and including it, so two replicas that hold the same
hash hold the same prefix, and the index never needs the parent chain to compare prefixes.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

import numpy as np
import xxhash

_xxh3 = xxhash.xxh3_64_intdigest
_NEEDS_BYTESWAP = sys.byteorder != "little"
assert array.array("I").itemsize == 4, "prefixgate needs a platform whose C unsigned int is 32 bits"


def root_hash(model: str, adapter: str = "") -> int:
    """The parent of every first block: it keeps different models and adapters apart."""
    return _xxh3(b"prefixgate/1\0" + model.encode() + b"\0" + adapter.encode())


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32, the byte layout every block hash is taken over.

    A numpy array (what a tokenizer hands out with return_tensors="np") packs without a Python
    loop: for an 8k-token prompt that is a quarter of the whole hashing time.
    """
    if isinstance(token_ids, np.ndarray):
        if (
            token_ids.dtype != np.uint32
            and token_ids.size
            and (token_ids.min() < 0 or token_ids.max() > 0xFFFFFFFF)
        ):
            raise OverflowError("token ids must fit in an unsigned 32-bit integer")
        return token_ids.astype("<u4", copy=False).tobytes()
    if isinstance(token_ids, array.array) and token_ids.typecode == "I":
        packed = token_ids if not _NEEDS_BYTESWAP else array.array("I", token_ids)
    else:
        packed = array.array("I", token_ids)
    if _NEEDS_BYTESWAP:
        packed.byteswap()
    return packed.tobytes()


def chain_hashes(parent: int, token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """Hashes of the full blocks of `token_ids`, continuing the chain after `parent`.

    This is the incremental form: a worker extends a sequence's chain as its blocks fill, passing
    the last hash it has as `parent`; a partial trailing block is left out.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    return chain_packed(parent, pack_tokens(token_ids), block_size)


def chain_packed(parent: int, data: bytes, block_size: int) -> list[int]:
    """chain_hashes over ids already packed (pack_tokens): one full block every 4 * block_size bytes."""
    step = 4 * block_size
    end = len(data) // step * step
    out: list[int] = []
    append = out.append
    h = parent
    for offset in range(0, end, step):
        h = _xxh3(h.to_bytes(8, "little") + data[offset : offset + step])
        append(h)
    return out


def block_hashes(
    token_ids: Sequence[int] | np.ndarray, block_size: int, model: str, adapter: str = ""
) -> list[int]:
    """Unsigned 64-bit hashes of every full block of a prompt, each naming its whole prefix."""
    return chain_hashes(root_hash(model, adapter), token_ids, block_size)
