"""Token ids of texts seen before, so that a growing conversation is tokenized only where it grew.

A multi-turn client sends its whole history every turn; the gateway renders it through the chat
template (string work, cheap) and would tokenize all of it again (the expensive part: about 1 ms per
thousand tokens of one core). Turn k+1's text starts with turn k's, up to where turn k asked for the
assistant's answer, so the ids of that prefix are kept and only the rest is tokenized.

Exact, not approximate: ids(a + b) == ids(a) + ids(b) whenever `b` begins with a special added token
that does not strip the whitespace before it (`lstrip`), because the tokenizer splits such tokens out
of the text before anything else runs, and tokenizes what lies between them piece by piece. The
template's own turn markers (`<|im_start|>`, `<|start_header_id|>`) are such tokens, so a cut just
before one of them is safe; texts are cut nowhere else. A prefix is found by the digest of its text
(BLAKE2b, 128 bits: content addressed, so a hit is the same text whoever sent it), taken at every cut
in one pass; the longest one known wins. A tokenizer whose markers would not split exactly (checked
once on a sample when the cache is made) gets no cache.

Bounded in bytes (the ids packed four bytes each), least recently used out first. It is called from
the tokenizer threads, hence the lock around the table; tokenizing runs outside it.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import tokenizers

from protocol.tokenizer import encode_ids
from radix.packed_lru import PackedLRU

Encode = Callable[[str], list[int]]

# What an entry costs beside its ids: key, table slot, array header (measured with tracemalloc: ~170).
ENTRY_OVERHEAD_BYTES = 192
# Prefixes shorter than this are tokenized faster than looked up and copied.
MIN_PREFIX_CHARS = 256


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    # Ids taken from the cache instead of tokenized.
    reused_tokens: int = 0
    tokenized_tokens: int = 0
    bytes: int = 0
    entries: int = 0


class PrefixCache:
    def __init__(self, encode: Encode, markers: tuple[str, ...], max_bytes: int) -> None:
        self._encode = encode
        self.markers = markers
        self._prefixes: PackedLRU[bytes] = PackedLRU(max_bytes, ENTRY_OVERHEAD_BYTES)
        self._lock = threading.Lock()
        self.stats = CacheStats()

    @classmethod
    def of(cls, backend: tokenizers.Tokenizer, sample: str, max_bytes: int) -> PrefixCache | None:
        """The cache of a tokenizer, cut before its turn marker: the special token the `sample` (a
        rendered conversation) holds most often. None when it has none, the bound is zero, or a cut
        before it does not give the ids of the whole on the sample."""

        def encode(text: str) -> list[int]:
            return encode_ids(backend, text)

        if max_bytes <= 0:
            return None
        safe = [t.content for t in backend.get_added_tokens_decoder().values() if t.special and not t.lstrip]
        counts = Counter({token: sample.count(token) for token in safe if token and token in sample})
        if not counts:
            return None
        marker = min(counts, key=lambda token: (-counts[token], sample.index(token)))
        cache = cls(encode, (marker,), max_bytes)
        cuts = cache.cuts(sample)
        pieces = [sample[a:b] for a, b in itertools.pairwise([0, *cuts, len(sample)])]
        if not cuts or [i for piece in pieces for i in encode(piece)] != encode(sample):
            return None
        return cache

    def cuts(self, text: str) -> list[int]:
        """Where `text` may be cut: before each marker, past MIN_PREFIX_CHARS, in order."""
        found = []
        for marker in self.markers:
            at = text.find(marker, MIN_PREFIX_CHARS)
            while at != -1:
                found.append(at)
                at = text.find(marker, at + len(marker))
        return sorted(found)

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, exactly as the tokenizer gives them: the longest known prefix's, then the
        rest's. The prefixes up to the text's last two cuts are kept (the last: where the next turn of
        this conversation will continue; the one before: the start of the last message, which a new
        conversation on the same system prompt shares)."""
        cuts = self.cuts(text)
        if not cuts:
            return self._encode(text)
        digests = _digests(text, cuts)
        with self._lock:
            found = self._prefixes.longest(digests)
        ids, start = ([], 0) if found is None else (found[1], cuts[found[0]])
        reused = len(ids)
        kept = {at: digest for at, digest in zip(cuts[-2:], digests[-2:], strict=True) if at > start}
        bounds = [start, *kept, len(text)]
        new: list[tuple[bytes, array[int]]] = []
        for a, b in itertools.pairwise(bounds):
            ids += self._encode(text[a:b])
            if b in kept:
                new.append((kept[b], array("I", ids)))
        self._record(new, reused, len(ids) - reused)
        return ids

    def _record(self, new: list[tuple[bytes, array[int]]], reused: int, tokenized: int) -> None:
        with self._lock:
            stats = self.stats
            for digest, packed in new:
                self._prefixes.keep(digest, packed)
            stats.bytes, stats.entries = self._prefixes.bytes, len(self._prefixes)
            if reused:
                stats.hits += 1
            else:
                stats.misses += 1
            stats.reused_tokens += reused
            stats.tokenized_tokens += tokenized


def _digests(text: str, cuts: list[int]) -> list[bytes]:
    """The digest of text[:cut] for every cut, in one pass over the text."""
    running = hashlib.blake2b(digest_size=16)
    digests = []
    last = 0
    for cut in cuts:
        running.update(text[last:cut].encode("utf-8", "surrogatepass"))
        digests.append(running.copy().digest())
        last = cut
    return digests
