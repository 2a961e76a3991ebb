"""Fixtures shared by the engine and worker tests: a tiny random Llama over SmolLM2's tokenizer, and
worker servers running in-process on loopback ports (helpers in tests/support/workers.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from protocol.models import default_gguf_path
from tests.support.hf_models import tiny_llama_config
from tests.support.servers import ServerThread
from tests.support.workers import RunningWorker, StartWorker, serve_worker, start_worker
from workers.bundled_worker import Worker
from workers.engine.engine_core import EngineConfig
from workers.engine.llm import load
from workers.engine.loader import LoadedModel, convert_gguf, load_tokenizer, load_weights


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
