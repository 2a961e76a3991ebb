"""The map from a backend's block hashes to the gateway's (gateway.sync.zmq_chains), alone: re-hashed
tokens, what is skipped and why, copies and ambiguous hashes."""

from __future__ import annotations

from collections import Counter
from typing import Any

from gateway.sync.zmq_chains import Chains
from protocol.vllm_kv_events import BlockRemoved, BlockStored
from radix.hashing import block_hashes

MODEL = "test-model"
BS = 16


def ours(tokens: list[int]) -> list[int]:
    return block_hashes(tokens, BS, MODEL)


def stored(hashes: list[Any], parent: Any, tokens: list[int], **fields: Any) -> BlockStored:
    base: dict[str, Any] = {"block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None}
    return BlockStored(hashes, parent, tokens, **(base | fields))


def test_chains_re_hash_tokens_and_map_the_backends_hashes() -> None:
    skipped: Counter[str] = Counter()
    chains = Chains(MODEL, BS, skipped)
    tokens = list(range(1000, 1064))
    # The backend's own hashes are opaque: the same prompt under any hash function maps to ours.
    first = chains.stored(stored([901, 902], None, tokens[:32]))
    assert first == ours(tokens)[:2]
    assert chains.stored(stored([903, 904], 902, tokens[32:])) == ours(tokens)[2:]
    assert chains.stored(stored([999], 555, tokens[:16])) == [], "its parent is unknown here"
    skips = {
        "block_size": stored([1], None, tokens[:32], block_size=32),
        "lora": stored([2], None, tokens[:16], lora_id=1, lora_name="adapter"),
        "extra_keys": stored([3], None, tokens[:16], extra_keys=[("salt",)]),
        "medium": stored([4], None, tokens[:16], medium="CPU"),
        "group": stored([5], None, tokens[:16], group_idx=1, kv_cache_spec_kind="sliding_window"),
        "token_count": stored([6, 7], None, tokens[:16]),
    }
    for event in skips.values():
        assert chains.stored(event) == []
    assert chains.stored(stored([8], 4, tokens[16:32])) == [], "the child of a skipped block is not placed"
    # Counted in blocks: the token_count event names two.
    assert skipped == Counter(dict.fromkeys(skips, 1)) + Counter(unknown_parent=2, token_count=1)
    assert chains.stored(stored([909], None, tokens[:16], extra_keys=[None], group_idx=0)) == ours(tokens)[:1]
    # Removals: the other group's and other media's are not ours; unknown hashes are nothing.
    assert chains.removed(BlockRemoved([904], "GPU", 1)) == []
    assert chains.removed(BlockRemoved([904], "CPU")) == []
    assert chains.removed(BlockRemoved([904, 12345])) == [ours(tokens)[3]]
    assert chains.stored(stored([905], 904, tokens[:16])) == [], "a removed parent is unknown again"


def test_chains_count_copies_and_forget_ambiguous_hashes() -> None:
    chains = Chains(MODEL, BS, Counter())
    a, b = list(range(16)), list(range(100, 116))
    # vLLM may cache one hash in two blocks: the first eviction leaves the other copy cached.
    assert chains.stored(stored([1], None, a)) == chains.stored(stored([1], None, a)) == ours(a)
    assert chains.removed(BlockRemoved([1])) == []
    assert chains.removed(BlockRemoved([1])) == ours(a)
    # SGLang hashes a page's tokens alone: one hash of its may stand for two of our chains.
    page = list(range(200, 216))
    assert chains.stored(stored([7], None, a)) == ours(a)
    assert chains.stored(stored([9], None, b)) == ours(b)
    in_a, in_b = chains.stored(stored([5], 7, page)), chains.stored(stored([5], 9, page))
    assert in_a != in_b
    assert chains.stored(stored([6], 5, a)) == [], "an ambiguous parent cannot be placed"
    assert sorted(chains.removed(BlockRemoved([5]))) == sorted(in_a + in_b), "forget both, never keep"
    chains.clear()
    assert len(chains) == 0
