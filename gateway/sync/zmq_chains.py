"""How a replica's vLLM-format KV events (gateway.sync.zmq_events) name blocks in the gateway's hashes.

Hashes. A backend's block hashes are its own (vLLM's depend on its hash function and seed, SGLang's
are not even chained), so every stored block is re-hashed from its token ids with docs/design.md §3, chained
from the replica's model root, and each replica keeps the map from the backend's hashes to ours.
A `BlockStored` whose parent is None starts at the root; one whose parent the map does not hold
cannot be placed — its chain began before what this follower saw (or in blocks it does not route on)
— so it is skipped, and with it every later block that chains from it, until the backend stores that
prefix again from its first block. The index then lacks what it cannot name, and never holds what
the backend does not: it is exact as far as the history reaches, and a subset of the truth beyond.

What is not routed on is skipped the same way, counted by reason in the follower's state: blocks of
another block size than the replica's configured `block_size` (the gateway hashes requests with that
one: set it to the backend's), of a LoRA adapter, keyed on more than their tokens (`extra_keys`:
multimodal inputs, cache salt), on a medium other than the GPU (offloaded copies), or in a KV cache
group that is not full attention (hybrid models). Removals of skipped blocks find nothing to remove.
A backend may cache one hash in several blocks: a removal drops one copy, and the index forgets the
block when the last copy goes.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

from protocol.vllm_kv_events import MEDIUM_GPU, BlockHash, BlockRemoved, BlockStored
from radix.hashing import chain_hashes, root_hash

FULL_ATTENTION = "full_attention"

SkipReason = Literal["block_size", "lora", "extra_keys", "medium", "group", "unknown_parent", "token_count"]


class Chains:
    """One replica's map from the backend's block hashes to ours (module docstring), each with the
    number of copies the backend caches. Pure: no I/O."""

    def __init__(self, model: str, block_size: int, skipped: Counter[str]) -> None:
        self.root = root_hash(model)
        self.block_size = block_size
        self.skipped = skipped
        # backend hash -> {our hash: copies}; more than one of ours only from a backend whose hashes
        # are not chained (SGLang hashes a page's tokens alone).
        self._ours: dict[BlockHash, dict[int, int]] = {}
        # KV cache groups seen to be other than full attention: their removals are not ours either.
        self._other_groups: set[int] = set()

    def __len__(self) -> int:
        return len(self._ours)

    def clear(self) -> None:
        self._ours.clear()
        self._other_groups.clear()

    def _skip(self, event: BlockStored) -> SkipReason | None:
        if event.kv_cache_spec_kind not in (None, FULL_ATTENTION):
            if event.group_idx is not None:
                self._other_groups.add(event.group_idx)
            return "group"
        if event.medium not in (None, MEDIUM_GPU):
            return "medium"
        if event.block_size != self.block_size:
            return "block_size"
        if event.lora_id is not None or event.lora_name is not None:
            return "lora"
        if event.extra_keys and any(key is not None for key in event.extra_keys):
            return "extra_keys"
        if len(event.token_ids) != len(event.block_hashes) * self.block_size:
            return "token_count"
        return None

    def _parent(self, backend: BlockHash | None) -> int | None:
        if backend is None:
            return self.root
        ours = self._ours.get(backend)
        return next(iter(ours)) if ours is not None and len(ours) == 1 else None

    def stored(self, event: BlockStored) -> list[int]:
        """Our hashes of the event's blocks, now mapped; [] when they cannot be placed (counted)."""
        reason = self._skip(event)
        parent = self._parent(event.parent_block_hash) if reason is None else None
        if parent is None:
            self.skipped[reason or "unknown_parent"] += len(event.block_hashes)
            return []
        ours = chain_hashes(parent, event.token_ids, self.block_size)
        for backend, h in zip(event.block_hashes, ours, strict=True):
            copies = self._ours.setdefault(backend, {})
            copies[h] = copies.get(h, 0) + 1
        return ours

    def removed(self, event: BlockRemoved) -> list[int]:
        """Our hashes of which the backend no longer caches any copy."""
        if event.medium not in (None, MEDIUM_GPU) or event.group_idx in self._other_groups:
            return []
        gone: list[int] = []
        for backend in event.block_hashes:
            copies = self._ours.get(backend)
            if copies is None:
                continue
            if len(copies) == 1:
                ((h, count),) = copies.items()
                if count > 1:
                    copies[h] = count - 1
                    continue
            # The last copy, or an ambiguous hash: forgetting too much is safe, keeping too much is not.
            gone.extend(copies)
            del self._ours[backend]
        return gone
