"""Per-model tokenizers: the ones the workers use (protocol.tokenizer), so the gateway's block hashes
are theirs, loaded before the gateway says it is ready.

Ready means ready: the gateway loads (and warms, with one prompt through the chat template and the
encoder) the tokenizer of every model it knows at start-up before it listens, so its first request
costs what its second does. A model that appears later (a replica registering through Redis) has its
tokenizer loaded in the background; until then its requests are routed by load alone, never held up
and never refused. Tokenizing runs on one thread: long prompts never block the event loop, and HF
tokenizers are not meant to encode from several threads at once.

A model configured with `tokenizer: none` routes without prefix information unless the client sends
token ids: its replicas still get the request, the prompt just matches nothing.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future, ThreadPoolExecutor

from gateway.request_view import RequestView, prompt_ids
from protocol.models import load_tokenizer_spec
from protocol.tokenizer import Tokenizer

log = logging.getLogger("prefixgate.gateway.tokenizers")

# A conversation through the template and the encoder once, so that the first request finds both warm.
_WARM_UP = RequestView(
    "chat", messages=[{"role": "system", "content": "warm-up"}, {"role": "user", "content": "Hello!"}]
)


class Tokenizers:
    def __init__(self, specs: dict[str, str], default_spec: str = "default") -> None:
        self._specs = dict(specs)
        self._default = default_spec
        # Loaded (None: `tokenizer: none`, or a default that could not be loaded).
        self._loaded: dict[str, Tokenizer | None] = {}
        self._loading: dict[str, Future[None]] = {}
        self.errors: dict[str, str] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

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
            self._loading[model] = self.pool.submit(self._load, model)

    def _load(self, model: str) -> None:
        """On the tokenizer thread: load, warm, publish."""
        spec = self.spec_of(model)
        try:
            tokenizer = load_tokenizer_spec(spec)
            if tokenizer is not None:
                prompt_ids(_WARM_UP, tokenizer)
        except Exception as error:  # any failure leaves the model routed by load, loudly
            self.errors[model] = f"{type(error).__name__}: {error}"
            log.error("tokenizer %r of model %r failed to load; routing it by load: %s", spec, model, error)
            tokenizer = None
        self._loaded[model] = tokenizer

    async def prompt_ids(self, view: RequestView, model: str) -> list[int] | None:
        """The prompt's ids as the workers see them; None when there is nothing to route on yet: no
        prompt, no tokenizer for this model, or one still loading (then this starts the load)."""
        if view.token_ids is not None:
            return view.token_ids
        if not view.has_prompt:
            return None
        tokenizer = self._loaded.get(model)
        if tokenizer is None:
            if model not in self._loaded:
                self.ensure(model)
            return None
        return await asyncio.get_running_loop().run_in_executor(self.pool, prompt_ids, view, tokenizer)

    def status(self) -> dict[str, str]:
        """Per model: loaded, loading, none (configured so) or the error that left it without one."""
        out = {}
        for model in self._loading:
            if model in self.errors:
                out[model] = f"failed: {self.errors[model]}"
            elif model not in self._loaded:
                out[model] = "loading"
            else:
                out[model] = "loaded" if self._loaded[model] is not None else "none"
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
