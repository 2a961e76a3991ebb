"""`prefixgate bench epp`: what prefixgate adds as Envoy's endpoint picker, beside Envoy alone and beside
prefixgate as the proxy, one request at a time, side by side in one run.

Four paths to the same replica: direct; the real Envoy alone (deploy/envoy/envoy.yaml without its
ext_proc filter, round robin over the one replica); Envoy with prefixgate as its picker (the deployed
file, bench.envoy); and prefixgate as the reverse proxy. Each request is a streamed chat of `--words`
words, sent on each path in an order that rotates every round. The replica is a simulated worker with
a zero cost model that reads chats as words, so that its own time is its software's alone; the
gateways tokenize with the default model's tokenizer, as in front of a real replica of it.

Reported: TTFT and end-to-end latency per path, what each adds over direct at p50 and p99 (and the
picker over Envoy alone), the gateways' CPU seconds per request and memory.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path
from typing import Any

import httpx
import orjson
from tqdm import tqdm

from bench.conversation import PathTimes, sentence, timed_chat
from bench.envoy import loopback_config, running_envoy
from bench.local_fleet import Fleet, SimWorkers, gateway_config, start_gateway, start_worker, wait_healthy
from bench.overhead_phases import instant_profile
from bench.procfs import cpu_s, proc_stat
from bench.replay_result import latency_stats
from bench.report import bar_panels, format_table, write_json
from protocol.loopback_ports import distinct_ports

PATHS = ("direct", "envoy alone", "envoy + prefixgate picker", "prefixgate proxy")
GATEWAYS = {"envoy + prefixgate picker": "epp", "prefixgate proxy": "serve"}
MS = 1e3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=300, help="requests on each path")
    parser.add_argument("--words", type=int, default=600, help="words of each chat")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here, and a PNG next to it")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if min(args.requests, args.words, args.max_tokens) < 1:
        raise SystemExit("prefixgate bench epp: every count must be at least 1")
    rng = random.Random(args.seed)
    times = {path: PathTimes() for path in PATHS}
    with tempfile.TemporaryDirectory(prefix="prefixgate-epp-") as tmp, Fleet(Path(tmp)) as fleet:
        workdir = Path(tmp)
        spec = SimWorkers(1, str(instant_profile(workdir)))
        worker = fleet.add(start_worker(workdir, spec, "w0", "--sim-tokenizer", "words"))
        wait_healthy([worker])
        endpoint = worker.url.removeprefix("http://")
        grpc_port, alone_listen, alone_admin, picked_listen, picked_admin = distinct_ports(5)
        config = _gateway(spec.model, worker.url)
        flags = {"epp": ("--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port)), "serve": ()}
        gateways = {
            path: fleet.add(start_gateway(workdir, command, config, *flags[command], command=command))
            for path, command in GATEWAYS.items()
        }
        wait_healthy(list(gateways.values()))
        alone = loopback_config(grpc_port, [endpoint], alone_listen, alone_admin, picker=False)
        picked = loopback_config(grpc_port, [endpoint], picked_listen, picked_admin)
        with (
            running_envoy(alone, workdir, "envoy-alone") as alone_url,
            running_envoy(picked, workdir, "envoy-picker") as picked_url,
        ):
            urls = {
                "direct": worker.url,
                "envoy alone": alone_url,
                "envoy + prefixgate picker": picked_url,
                "prefixgate proxy": gateways["prefixgate proxy"].url,
            }
            cpu_before = {path: cpu_s(g.pid) for path, g in gateways.items()}
            with httpx.Client(timeout=60.0) as client:
                for n in tqdm(range(args.requests), desc="rounds"):
                    body = orjson.dumps(
                        {
                            "model": spec.model,
                            "messages": [{"role": "user", "content": sentence(rng, args.words)}],
                            "max_tokens": args.max_tokens,
                            "stream": True,
                            "temperature": 0,
                        }
                    )
                    shift = n % len(PATHS)
                    for path in PATHS[shift:] + PATHS[:shift]:
                        ttft, e2e = timed_chat(client, urls[path], body)
                        times[path].ttft_s.append(ttft)
                        times[path].e2e_s.append(e2e)
            cpu = {path: (cpu_s(g.pid) - cpu_before[path]) / args.requests for path, g in gateways.items()}
            memory = {path: proc_stat(g.pid) for path, g in gateways.items()}
    payload = _payload(args, times, cpu, memory)
    title = f"prefixgate as Envoy's endpoint picker: {args.words}-word chats, one request at a time"
    print(_table(title, payload))
    if args.json:
        write_json(args.json, payload)
        panels = [
            (f"added TTFT {p} ms", {path: payload["added_s"][path][f"ttft_s_{p}"] * MS for path in PATHS[1:]})
            for p in ("p50", "p99")
        ]
        bar_panels(Path(args.json).with_suffix(".png"), title, panels)
    return payload


def _gateway(model: str, worker_url: str) -> dict[str, Any]:
    """The gateway over the worker as a foreign replica, tokenizing with the default model's tokenizer."""
    config = gateway_config(model, [])
    config["models"] = {model: {"tokenizer": "default"}}
    config["replicas"] = [{"url": worker_url, "id": "w0", "kind": "openai", "model": model}]
    return config


def _payload(
    args: argparse.Namespace, times: dict[str, PathTimes], cpu: dict[str, float], memory: dict[str, Any]
) -> dict[str, Any]:
    latency = {
        path: {"ttft_s": latency_stats(t.ttft_s), "e2e_s": latency_stats(t.e2e_s)}
        for path, t in times.items()
    }

    def over(path: str, base: str) -> dict[str, float]:
        return {
            f"{key}_{p}": latency[path][key][p] - latency[base][key][p]
            for key in ("ttft_s", "e2e_s")
            for p in ("p50", "p99")
        }

    return {
        "config": {k: getattr(args, k) for k in ("requests", "words", "max_tokens", "seed")},
        "latency": latency,
        "added_s": {path: over(path, "direct") for path in PATHS[1:]},
        "picker_over_envoy_s": over("envoy + prefixgate picker", "envoy alone"),
        "gateway_cpu_s_per_request": cpu,
        "gateway_memory": {
            path: {"rss_bytes": m.rss_bytes, "peak_rss_bytes": m.peak_rss_bytes} for path, m in memory.items()
        },
    }


def _table(title: str, p: dict[str, Any]) -> str:
    rows = []
    for path in PATHS:
        lat = p["latency"][path]
        added = p["added_s"].get(path)
        cpu = p["gateway_cpu_s_per_request"].get(path)
        rss = p["gateway_memory"].get(path)
        rows.append(
            [
                path,
                lat["ttft_s"]["p50"] * MS,
                lat["ttft_s"]["p99"] * MS,
                added["ttft_s_p50"] * MS if added else "-",
                added["ttft_s_p99"] * MS if added else "-",
                cpu * MS if cpu is not None else "-",
                f"{rss['peak_rss_bytes'] / 2**20:.0f}" if rss else "-",
            ]
        )
    header = [
        "path",
        "TTFT p50 ms",
        "p99 ms",
        "added p50 ms",
        "added p99 ms",
        "gateway CPU ms/req",
        "peak RSS MiB",
    ]
    extra = p["picker_over_envoy_s"]
    note = (
        f"\nthe picker over Envoy alone: TTFT p50 +{extra['ttft_s_p50'] * MS:.2f} ms, "
        f"p99 +{extra['ttft_s_p99'] * MS:.2f} ms"
    )
    return format_table(title, header, rows) + note
