"""`prefixgate`: the one command line for the gateway, the workers and the benchmarks.

Each command's module is imported only when that command runs (or when a full parser is asked for):
the benchmarks and the engine pull in torch, which a gateway process has no use for — it would cost
seconds of start-up and a couple of hundred MiB of memory.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module with add_arguments and run, help)
COMMANDS = {
    "worker": ("workers.worker_cli", "run a bundled worker (engine + HTTP API)"),
    "serve": ("gateway.serve", "run the gateway from its YAML config"),
    "epp": ("gateway.epp.serve", "run the gateway as an Envoy endpoint picker (ext_proc)"),
    "up": ("prefixgate.up", "the local fleet: a gateway and SmolLM2 workers"),
}
BENCHMARKS = {
    "radix": ("bench.radix_speed", "hashing and index-match speed and memory"),
    "engine": ("bench.engine_bench", "the engine against HF transformers on one machine"),
    "cuda-check": ("bench.cuda_check", "the engine on a CUDA device: HF's tokens, speed, cached-prefix TTFT"),
    "fleet": ("bench.fleet", "a trace over simulated replicas (real scheduler)"),
    "ep": ("bench.ep", "MoE expert parallelism: step time, all-to-all share, rank imbalance"),
    "pd-transfer": ("bench.pd_transfer", "KV transfer between workers: loopback GB/s and share of TTFT"),
    "replay": ("bench.replay", "open-loop load against an OpenAI endpoint"),
    "overhead": ("bench.overhead", "the gateway's added latency and capacity"),
    "conversation": ("bench.conversation", "a growing conversation through the gateway, cache on and off"),
    "profile": ("bench.request_profile", "the gateway's CPU per request, stage by stage, per prompt shape"),
    "throughput": (
        "bench.throughput",
        "req/s through prefixgate and sglang-router to a replica costing nothing",
    ),
    "epp": ("bench.epp_latency", "prefixgate as Envoy's endpoint picker against Envoy alone and the proxy"),
    "chaos": ("bench.chaos", "fault scenarios on a live fleet, with a results table"),
    "soak": ("bench.soak", "minutes of load through two gateways: memory, index size, errors"),
    "vllm": ("bench.vllm_bench", "routers compared on real vLLM servers on this CPU (a venv of its own)"),
}


def _chosen(argv: list[str] | None, names: dict[str, tuple[str, str]], depth: int) -> set[str]:
    """The command named at position `depth` of argv (all of them when argv is None or names none)."""
    if argv is None:
        return set(names)
    words = [a for a in argv if not a.startswith("-")]
    return {words[depth]} & set(names) if len(words) > depth and words[depth] in names else set(names)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given argv, only the command it names gets its arguments (and its imports)."""
    parser = argparse.ArgumentParser(prog="prefixgate", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    wanted = _chosen(argv, {**COMMANDS, "bench": ("", "")}, 0)
    for name, (module, help_text) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_text)
        if name in wanted:
            importlib.import_module(module).add_arguments(sub)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    wanted_bench = _chosen(argv, BENCHMARKS, 1) if "bench" in wanted else set()
    for name, (module, help_text) in BENCHMARKS.items():
        sub = bench.add_parser(name, help=help_text)
        if name in wanted_bench:
            importlib.import_module(module).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if args.command == "bench":
        importlib.import_module(BENCHMARKS[args.bench][0]).run(args)
        return 0
    return importlib.import_module(COMMANDS[args.command][0]).run(args)
