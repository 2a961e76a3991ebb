"""Per-model tokenizers: the ones the workers use (protocol.tokenizer), so the gateway's block hashes
are theirs, loaded before the gateway says it is ready.

Ready means ready: the gateway loads (and warms, with one prompt through the chat template and the
encoder) the tokenizer of every model it knows at start-up before it listens, so its first request
costs what its second does. A model that appears later (a replica registering through Redis) has its
tokenizer loaded in the background; until then its requests are routed by load alone, never held up
and never refused.

What one prompt may cost is bounded (`limits`): its first max_tokenized_chars characters are
tokenized, its first max_routed_tokens ids routed on (a client's ids too); a prompt's head still names
its prefix. Ids the gateway did not get from the whole prompt are never attached to what a bundled
worker gets (`Prompt.tokenized`): that worker tokenizes the prompt itself.

Tokenizing runs off the event loop, and without the GIL (protocol.tokenizer), on two threads: one
for short prompts and one for long ones, so a long prompt waits only behind other long ones, and a
burst of them never delays a short one nor takes more than one core. Past LONG_QUEUE long prompts
waiting, another is routed by load instead of waiting too. A prompt with little left to encode is
tokenized on the event loop instead, where the hop to a thread and back would cost more than the
encoding (INLINE_CHARS): a short one, or a conversation turn whose history the prefix cache knows.
Rendering and the cache's lookups are Python, which holds the GIL wherever it runs, so they cost the
loop the same there as on a thread. A turn that turns out to have more to encode is handed to the
thread whole, nothing kept of the try.

A model configured with `tokenizer: none` routes without prefix information unless the client sends
token ids: its replicas still get the request, the prompt just matches nothing. One configured with
`tokenizer: text` is routed on its prompt's text (gateway.forward.text_ids), on the event loop: there
is nothing to load, and nothing to encode but a JSON dump.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import orjson

from gateway.forward.prefix_cache import Allowance, CacheStats, PrefixCache, TooLong
from gateway.forward.request_view import RequestView, prompt_ids
from gateway.forward.text_ids import text_ids
from gateway.gateway_config import TEXT_SPEC, Limits
from protocol.models import load_tokenizer_spec
from protocol.tokenizer import ChatTemplateError, HeadTokenizer, Tokenizer, encode_ids

log = logging.getLogger("prefixgate.gateway.tokenizers")

# Prompts of more characters than this (their text, or their messages and tools as JSON) are long:
# about 30 ms of tokenizing.
SHORT_PROMPT_CHARS = 32_768
# Long prompts waiting or being tokenized at most (about max_tokenized_chars each: a few seconds in all).
LONG_QUEUE = 8
# Characters a prompt may have left to encode on the event loop, past what the prefix cache knows:
# about 0.2 ms of encoding here, less than a hop to the tokenizer thread and back (docs/benchmarks.md).
INLINE_CHARS = 1024
# Prompts of at most this many characters are tried on the event loop when they could be cheap there
# (a conversation with history): rendering and looking up about 0.3 ms of Python at most.
INLINE_TRY_CHARS = 65_536

# A conversation through the template and the encoder once, so that the first request finds both warm;
# rendered, the sample on which a tokenizer's prefix cache is checked (gateway.forward.prefix_cache).
_WARM_UP = RequestView(
    "chat",
    messages=[
        {"role": "system", "content": "You are a warm-up. " * 12},
        {"role": "user", "content": "Hello! How are you today?"},
        {"role": "assistant", "content": "Very well, thank you. And you?"},
        {"role": "user", "content": "Fine. Tell me about tokenizers."},
    ],
)


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt as routing takes it."""

    # The ids routed on: the prompt's first limits.max_routed_tokens ids at most (token ids, or the
    # text's own ids for a model routed on its text: gateway.forward.text_ids).
    ids: Sequence[int]
    # Whether the gateway tokenized the whole prompt itself and `ids` are all of it: only then are
    # they attached to what a bundled worker gets (a client's own ids go as the client sent them).
    tokenized: bool
    # Whether `ids` are all of the prompt's token ids (the gateway's or the client's): only then can a
    # bundled worker's stream be continued from them elsewhere (gateway.forward.migration).
    whole: bool

    @property
    def token_ids(self) -> Sequence[int] | None:
        """The prompt's whole token ids, when routing has them (a list, or packed: array('I'))."""
        return self.ids if self.whole else None


