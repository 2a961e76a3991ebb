"""Block managers for tests: one whose events a consumer checks, and sequences admitted into it."""

from __future__ import annotations

from workers.engine.block_manager import BlockManager
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

MODEL = "test-model"


class Events:
    """A consumer of the callbacks, as the gateway's index would be: it must end up with exactly
    the manager's registered set, and never see a hash stored twice or removed while absent."""

    def __init__(self) -> None:
        self.held: set[int] = set()
        self.log: list[tuple[str, object]] = []

    def stored(self, hashes: list[int], parent: int | None) -> None:
        assert hashes, "empty stored event"
        assert not self.held.intersection(hashes), "a hash was stored twice"
        self.held.update(hashes)
        self.log.append(("stored", (list(hashes), parent)))

    def removed(self, hashes: list[int]) -> None:
        assert hashes, "empty removed event"
        assert self.held.issuperset(hashes), "an absent hash was removed"
        self.held.difference_update(hashes)
        self.log.append(("removed", list(hashes)))

    def cleared(self) -> None:
        self.held.clear()
        self.log.append(("cleared", None))


def make_manager(num_blocks: int, block_size: int = 4) -> tuple[BlockManager, Events]:
    events = Events()
    bm = BlockManager(
        num_blocks,
        block_size,
        MODEL,
        on_stored=events.stored,
        on_removed=events.removed,
        on_cleared=events.cleared,
    )
    return bm, events


def make_seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, list(tokens), SamplingParams(max_tokens=8), arrival_time=0.0)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    """Admit `seq` and compute its whole prompt in one chunk."""
    cached = bm.lookup(seq)
    assert bm.admit(seq, seq.num_tokens)
    assert seq.num_computed_tokens == cached
    bm.mark_computed(seq, seq.num_tokens - cached)
