"""The paged KV pool: which physical block holds which tokens, and which full blocks can be reused.

A full, computed block is registered under its chained hash (radix.hashing), the very hash the
gateway computes for the same tokens, so the worker's cache and the gateway's index agree by
construction. A registered block outlives the sequences that referenced it: once its reference
count drops to 0 it waits in an LRU list, still reusable, until its slot is needed for new tokens.
Every registration and eviction is reported through callbacks, which become the KV events of
docs/design.md §4; replaying them yields exactly `cached_hashes()`. Sequences share blocks by reference
count: on a prefix-cache hit, and as the choices of an n > 1 request, forked off one prefill of
their prompt (`fork`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from radix.hashing import chain_hashes, root_hash
from workers.engine.sequence import Sequence

StoredCallback = Callable[[list[int], int | None], None]
# The same event with the token ids of its blocks (block_size of them per hash, in order): for
# publishers whose format carries tokens (vLLM's, workers/zmq_publisher.py).
StoredTokensCallback = Callable[[list[int], int | None, list[int]], None]
RemovedCallback = Callable[[list[int]], None]
ClearedCallback = Callable[[], None]


def _ignore(*_args: object) -> None:
    return None


@dataclass(slots=True)
class Reservation:
    """Room held for a prompt's KV that another worker computes (prefill/decode disaggregation).

    `held` pins the prompt's prefix this pool already caches, so that it is still here when the rest
    arrives; `blocks` are fresh, unregistered blocks, one for each of `hashes` (the prompt's blocks
    after that prefix, in chain order, chaining from `parent`), that the transferred KV is written
    into. `tokens` are those blocks' token ids, for events that carry them.
    """

    held: list[int]
    parent: int | None
    hashes: list[int]
    blocks: list[int]
    tokens: list[int]


class BlockManager:
    """A fixed pool of `num_blocks` KV blocks of `block_size` tokens. Pure: no torch, no clock."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        model: str,
        adapter: str = "",
        *,
        on_stored: StoredCallback = _ignore,
        on_removed: RemovedCallback = _ignore,
        on_cleared: ClearedCallback = _ignore,
        on_stored_tokens: StoredTokensCallback | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.root = root_hash(model, adapter)
        self._on_stored = on_stored
        self._on_removed = on_removed
        self._on_cleared = on_cleared
        self._on_stored_tokens = on_stored_tokens
        self._ref_counts = [0] * num_blocks
        # The hash a block is registered under (None: private to its sequence, or not full yet).
        self._block_hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Blocks with no references and no registration, ready to hand out.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Registered blocks with no references, least recently released first: the eviction order.
        self._evictable: OrderedDict[int, None] = OrderedDict()

    # -- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could be given now: never used, or cached but unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def cached_hashes(self) -> frozenset[int]:
        """The registered hashes: what a consumer of the callbacks holds (the /kv/snapshot body)."""
        return frozenset(self._by_hash)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # -- prefix reuse -------------------------------------------------------------------------

    def lookup(self, seq: Sequence) -> int:
        """Tokens of `seq` a prefix-cache hit would cover now; never all of them, so that the
        runner still computes the last token and gets the logits to sample from."""
        return len(self._match(seq)) * self.block_size

    def _match(self, seq: Sequence) -> list[int]:
        hashes = self._hashes(seq, (seq.num_tokens - 1) // self.block_size)
        matched: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            matched.append(block)
        return matched

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """The chain hashes of the first `num_blocks` blocks of `seq`, extending its cached chain."""
        known = seq.block_hashes
        if len(known) < num_blocks:
            parent = known[-1] if known else self.root
            bs = self.block_size
            known.extend(chain_hashes(parent, seq.token_slice(len(known) * bs, num_blocks * bs), bs))
        return known[:num_blocks]

    # -- allocation ---------------------------------------------------------------------------

    def admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Give a sequence with no blocks its cached prefix plus room for its first `num_tokens`
        tokens, and mark the prefix computed; all or nothing, so a refusal changes no state.

        The caller sizes `num_tokens` from `lookup()`; it must go past the cached prefix.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} already holds blocks")
        matched = self._match(seq)
        cached = len(matched) * self.block_size
        if not cached < num_tokens <= seq.num_tokens:
            raise ValueError(f"admit needs {cached} < num_tokens <= {seq.num_tokens}, got {num_tokens}")
        revived = sum(1 for b in matched if self._ref_counts[b] == 0)
        new = self.blocks_for(num_tokens) - len(matched)
        if new > self.num_free_blocks - revived:
            return False
        for b in matched:
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1
        seq.block_table = matched + self._take(new)
        seq.num_computed_tokens = cached
        return True

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for the first `num_tokens` tokens of `seq`; all or nothing."""
        new = self.blocks_for(num_tokens) - len(seq.block_table)
        if new <= 0:
            return True
        if new > self.num_free_blocks:
            return False
        seq.block_table.extend(self._take(new))
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give a child with no blocks the parent's full computed blocks, by reference: no KV is
        copied, and each shared block's reference count grows by one.

        The parent's last, partial block is not shared: the child's own tokens go after the prompt's
        tail in that block, and they differ from the parent's. Rather than copy the block on write,
        the child recomputes the tail (at most block_size - 1 tokens) together with its first
        sampled token in its next chunk, a step it runs anyway. A prompt that fills its last block
        leaves the child a plain decode.
        """
        if child.block_table:
            raise ValueError(f"sequence {child.seq_id} already holds blocks")
        full = parent.num_computed_tokens // self.block_size
        shared = parent.block_table[:full]
        for block in shared:
            self._ref_counts[block] += 1
        child.block_table = shared
        child.num_computed_tokens = full * self.block_size
        child.block_hashes = self._hashes(parent, full)

    def _take(self, count: int) -> list[int]:
        """`count` blocks with one reference each: never-used ones first, then LRU evictions."""
        taken: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                h = self._block_hash[block]
                assert h is not None
                del self._by_hash[h]
                self._block_hash[block] = None
                evicted.append(h)
            self._ref_counts[block] = 1
            taken.append(block)
        if evicted:
            self._on_removed(evicted)
        return taken

    def mark_computed(self, seq: Sequence, num_tokens: int) -> None:
        """Record that the KV of `num_tokens` more tokens of `seq` is written, and register every
        block this fills. A hash some other block already holds keeps its mapping: the copy stays
        private to `seq` and no duplicate event goes out."""
        bs = self.block_size
        first = seq.num_computed_tokens // bs
        seq.num_computed_tokens += num_tokens
        if seq.num_computed_tokens > len(seq.block_table) * bs:
            raise ValueError(f"sequence {seq.seq_id} computed past its blocks")
        end = seq.num_computed_tokens // bs
        if end <= first:
            return
        hashes = self._hashes(seq, end)
        run: list[int] = []
        run_start = first
        for i in range(first, end):
            h = hashes[i]
            block = seq.block_table[i]
            if h in self._by_hash:
                if run:
                    self._stored(seq, hashes, run_start, run)
                    run = []
                continue
            if not run:
                run_start = i
            self._by_hash[h] = block
            self._block_hash[block] = h
            run.append(h)
        if run:
            self._stored(seq, hashes, run_start, run)

    def _stored(self, seq: Sequence, hashes: list[int], start: int, run: list[int]) -> None:
        """Report the newly registered blocks `run`, blocks start.. of `seq` (whose hashes are `hashes`)."""
        parent = hashes[start - 1] if start else None
        self._on_stored(run, parent)
        if self._on_stored_tokens is not None:
            bs = self.block_size
            self._on_stored_tokens(run, parent, seq.token_slice(start * bs, (start + len(run)) * bs))

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s references (finish, abort or preemption); its KV is gone for it."""
        self.unhold(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def unhold(self, blocks: list[int]) -> None:
        """Drop one reference to each of `blocks`, a prefix's blocks in chain order (a sequence's, or
        what `hold` pinned).

        Released registered blocks join the LRU tail-first, so a prefix is evicted from its end
        inward and the shared head of a family of prompts is the last part to go.
        """
        for block in reversed(blocks):
            self._ref_counts[block] -= 1
            if self._ref_counts[block]:
                continue
            if self._block_hash[block] is None:
                self._free.append(block)
            else:
                self._evictable[block] = None

    # -- KV that moves between workers (prefill/decode disaggregation) ---------------------------

    def prompt_hashes(self, token_ids: list[int]) -> list[int]:
        """The chain hashes of the prompt blocks a prefix-cache hit could cover (never its last
        token: see `lookup`), which are the blocks worth moving from a prefill worker."""
        usable = (len(token_ids) - 1) // self.block_size * self.block_size
        return chain_hashes(self.root, token_ids[:usable], self.block_size)

    def hold(self, hashes: list[int]) -> list[int]:
        """Pin the longest prefix of `hashes` registered here, so that no eviction takes it until
        `unhold`; its blocks, in chain order."""
        held: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
            held.append(block)
        return held

    def reserve(self, token_ids: list[int]) -> Reservation | None:
        """Hold what this pool caches of a prompt and take fresh blocks for the rest of its reusable
        blocks, to receive them from a prefill worker; None, changing nothing, if they do not fit."""
        hashes = self.prompt_hashes(token_ids)
        held = self.hold(hashes)
        missing = len(hashes) - len(held)
        if missing > self.num_free_blocks:
            self.unhold(held)
            return None
        bs = self.block_size
        start = len(held)
        return Reservation(
            held=held,
            parent=hashes[start - 1] if start else None,
            hashes=hashes[start:],
            blocks=self._take(missing),
            tokens=token_ids[start * bs : len(hashes) * bs],
        )

    def install(self, reservation: Reservation, received: int) -> None:
        """Register the first `received` reserved blocks, whose KV has arrived, as computed blocks
        under their hashes, as if computed here (with their events), and let the reservation go: the
        rest, which never arrived, are freed. A hash registered here meanwhile keeps its block, and
        the arrived copy is freed."""
        if not 0 <= received <= len(reservation.blocks):
            raise ValueError(f"received {received} of {len(reservation.blocks)} reserved blocks")
        run: list[int] = []
        parent = reservation.parent
        for i, (h, block) in enumerate(zip(reservation.hashes[:received], reservation.blocks, strict=False)):
            if h in self._by_hash:
                self._announce(run, parent, reservation, i)
                run, parent = [], h
                continue
            self._by_hash[h] = block
            self._block_hash[block] = h
            run.append(h)
        self._announce(run, parent, reservation, received)
        self.release(reservation)

    def _announce(self, run: list[int], parent: int | None, reservation: Reservation, end: int) -> None:
        """The stored event of installed blocks `run`, the reservation's blocks up to `end`."""
        if not run:
            return
        self._on_stored(run, parent)
        if self._on_stored_tokens is not None:
            bs = self.block_size
            self._on_stored_tokens(run, parent, reservation.tokens[(end - len(run)) * bs : end * bs])

    def release(self, reservation: Reservation) -> None:
        """Let a reservation go (after `install`, or when its transfer failed or its client left):
        the held prefix becomes evictable again and unregistered blocks go back to the free list."""
        self.unhold(reservation.held + reservation.blocks)
        reservation.held, reservation.blocks = [], []

    def reset(self) -> None:
        """Forget every registration (a cache flush); blocks in use stay with their sequences."""
        for block in self._by_hash.values():
            self._block_hash[block] = None
            if self._ref_counts[block] == 0:
                self._free.append(block)
        self._by_hash.clear()
        self._evictable.clear()
        self._on_cleared()
