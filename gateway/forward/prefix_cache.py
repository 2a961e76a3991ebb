"""Token ids of texts seen before, so that a growing conversation is tokenized only where it grew.

A multi-turn client sends its whole history every turn; the gateway renders it through the chat
template (string work, cheap) and would tokenize all of it again (the expensive part: about 1 ms per
thousand tokens of one core). Turn k+1's text starts with turn k's, up to where turn k asked for the
assistant's answer, so the ids of that prefix are kept and only the rest is tokenized.

Exact, not approximate: ids(a + b) == ids(a) + ids(b) whenever `b` begins with a special added token
that does not strip the whitespace before it (`lstrip`), because the tokenizer splits such tokens out
of the text before anything else runs, and tokenizes what lies between them piece by piece. The
template's own turn markers (`<|im_start|>`, `<|start_header_id|>`) are such tokens, so a cut just
before one of them is safe; texts are cut nowhere else. For the same reason what is new of a text
is encoded in one piece, and the ids of a prefix to keep are read off it at the marker's id. A
prefix is found by the digest of its text (BLAKE2b, 128 bits: content addressed, so a hit is the same
text whoever sent it), taken at the last LOOKBACK cuts in one pass, and at every cut when none of
those is known; the longest one known wins. A tokenizer whose markers would not split exactly
(checked once on a sample when the cache is made) gets no cache.

Bounded in bytes (the ids packed four bytes each), least recently used out first. It is called from
the event loop and the tokenizer threads, hence the lock around the table; tokenizing runs outside it.
A caller that tokenizes only a little where it runs (the event loop, gateway.forward.tokenizers)
passes an Allowance: past it, encode raises TooLong before it tokenizes or keeps anything.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tokenizers

from protocol.tokenizer import encode_ids
from radix.packed_lru import PackedLRU

Encode = Callable[[str], list[int]]

# What an entry costs beside its ids: key, table slot, array header (measured with tracemalloc: ~170).
ENTRY_OVERHEAD_BYTES = 192
# Prefixes shorter than this are tokenized faster than looked up and copied.
MIN_PREFIX_CHARS = 256
# Cuts looked up first, from the last: a conversation's next turn continues at its third-last cut (the
# previous turn's generation prompt gave way to the answer), a new conversation on a known system
# prompt at its second-last.
LOOKBACK = 4


class TooLong(Exception):
    """More is left to tokenize than the caller's Allowance."""


@dataclass(slots=True)
class Allowance:
    """The characters a caller will still tokenize where it runs, over all of one prompt's encodes."""

    chars: int

    def take(self, chars: int) -> None:
        if chars > self.chars:
            raise TooLong(f"{chars} characters to tokenize, {self.chars} allowed")
        self.chars -= chars


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
    def __init__(self, encode: Encode, marker: str, marker_id: int, max_bytes: int) -> None:
        self._encode = encode
        self.marker = marker
        self.marker_id = marker_id
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
        marker_id = backend.token_to_id(marker)
        if marker_id is None or encode(marker) != [marker_id]:
            return None
        cache = cls(encode, marker, marker_id, max_bytes)
        cuts = cache.cuts(sample)
        pieces = [sample[a:b] for a, b in itertools.pairwise([0, *cuts, len(sample)])]
        if not cuts or [i for piece in pieces for i in encode(piece)] != encode(sample):
            return None
        return cache

    def cuts(self, text: str) -> list[int]:
        """Where `text` may be cut: before each marker, past MIN_PREFIX_CHARS, in order."""
        marker, found = self.marker, []
        at = text.find(marker, MIN_PREFIX_CHARS)
        while at != -1:
            found.append(at)
            at = text.find(marker, at + len(marker))
        return found

    def encode(self, text: str, allowance: Allowance | None = None) -> Sequence[int]:
        """The ids of `text`, exactly as the tokenizer gives them: the longest known prefix's, then the
        rest's, which `allowance` (if any) must cover. The prefixes up to the text's last two cuts are
        kept (the last: where the next turn of this conversation will continue; the one before: the
        start of the last message, which a new conversation on the same system prompt shares).

        Where some are known the ids come packed (array('I')), as they are kept and as the hashes are
        taken over them: made a list, a conversation's thousands of ids would cost 0.1 ms of int
        objects at every turn, and as much again packed back to be hashed."""
        cuts = self.cuts(text)
        if not cuts:
            if allowance is not None:
                allowance.take(len(text))
            return self._encode(text)
        recent = _digests(text, cuts[-LOOKBACK:])
        found = self._longest(text, cuts, recent)
        known, start = (array("I"), 0) if found is None else (found[1], cuts[found[0]])
        if allowance is not None:
            allowance.take(len(text) - start)
        rest = self._encode(text[start:])
        # The ids up to a kept cut end before the marker that starts there: every marker in the text
        # is one marker id (a special token is split out before anything else), so the cut's ids are
        # counted by the markers before it.
        markers = [i for i, token in enumerate(rest) if token == self.marker_id]
        new = [
            (digest, known + array("I", rest[: markers[text.count(self.marker, start, at)]]))
            for at, digest in zip(cuts[-2:], recent[-2:], strict=True)
            if at > start
        ]
        self._record(new, len(known), len(rest))
        return known + array("I", rest)

    def _longest(self, text: str, cuts: list[int], recent: list[bytes]) -> tuple[int, array[int]] | None:
        """The longest known prefix of `text` ending at a cut: its cut's position and its ids. The last
        cuts are tried first, from `recent` (their digests); the others only when none of those is
        known (a new conversation, or one edited far back), with a digest taken at every one."""
        earlier = len(cuts) - len(recent)
        with self._lock:
            found = self._prefixes.longest(recent)
        if found is not None:
            return earlier + found[0], found[1]
        if not earlier:
            return None
        digests = _digests(text, cuts[:earlier])
        with self._lock:
            return self._prefixes.longest(digests)

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