class Tokenizers:
    def __init__(self, specs: dict[str, str], *, cache_bytes: int, default_spec: str = "default") -> None:
        self._specs = dict(specs)
        self._default = default_spec
        self._cache_bytes = cache_bytes
        # Per loaded model, the ids of the prompt prefixes it saw last (None: that tokenizer has none).
        self._caches: dict[str, PrefixCache | None] = {}
        # Loaded (None: `tokenizer: none`, or a default that could not be loaded).
        self._loaded: dict[str, Tokenizer | None] = {}
        self._loading: dict[str, Future[None]] = {}
        self.errors: dict[str, str] = {}
        # Loading runs on the long prompts' thread: it is as slow as one.
        self._short = ThreadPoolExecutor(1, thread_name_prefix="tokenize-short")
        self._long = ThreadPoolExecutor(1, thread_name_prefix="tokenize-long")
        self._long_queued = 0

    def spec_of(self, model: str) -> str:
        return self._specs.get(model, self._default)

    def is_loaded(self, model: str) -> bool:
        return model in self._loaded

    async def load(self, models: list[str]) -> None:
        """Load (and warm) these models' tokenizers now; raises for one configured explicitly that cannot
        be loaded, since the gateway would otherwise run without the routing it was configured for."""
        for model in models:
            self.ensure(model)
        await asyncio.gather(*(asyncio.wrap_future(self._loading[m]) for m in models))
        for model in models:
            if model in self._specs and model in self.errors:
                raise RuntimeError(f"the tokenizer of {model!r} could not be loaded: {self.errors[model]}")

    def ensure(self, model: str) -> None:
        """Start loading `model`'s tokenizer in the background unless it is loaded or loading."""
        if model not in self._loading:
            self._loading[model] = self._long.submit(self._load, model)

    def _load(self, model: str) -> None:
        """On the long prompts' thread: load, warm, publish."""
        spec = self.spec_of(model)
        if spec == TEXT_SPEC:  # nothing to load: routed on its text
            self._loaded[model] = None
            return
        try:
            tokenizer = load_tokenizer_spec(spec)
            if tokenizer is not None:
                prompt_ids(_WARM_UP, tokenizer)
                self._caches[model] = _prefix_cache(tokenizer, self._cache_bytes)
        except Exception as error:  # any failure leaves the model routed by load, loudly
            self.errors[model] = f"{type(error).__name__}: {error}"
            log.error("tokenizer %r of model %r failed to load; routing it by load: %s", spec, model, error)
            tokenizer = None
        self._loaded[model] = tokenizer

    async def prompt(self, view: RequestView, model: str, limits: Limits) -> Prompt | None:
        """The prompt as routing takes it; None when there is nothing to route on yet: no prompt, no
        tokenizer for this model, one still loading (then this starts the load), or too many long
        prompts already waiting."""
        if view.token_ids is not None:
            whole = len(view.token_ids) <= limits.max_routed_tokens
            return Prompt(_head(view.token_ids, limits.max_routed_tokens), tokenized=False, whole=whole)
        if not view.has_prompt:
            return None
        if self.spec_of(model) == TEXT_SPEC:
            ids = text_ids(view, limits.max_routed_tokens)
            return None if ids is None else Prompt(ids, tokenized=False, whole=False)
        tokenizer = self._loaded.get(model)
        if tokenizer is None:
            if model not in self._loaded:
                self.ensure(model)
            return None
        cache = self._caches.get(model)
        chars = _chars(view)
        inline = _inline(view, tokenizer, cache, limits) if _worth_inline(view, chars, limits) else None
        if inline is not None:
            return inline
        head = HeadTokenizer.of(tokenizer, limits.max_tokenized_chars, cache.encode if cache else None)
        loop = asyncio.get_running_loop()
        if chars <= SHORT_PROMPT_CHARS:
            ids = await loop.run_in_executor(self._short, prompt_ids, view, head)
        elif self._long_queued >= LONG_QUEUE:
            return None
        else:
            self._long_queued += 1
            try:
                ids = await loop.run_in_executor(self._long, prompt_ids, view, head)
            finally:
                self._long_queued -= 1
        if ids is None:
            return None
        return _prompt(ids, limits, cut=head.budget.cut)

    def status(self) -> dict[str, str]:
        """Per model: loaded, loading, none or text (configured so) or the error that left it without one."""
        out = {}
        for model in self._loading:
            if model in self.errors:
                out[model] = f"failed: {self.errors[model]}"
            elif model not in self._loaded:
                out[model] = "loading"
            else:
                out[model] = "loaded" if self._loaded[model] is not None else self.spec_of(model)
        return out

    def cache_stats(self) -> dict[str, CacheStats]:
        """Per model with a prefix cache: its counts so far."""
        return {model: cache.stats for model, cache in self._caches.items() if cache is not None}

    def close(self) -> None:
        for pool in (self._short, self._long):
            pool.shutdown(wait=False, cancel_futures=True)


