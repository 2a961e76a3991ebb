"""`prefixgate worker` as a process: flags, start-up, one request, and a clean exit on SIGTERM."""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prefixgate.cli import build_parser
from tests.support.servers import free_port
from workers.worker_cli import engine_config, parse_bytes

pytestmark = pytest.mark.fleet


def test_byte_counts() -> None:
    assert parse_bytes("268435456") == 2**28
    assert parse_bytes("256M") == parse_bytes("256MiB") == 2**28
    assert parse_bytes("1.5g") == 3 * 2**29
    for bad in ("", "12X", "-5", "0"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_bytes(bad)


def test_flags_map_to_the_engine_config() -> None:
    args = build_parser().parse_args(
        [
            "worker",
            "--block-size",
            "32",
            "--kv-memory",
            "64M",
            "--max-num-seqs",
            "8",
            "--backend",
            "torch_sdpa",
        ]
    )
    config = engine_config(args)
    assert (config.block_size, config.num_blocks, config.kv_memory_bytes) == (32, None, 2**26)
    assert (config.max_num_seqs, config.backend, config.cuda_graphs) == (8, "torch_sdpa", None)
    off = engine_config(build_parser().parse_args(["worker", "--cuda-graphs", "off"]))
    on = engine_config(build_parser().parse_args(["worker", "--cuda-graphs", "on"]))
    assert (off.cuda_graphs, on.cuda_graphs) == (False, True)
    assert (args.host, args.max_waiting) == ("127.0.0.1", 256)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--num-blocks", "10", "--kv-memory", "1G"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["worker", "--block-size", "0"])


def test_the_worker_process_serves_and_exits_cleanly(tiny, tmp_path: Path) -> None:
    _, loaded = tiny
    folder = tmp_path / "tiny-served"
    shutil.copytree(loaded.path, folder)
    loaded.tokenizer.save(folder)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "prefixgate",
        "worker",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--block-size",
        "4",
        "--num-blocks",
        "64",
        "--id",
        "w1",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                health = httpx.get(f"{url}/health", timeout=1).json()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the worker did not come up"
                time.sleep(0.2)
        assert (health["worker_id"], health["model"], health["num_blocks"]) == ("w1", "tiny-served", 64)
        # Why its decode steps run eager here, after why its attention is SDPA.
        assert health["backend_reason"].endswith(
            "; decode runs eager: CUDA graphs need a CUDA device, and the model is on cpu; decode graphs "
            "are captured over the Triton kernels, and attention is torch_sdpa"
        )
        done = httpx.post(f"{url}/v1/completions", json={"prompt": "hi there", "max_tokens": 3}, timeout=30)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, output
    assert "incarnation" in output
