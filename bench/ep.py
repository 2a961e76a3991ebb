"""`prefixgate bench ep`: expert parallelism on this machine's CPU (gloo), EP = 1, 2, 4 ranks.

A random Mixtral-shaped model (made here with transformers, so no download) serves one batch of
prompts (prefill, then decode steps) through the engine. Reported per EP size and gate: mean step time,
the share of it rank 0 spends in the all-to-all exchanges (and in the all-gather that replicated
attention needs), and the load imbalance across ranks (max / mean routed tokens per step). The skewed
gate is the same model with every token pushed towards experts 0 and 1, which live on rank 0: a
constant offset in one embedding dimension persists in the residual stream, and those experts' gate
rows read that dimension strongly.

On a 2-core machine, 4 ranks oversubscribe the cores (1 torch thread each), so step times there measure
contention as much as exchange; the imbalance column does not depend on the machine. Only gloo on the
CPU runs here; NCCL on GPUs was not run.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.report import bar_panels, format_table, write_json

EP_SIZES = "1,2,4"
SKEW_DIM, SKEW_OFFSET, SKEW_GATE = 0, 4.0, 8.0


def write_model(folder: Path, *, skewed: bool, layers: int, hidden: int) -> Path:
    from transformers import MixtralConfig, MixtralForCausalLM

    from protocol.models import default_gguf_path
    from workers.engine.loader import convert_gguf

    torch.manual_seed(0)
    config = MixtralConfig(
        vocab_size=1024,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        eos_token_id=None,
    )
    hf = MixtralForCausalLM(config).eval()
    if skewed:
        with torch.no_grad():
            hf.model.embed_tokens.weight[:, SKEW_DIM] += SKEW_OFFSET
            for layer in hf.model.layers:
                layer.mlp.gate.weight[:2, SKEW_DIM] = SKEW_GATE
    hf.save_pretrained(folder)
    # The worker's loader wants a tokenizer; SmolLM2's serves (the bench feeds token ids below 1024).
    for file in convert_gguf(default_gguf_path()).glob("tokenizer*"):
        shutil.copy(file, folder)
    return folder


def measure(folder: Path, size: int, prompts: int, prompt_len: int, decode: int) -> dict[str, float]:
    from workers.engine.engine_core import EngineConfig
    from workers.engine.expert_parallel import ExpertParallelGroup
    from workers.engine.model.moe import RoutingCounts
    from workers.engine.sampling_params import SamplingParams

    config = EngineConfig(
        block_size=16, num_blocks=prompts * (prompt_len + decode) // 16 + prompts, num_threads=1
    )
    group = ExpertParallelGroup.start(folder, size, config, threads=1)
    engine, routing = group.engine, group.engine.runner.model.routing  # type: ignore[attr-defined]
    sampling = SamplingParams(temperature=0.0, max_tokens=decode, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    for _ in range(prompts):
        engine.add_request(torch.randint(3, 1024, (prompt_len,), generator=g).tolist(), sampling)
    step_s: list[float] = []
    imbalance: list[float] = []
    try:
        while engine.has_work():
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
            by_rank = RoutingCounts.per_rank(routing.last_step, size).float()
            imbalance.append(float(by_rank.max() / by_rank.mean()))
    finally:
        group.close()
    total = sum(step_s)
    return {
        "step_ms": 1000 * total / len(step_s),
        "all_to_all_share": group.times.all_to_all / total,
        "all_gather_share": group.times.all_gather / total,
        "imbalance": sum(imbalance) / len(imbalance),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--decode", type=int, default=16, help="decode steps after the prefill")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ep-sizes", default=EP_SIZES, help="ranks per run, comma-separated")
    parser.add_argument("--workdir", default="out/ep")
    parser.add_argument("--json", default="out/ep.json")
    parser.add_argument("--plot", default="out/ep.png")


def run(args: argparse.Namespace) -> None:
    rows, results = [], {}
    sizes = [int(n) for n in args.ep_sizes.split(",")]
    progress = tqdm(total=2 * len(sizes), desc="expert-parallel runs", unit="run")
    for gate in ("uniform", "skewed"):
        folder = Path(args.workdir) / gate
        folder.mkdir(parents=True, exist_ok=True)
        write_model(folder, skewed=gate == "skewed", layers=args.layers, hidden=args.hidden)
        for size in sizes:
            r = measure(folder, size, args.prompts, args.prompt_len, args.decode)
            progress.update()
            results[f"{gate}/ep{size}"] = r
            rows.append(
                [gate, size, r["step_ms"], r["all_to_all_share"], r["all_gather_share"], r["imbalance"]]
            )
    progress.close()
    header = ["gate", "EP", "step ms", "all-to-all share", "all-gather share", "imbalance (max/mean)"]
    print(format_table("expert parallelism on the CPU (gloo), rank 0's view", header, rows))
    write_json(args.json, {"args": vars(args), "results": results})
    panels = [
        (metric, {name: r[key] for name, r in results.items()})
        for metric, key in (
            ("step time (ms)", "step_ms"),
            ("all-to-all share of step", "all_to_all_share"),
            ("rank imbalance (max/mean)", "imbalance"),
        )
    ]
    bar_panels(args.plot, "expert parallelism: uniform vs skewed gate", panels)
