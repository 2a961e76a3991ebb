"""The peer routers (bench.peers), installed from PyPI on first use: every flag a row passes is one
its router's --help lists, and over two simulated workers sglang-router's cache_aware sends a
repeated text prompt back to the worker that cached it, as vllm-router's kv_aware does from the
workers' KV events."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.local_fleet import Child, LocalFleet, cli, spawn, stop, wait_ready
from bench.peers import (
    MARKER,
    PEER_PINS,
    PEER_ROWS,
    PEER_VARIANTS,
    peer_command,
    peer_router,
    peers_python,
    peers_venv,
)
from bench.token_text import text_of
from protocol.loopback_ports import free_port
from workers.completion_replies import WORKER_HEADER

MODEL = "Llama-3.1-8B-Instruct"  # the h100-8b profile's


@pytest.fixture(scope="module")
def python() -> Path:
    try:
        return peers_python()
    except RuntimeError as error:  # no route to PyPI: nothing here can run
        pytest.skip(str(error))


def test_the_venv_is_made_once_for_its_pins(python: Path) -> None:
    assert python == peers_venv() / "bin" / "python" and python.is_file()
    assert (peers_venv() / MARKER).read_text().split() == list(PEER_PINS)
    assert peers_python() == python  # the marker matches: nothing is installed again


def test_every_flag_a_row_passes_is_one_its_router_knows(python: Path) -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    helps: dict[str, str] = {}
    for name in [*PEER_ROWS, *PEER_VARIANTS]:
        events = ["tcp://127.0.0.1:3", "tcp://127.0.0.1:4"]
        command = peer_command(python, name, urls, 10, 11, kv_events=events, block_size=64, model=MODEL)
        module = command[2]
        if module not in helps:
            helps[module] = subprocess.run(
                [str(python), "-m", module, "--help"], capture_output=True, text=True, check=True
            ).stdout
        flags = [part for part in command[3:] if part.startswith("--")]
        assert flags and all(flag in helps[module] for flag in flags), name
        assert command[command.index("--policy") + 1] == name.split()[1]
        assert ("--kv-event-source" in command) == name.endswith("kv_aware")
        own = list(PEER_VARIANTS.get(name, ()))
        end = command.index("--log-level")
        assert command[end - len(own) : end] == own
    balanced = peer_command(python, "sglang cache_aware balanced", urls, 10, 11)
    assert balanced[balanced.index("--balance-abs-threshold") + 1] == "1"
    assert "--balance-abs-threshold" not in peer_command(python, "sglang cache_aware", urls, 10, 11)
    assert f"{urls[0]}=tcp://127.0.0.1:3" in peer_command(
        python,
        "vllm-router kv_aware",
        urls,
        10,
        11,
        kv_events=["tcp://127.0.0.1:3", "tcp://x:4"],
        model=MODEL,
    )
    with pytest.raises(ValueError, match="KV events"):
        peer_command(python, "vllm-router kv_aware", urls, 10, 11, model=MODEL)
    with pytest.raises(ValueError, match="KV events"):
        peer_command(
            python, "vllm-router kv_aware", urls, 10, 11, kv_events=["tcp://127.0.0.1:3"], model=MODEL
        )
    with pytest.raises(ValueError, match="unknown peer"):
        peer_command(python, "nginx round_robin", urls, 10, 11)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Child], list[str]]]:
    """Two simulated workers that read text as words and publish their KV events over ZMQ."""
    workdir = tmp_path_factory.mktemp("peers")
    children, events = [], []
    for i in range(2):
        port, zmq, replay = free_port(), free_port(), free_port()
        command = cli("worker", "--sim", "--sim-profile", "h100-8b", "--sim-tokenizer", "words")
        command += ["--block-size", "16", "--num-blocks", "256", "--port", str(port), "--id", f"w{i}"]
        command += [
            "--kv-events-zmq",
            f"tcp://127.0.0.1:{zmq}",
            "--kv-events-replay",
            f"tcp://127.0.0.1:{replay}",
        ]
        children.append(spawn(f"worker-w{i}", command, f"http://127.0.0.1:{port}", workdir))
        events.append(f"tcp://127.0.0.1:{zmq}")
    try:
        wait_ready(LocalFleet(children, None))
        yield children, events
    finally:
        stop(children)


def _served(url: str, prompt: str | list[int]) -> tuple[str, int]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers[WORKER_HEADER], response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.usefixtures("python")
@pytest.mark.parametrize(
    ("name", "prompt"),
    [
        ("sglang cache_aware", text_of(range(3000, 3400))),
        # kv_aware hashes token ids into the workers' blocks, as the workers' events name them.
        ("vllm-router kv_aware", list(range(5000, 5400))),
    ],
)
def test_a_repeated_prompt_goes_back_to_the_worker_that_cached_it(
    workers: tuple[list[Child], list[str]], tmp_path: Path, name: str, prompt: str | list[int]
) -> None:
    children, events = workers
    with peer_router(name, [c.url for c in children], tmp_path, kv_events=events, model=MODEL) as url:
        first, cold = _served(url, prompt)
        repeats = [_served(url, prompt) for _ in range(4)]
    assert first in {"w0", "w1"} and cold == 0
    # 400 words (or ids) in blocks of 16: all but the block holding the last one come from the cache.
    assert repeats == [(first, 384)] * 4
    assert (tmp_path / f"{name.replace(' ', '-')}.log").is_file()
