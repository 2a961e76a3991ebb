"""The engine's two faces: `LLM` for offline batches, `AsyncLLM` for a server's event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from workers.engine.engine import Engine, EngineConfig, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import SchedulerStats

if TYPE_CHECKING:
    from workers.engine.loader import LoadedModel


def load(model: str | None = None, device: str = "cpu") -> LoadedModel:
    """A model by path (HF folder or .gguf); None or the default's name is SmolLM2 from its package."""
    from workers.engine.loader import DEFAULT_MODEL_NAME, load_default_model, load_model

    if model in (None, "default", DEFAULT_MODEL_NAME):
        return load_default_model(device=device)
    return load_model(model, device=device)


@dataclass(slots=True)
class Completion:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.finish_reason = out.finish_reason
        self.prompt_tokens = out.prompt_tokens
        self.cached_tokens = out.cached_tokens
        self.logprobs += out.new_logprobs or []


class LLM:
    """Offline generation: all prompts queued at once, continuous batching until every one is done."""

    def __init__(self, model: str | LoadedModel | None = None, config: EngineConfig | None = None) -> None:
        loaded = load(model) if model is None or isinstance(model, str) else model
        self.engine = Engine(loaded, config)
        self.tokenizer = loaded.tokenizer

    def generate(
        self, prompts: list[str] | list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[Completion]:
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        ids = []
        for prompt, p in zip(prompts, params, strict=True):
            tokens = (
                self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
            )
            ids.append(self.engine.add_request(list(tokens), p))
        results = {i: Completion() for i in ids}
        while self.engine.has_work():
            for out in self.engine.step():
                results[out.request_id].add(out)
        return [results[i] for i in ids]


_STOP = object()
# Per request: the event loop of its caller and the queue its deltas (or the step's error) go to.
_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncLLM:
    """The engine loop in one background thread; each request is an async stream of deltas.

    Every engine call happens on that thread (adds and aborts are queued to it), so the engine needs
    no locks, and the event loop never runs a model step.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()
        self._streams: dict[
            int, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput | BaseException]]
        ] = {}
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    def _call(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()

        def run() -> None:
            # A caller that left before its turn (a client gone, a /load that timed out) cancelled the
            # future: skip the command. Setting a cancelled future's result would raise here and end
            # this thread, and with it every request the worker will ever serve.
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as error:  # handed to the awaiting caller, never lost
                future.set_exception(error)

        self._commands.put(run)
        return future

    async def generate(
        self, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas; leaving the iteration early (a client gone) aborts it."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def add() -> int:
            request_id = self.engine.add_request(prompt_token_ids, sampling)
            self._streams[request_id] = (loop, deltas)
            return request_id

        def abort_if_added() -> None:
            # Runs after `add` (commands run in order): a request added for a caller gone is aborted.
            if not added.cancelled() and added.exception() is None:
                self._abort(added.result())

        added = self._call(add)
        try:
            request_id = await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self._call(abort_if_added)
            raise
        finished = False
        try:
            while not finished:
                out = await deltas.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._call(lambda: self._abort(request_id))

    def _abort(self, request_id: int) -> None:
        self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    async def stats(self) -> SchedulerStats:
        """The scheduler's counts, read on the engine thread between steps."""
        return await asyncio.wrap_future(self._call(self.engine.stats))

    def shutdown(self) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_work()
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                command = None
            while command is not None:
                if command is _STOP:
                    return
                command()  # type: ignore[operator]
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except Exception as error:  # a broken step fails its requests, not the server
                    self._fail_all(error)
                    continue
                for out in outputs:
                    self._publish(out)

    def _fail_all(self, error: Exception) -> None:
        for request_id, (loop, deltas) in list(self._streams.items()):
            self._abort(request_id)
            loop.call_soon_threadsafe(deltas.put_nowait, RuntimeError(f"engine step failed: {error!r}"))

    def _publish(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, deltas = stream
        loop.call_soon_threadsafe(deltas.put_nowait, out)
