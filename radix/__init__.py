"""Pure routing data: token-block hashing and the radix index of cached prefixes."""

from radix.hashing import block_hashes, chain_hashes, pack_tokens, root_hash
from radix.index import NEVER, RadixIndex

__all__ = ["NEVER", "RadixIndex", "block_hashes", "chain_hashes", "pack_tokens", "root_hash"]