def _prefix_cache(tokenizer: Tokenizer, max_bytes: int) -> PrefixCache | None:
    """The tokenizer's prefix cache, checked on the warm-up conversation as its template renders it."""
    assert _WARM_UP.messages is not None
    try:
        sample = tokenizer.render_chat(_WARM_UP.messages)
    except ChatTemplateError:
        return None
    return PrefixCache.of(tokenizer.backend, sample, max_bytes)


def _worth_inline(view: RequestView, chars: int, limits: Limits) -> bool:
    """Whether to try `view` on the event loop: short, or a conversation with history that the prefix
    cache may know, and well within the characters a prompt may have tokenized (so that the head cut,
    which encodes past any allowance, never runs there)."""
    if chars > min(INLINE_TRY_CHARS, limits.max_tokenized_chars // 2):
        return False
    return chars <= INLINE_CHARS or (view.messages is not None and len(view.messages) > 1)


def _inline(
    view: RequestView, tokenizer: Tokenizer, cache: PrefixCache | None, limits: Limits
) -> Prompt | None:
    """The prompt tokenized here, or None when more than INLINE_CHARS would be left to encode."""
    allowance = Allowance(INLINE_CHARS)

    def encode(text: str) -> Sequence[int]:
        if cache is not None:
            return cache.encode(text, allowance)
        allowance.take(len(text))
        return encode_ids(tokenizer.backend, text)

    head = HeadTokenizer.of(tokenizer, limits.max_tokenized_chars, encode)
    try:
        ids = prompt_ids(view, head)
    except TooLong:
        return None
    return None if ids is None else _prompt(ids, limits, cut=head.budget.cut)


def _prompt(ids: Sequence[int], limits: Limits, cut: bool = False) -> Prompt:
    """The ids as routing takes them: whole only when none were cut and all are routed on."""
    whole = not cut and len(ids) <= limits.max_routed_tokens
    return Prompt(_head(ids, limits.max_routed_tokens), tokenized=whole, whole=whole)


def _head(ids: Sequence[int], count: int) -> Sequence[int]:
    return ids if len(ids) <= count else ids[:count]


def _chars(view: RequestView) -> int:
    """About how many characters the prompt has (what tokenizing it costs), read without walking it."""
    if view.text is not None:
        return len(view.text)
    try:
        return len(orjson.dumps([view.messages, view.tools]))
    except orjson.JSONEncodeError:  # nested past orjson's depth: long, whatever its size
        return SHORT_PROMPT_CHARS + 1
