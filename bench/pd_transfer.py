"""What moving a prompt's KV between workers costs (prefill/decode disaggregation).

Two measures, each side by side with its reference in the same run:
- throughput: a prompt's KV blocks pushed from one engine's cache to another's over loopback TCP
  (workers.kv_transfer, both ends in this process), against copying the same blocks between the two
  caches in memory (read_blocks -> write_blocks, no socket): GB/s, and the protocol's share of the
  copy's speed. On CUDA the caches live on the device, so the same numbers are device to device
  through pinned host staging.
- TTFT: real SmolLM2 worker processes, one mixed, one prefill and one decode; each prompt's time to
  first token on the mixed worker against the decode worker pulling it from the prefill worker, the
  pull's and the push's share of that TTFT, and whether the greedy outputs agree.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import torch
from tqdm import tqdm

from bench.local_fleet import Child, LocalFleet, cli, spawn, stop, transfer_secret, wait_ready
from bench.report import bar_panels, format_table, write_json
from protocol.disaggregation import (
    PREFILL_FIELD,
    PULL_MS_HEADER,
    TRANSFER_MS_HEADER,
    TRANSFERRED_TOKENS_HEADER,
)
from protocol.loopback_ports import free_port
from protocol.transfer_auth import grant
from workers.engine.llm import load
from workers.engine.model_runner import ModelRunner
from workers.kv_transfer import TransferServer, send_blocks

BLOCK_SIZE = 16


def _runner(model: Any, num_blocks: int) -> ModelRunner:
    return ModelRunner(model, num_blocks=num_blocks, block_size=BLOCK_SIZE)


async def _push(source: ModelRunner, receiver: TransferServer, blocks: list[int], tag: str) -> float:
    hashes = list(range(len(blocks)))
    arrived = receiver.expect(tag, hashes, blocks)
    start = time.perf_counter()
    await send_blocks("127.0.0.1", receiver.port, tag, hashes, blocks, source, secret=receiver.secret)
    await arrived
    return time.perf_counter() - start


def _copy(source: ModelRunner, target: ModelRunner, blocks: list[int]) -> float:
    start = time.perf_counter()
    data = source.read_blocks(blocks)
    staging = target.staging(len(data))
    staging[:] = data
    target.write_blocks(blocks, staging)
    if source.device.type == "cuda":
        torch.cuda.synchronize(source.device)
    return time.perf_counter() - start


def throughput(model: Any, sizes: list[int], repeats: int) -> list[dict[str, Any]]:
    num_blocks = max(sizes) // BLOCK_SIZE
    source, target = _runner(model, num_blocks), _runner(model, num_blocks)
    source.kv_cache.copy_(torch.randn_like(source.kv_cache))

    async def main() -> list[dict[str, Any]]:
        receiver = TransferServer(target, transfer_secret().encode())
        await receiver.start()
        rows = []
        for tokens in tqdm(sizes, desc="loopback transfer", unit="prompt"):
            blocks = list(range(tokens // BLOCK_SIZE))
            num_bytes = len(blocks) * source.kv_block_bytes
            pushes, copies = [], []
            for i in range(repeats):
                pushes.append(await _push(source, receiver, blocks, f"{tokens}-{i}"))
                copies.append(_copy(source, target, blocks))
            assert torch.equal(target.kv_cache[:, :, blocks], source.kv_cache[:, :, blocks])
            push, copy = statistics.median(pushes), statistics.median(copies)
            rows.append(
                {
                    "tokens": tokens,
                    "mib": num_bytes / 2**20,
                    "tcp_ms": push * 1000,
                    "tcp_gb_s": num_bytes / push / 1e9,
                    "copy_ms": copy * 1000,
                    "copy_gb_s": num_bytes / copy / 1e9,
                    "tcp_vs_copy": copy / push,
                }
            )
        await receiver.close()
        return rows

    return asyncio.run(main())


def _worker(role: str, port: int, threads: int) -> list[str]:
    return cli(
        "worker", "--role", role, "--port", str(port), "--id", role, "--threads", str(threads),
        "--num-blocks", "1024", "--max-batched-tokens", "4096", "--log-level", "WARNING",
    )  # fmt: skip


def _first_token(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[float, str, httpx.Headers]:
    """TTFT of a streamed completion, the whole text, and the response headers."""
    start = time.perf_counter()
    ttft, text = None, []
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            text.append(line)
        headers = response.headers
    assert ttft is not None
    return ttft, "".join(text), headers


def _texts(stream: str) -> str:
    import json

    return "".join(
        json.loads(chunk)["choices"][0]["text"]
        for chunk in stream.replace("data: ", "\n").split("\n")
        if chunk.strip()
    )


def ttft_share(sizes: list[int], workdir: Path, threads: int) -> list[dict[str, Any]]:
    workdir.mkdir(parents=True, exist_ok=True)
    ports = {role: free_port() for role in ("mixed", "prefill", "decode")}
    children: list[Child] = [
        spawn(role, _worker(role, port, threads), f"http://127.0.0.1:{port}", workdir)
        for role, port in ports.items()
    ]
    urls = {child.name: child.url for child in children}
    rows = []
    try:
        wait_ready(LocalFleet(children, None))
        rng = random.Random(0)
        with httpx.Client(timeout=600) as client:
            warm = {"prompt": [rng.randrange(1000, 40000) for _ in range(40)], "max_tokens": 2}
            for url in urls.values():
                client.post(f"{url}/v1/completions", json=warm).raise_for_status()
            for tokens in tqdm(sizes, desc="TTFT mixed vs prefill->decode", unit="prompt"):
                prompt = [rng.randrange(1000, 40000) for _ in range(tokens)]
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                mixed, mixed_text, _ = _first_token(client, urls["mixed"], body)
                # Signed as the gateway would: the decode worker pulls for no other grant.
                pd_body = {
                    **body,
                    PREFILL_FIELD: grant(transfer_secret().encode(), urls["prefill"], uuid.uuid4().hex),
                }
                pd, pd_text, headers = _first_token(client, urls["decode"], pd_body)
                pull = float(headers.get(PULL_MS_HEADER, "nan")) / 1000
                push = float(headers.get(TRANSFER_MS_HEADER, "nan")) / 1000
                rows.append(
                    {
                        "tokens": tokens,
                        "transferred": int(headers.get(TRANSFERRED_TOKENS_HEADER, "0")),
                        "mixed_ttft_s": mixed,
                        "pd_ttft_s": pd,
                        "pull_share": pull / pd,
                        "push_share": push / pd,
                        "same_tokens": _texts(mixed_text) == _texts(pd_text),
                    }
                )
    finally:
        stop(children)
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default="256,1024,4096,8192", help="prompt tokens moved (throughput)")
    parser.add_argument("--ttft-sizes", default="256,1024,2048", help="prompt tokens (TTFT share)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process")
    parser.add_argument("--device", default="cpu", help="where the caches of the throughput part live")
    parser.add_argument("--skip-ttft", action="store_true", help="only the throughput part")
    parser.add_argument("--workdir", default="out/pd_transfer")
    parser.add_argument("--json", default="out/pd_transfer.json")
    parser.add_argument("--plot", default="out/pd_transfer.png")


def run(args: argparse.Namespace) -> dict[str, Any]:
    loaded = load(device=args.device)
    rows = throughput(loaded.model, [int(s) for s in args.sizes.split(",")], args.repeats)
    kv = f"{loaded.name}: {rows[0]['mib'] * 2**20 / rows[0]['tokens'] / 1024:.0f} KiB of KV per token"
    print(
        format_table(
            f"KV transfer over loopback TCP vs an in-memory copy ({args.device}; {kv})",
            ["tokens", "MiB", "tcp ms", "tcp GB/s", "copy ms", "copy GB/s", "tcp/copy speed"],
            [[r[k] for k in r] for r in rows],
        )
    )
    result: dict[str, Any] = {"device": args.device, "throughput": rows}
    panels = [("loopback GB/s", {str(r["tokens"]): r["tcp_gb_s"] for r in rows})]
    if not args.skip_ttft:
        sizes = [int(s) for s in args.ttft_sizes.split(",")]
        share = ttft_share(sizes, Path(args.workdir), args.threads)
        print(
            format_table(
                "TTFT: a mixed worker vs a decode worker pulling from a prefill worker (SmolLM2, CPU)",
                ["tokens", "moved", "mixed TTFT s", "P->D TTFT s", "pull share", "push share", "same tokens"],
                [[r[k] for k in r] for r in share],
            )
        )
        result["ttft"] = share
        panels.append(("push share of TTFT", {str(r["tokens"]): r["push_share"] for r in share}))
    write_json(args.json, result)
    bar_panels(args.plot, "prefill/decode KV transfer", panels)
    return result
