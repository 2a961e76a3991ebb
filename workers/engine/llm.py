"""The engine's two faces: `LLM` for offline batches, `AsyncLLM` for a server's event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from workers.engine.engine_core import Engine, EngineConfig, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import SchedulerStats

if TYPE_CHECKING:
    from workers.engine.loader import LoadedModel


def load(model: str | None = None, device: str = "cpu") -> LoadedModel:
    """A model by path (HF folder or .gguf); None or the default's name is SmolLM2 from its package."""
    from workers.engine.loader import load_model

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
            tokens = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            ids.append(self.engine.add_request(list(tokens), p))
        results = {i: Completion() for i in ids}
        while self.engine.has_work():
            for out in self.engine.step():
                results[out.request_id].add(out)
        return [results[i] for i in ids]


_STOP = object()
T = TypeVar("T")


@dataclass(slots=True)
class _Stream:
    """Per request: the event loop of its caller, the queue its deltas (or the step's error) go to,
    and how many of its choices have not finished yet."""

    loop: asyncio.AbstractEventLoop
    deltas: asyncio.Queue[RequestOutput | BaseException]
    unfinished: int


def _ran(future: Future) -> bool:
    """Whether a command ran to a result (not skipped as cancelled, not failed)."""
    return not future.cancelled() and future.exception() is None


class AsyncLLM:
    """The engine loop in one background thread; each request is an async stream of deltas.

    Every engine call happens on that thread (adds and aborts are queued to it), so the engine needs
    no locks, and the event loop never runs a model step.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None] | object] = queue.SimpleQueue()
        self._streams: dict[int, _Stream] = {}
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

    async def call(self, fn: Callable[[Engine], T], undo: Callable[[Engine, T], None] | None = None) -> T:
        """Run `fn` on the engine thread, between steps, and return its result. A caller that leaves
        once `fn` has run cannot take its result: `undo` then gets it there, on the engine thread
        (to give back what `fn` took), so nothing it held is leaked."""
        future = self._call(lambda: fn(self.engine))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if undo is not None:
                self.post(lambda engine: undo(engine, future.result()) if _ran(future) else None)
            raise

    def post(self, fn: Callable[[Engine], object]) -> None:
        """Run `fn` on the engine thread, between steps, without waiting: a clean-up that must happen
        even for a caller that is being cancelled."""
        self._call(lambda: fn(self.engine))

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        n: int = 1,
        prelude: Callable[[Engine], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the deltas of a request's `n` choices, each tagged with its index, as they come; the
        stream ends when all of them have finished. Leaving the iteration early (a client gone)
        aborts the whole request. `prelude` runs on the engine thread right before the request is
        added, with no step in between (installing the prompt's KV that arrived from elsewhere)."""
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def add() -> int:
            if prelude is not None:
                prelude(self.engine)
            request_id = self.engine.add_request(prompt_token_ids, sampling, n)
            self._streams[request_id] = _Stream(loop, deltas, n)
            return request_id

        def abort_if_added() -> None:
            # Runs after `add` (commands run in order): a request added for a caller gone is aborted.
            if _ran(added):
                self._abort(added.result())

        added = self._call(add)
        try:
            request_id = await asyncio.wrap_future(added)
        except asyncio.CancelledError:
            self._call(abort_if_added)
            raise
        unfinished = n
        try:
            while unfinished:
                out = await deltas.get()
                if isinstance(out, BaseException):
                    unfinished = 0  # the failed step aborted the request already
                    raise out
                if out.finished:
                    unfinished -= 1
                yield out
        finally:
            if unfinished:
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
        for request_id, stream in list(self._streams.items()):
            self._abort(request_id)
            failure = RuntimeError(f"engine step failed: {error!r}")
            stream.loop.call_soon_threadsafe(stream.deltas.put_nowait, failure)

    def _publish(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            stream.unfinished -= 1
            if not stream.unfinished:
                del self._streams[out.request_id]
        stream.loop.call_soon_threadsafe(stream.deltas.put_nowait, out)
