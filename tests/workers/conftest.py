"""Fixtures shared by the engine and worker tests: a tiny random Llama over SmolLM2's tokenizer, and
worker servers running in-process on loopback ports."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from aiohttp import web
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from protocol.models import default_gguf_path
from workers.engine.engine import Engine, EngineConfig
from workers.engine.llm import load
from workers.engine.loader import LoadedModel, convert_gguf, load_tokenizer, load_weights
from workers.kv_events import KVEventLog
from workers.server import Worker, create_app


def tiny_llama_config(vocab_size: int, eos_token_id: int | None = None) -> LlamaConfig:
    """A 2-layer Llama with GQA (4 query heads on 2 KV heads), small enough for a test's CPU."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
    )


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[LlamaForCausalLM, LoadedModel]:
    """A random 2-layer Llama over SmolLM2's tokenizer, so that text paths run on real tokens."""
    tokenizer = load_tokenizer(convert_gguf(default_gguf_path()))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(tiny_llama_config(len(tokenizer), tokenizer.special_token_id("eos_token"))).eval()
    folder: Path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(folder)
    model = load_weights(folder)
    return hf, LoadedModel(model, tokenizer, "tiny-llama", model.config, folder)


class ServerThread:
    """An aiohttp app served on 127.0.0.1 by an event loop of its own, in a background thread, with
    the settings `prefixgate worker` uses (handler cancellation on disconnect). `port` 0 picks a free
    one; a fixed one lets a test restart a worker where its clients expect it."""

    def __init__(self, app: web.Application, port: int = 0) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2)
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="test-server", daemon=True)
        self._error: BaseException | None = None
        self.port = port

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", self.port)
            self.loop.run_until_complete(site.start())
            self.port = self._runner.addresses[0][1]
        except BaseException as error:
            self._error = error
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(self._runner.cleanup())
        self.loop.close()

    def start(self) -> str:
        self._thread.start()
        if not self._ready.wait(60):
            raise TimeoutError("the test server did not start")
        if self._error is not None:
            raise self._error
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)


@dataclass
class RunningWorker:
    url: str
    engine: Engine
    worker: Worker
    app: web.Application

    def client(self, **kwargs: Any) -> openai.OpenAI:
        """The official client, with no retries (a 429 must surface, not be waited out)."""
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)

    @property
    def model(self) -> str:
        return self.worker.info.model


StartWorker = Callable[..., RunningWorker]


def start_worker(
    loaded: LoadedModel,
    config: EngineConfig,
    *,
    event_capacity: int = 4096,
    **limits: int,
) -> tuple[RunningWorker, ServerThread]:
    events = KVEventLog(capacity=event_capacity)
    engine = Engine(loaded, config, **events.callbacks())
    worker = Worker.around(
        engine,
        events,
        worker_id="test",
        backend=engine.runner.attention.name,
        backend_reason=engine.runner.attention_reason,
        **limits,
    )
    return serve_worker(worker, engine)


def serve_worker(worker: Worker, engine: Any) -> tuple[RunningWorker, ServerThread]:
    app = create_app(worker)
    server = ServerThread(app)
    url = server.start()
    return RunningWorker(url, engine, worker, app), server


@pytest.fixture
def serve() -> Iterator[Callable[[Worker, Any], RunningWorker]]:
    """Serve any Worker (a simulated engine's, say) for one test; stopped after it."""
    servers: list[ServerThread] = []

    def start(worker: Worker, engine: Any) -> RunningWorker:
        running, server = serve_worker(worker, engine)
        servers.append(server)
        return running

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def make_worker(tiny) -> Iterator[StartWorker]:
    """Start tiny-model workers for one test; every one is stopped (engine thread included) after it."""
    servers: list[ServerThread] = []

    def make(config: EngineConfig | None = None, **kwargs: Any) -> RunningWorker:
        running, server = start_worker(
            tiny[1], config or EngineConfig(block_size=4, num_blocks=256), **kwargs
        )
        servers.append(server)
        return running

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def tiny_worker(tiny) -> Iterator[RunningWorker]:
    """One tiny-model worker shared by a module's cheap tests (none of which may leave it busy)."""
    running, server = start_worker(
        tiny[1], EngineConfig(block_size=4, num_blocks=256), max_body_bytes=64 * 1024
    )
    yield running
    server.stop()


@pytest.fixture(scope="module")
def smollm2_worker() -> Iterator[RunningWorker]:
    """A worker on the default model (SmolLM2-135M-Instruct), block size 16."""
    running, server = start_worker(load(), EngineConfig(block_size=16, num_blocks=128))
    yield running
    server.stop()


def hf_greedy(
    model: PreTrainedModel, prompts: Sequence[list[int]], max_new: int, ignore_eos: bool = False
) -> list[list[int]]:
    """The HF reference: one unpadded sequence at a time, so padding never enters HF's numbers;
    `ignore_eos` generates exactly `max_new` tokens whatever comes out."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new if ignore_eos else None,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs
