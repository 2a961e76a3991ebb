"""`bench fleet --ep 2,4,8`: one MoE model on the same GPUs, laid out as replicas of each
expert-parallel group size, over one workload through bench.fleet's simulator and routing.

A layout of group size G is gpus/G replicas of G GPUs each (workers.sim.moe_profiles). The smallest
G that holds the weights is N replicas of the whole model; larger groups hold the experts once over
more GPUs, so every GPU keeps more room for KV and a decode step reads fewer expert weights per GPU,
for an all-to-all per layer and the wait for the busiest rank. Reported per layout: the fleet's
TTFT, output throughput and prefix-cache hit rate, its KV capacity, and the cost model's view of two
reference steps with every rank busy (decodes of 32 sequences per GPU at 2k context; an
8192-token prefill per GPU) by term, which is where the fleet's numbers come from.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.fleet_result import FleetResult
from bench.report import bar_panels, format_table, write_json
from workers.sim.cost_model import StepShape, chunk_shape
from workers.sim.ep_cost import ExpertParallelCost, StepTerms
from workers.sim.moe_profiles import (
    RANK_BATCHED_TOKENS,
    ep_profile,
    get_moe_model,
    kv_tokens_per_gpu,
    weight_bytes_per_gpu,
)
from workers.sim.moe_routing import Gate
from workers.sim.profiles import Profile

DECODE_SEQS_PER_GPU, DECODE_CONTEXT = 32, 2048

FLEET_HEADER = [
    "layout",
    "KV tok/replica",
    "KV tok, all GPUs",
    "hit rate",
    "TTFT mean s",
    "TTFT p99 s",
    "out tok/s",
    "done",
    "rejected",
]
STEP_HEADER = [
    "layout",
    "decode ms",
    "experts ms",
    "all-to-all ms",
    "imbalance",
    "decode tok/s/GPU",
    "prefill ms",
    "experts ms",
    "all-to-all ms",
    "imbalance",
    "prefill tok/s/GPU",
]


@dataclass(frozen=True, slots=True)
class Layout:
    group: int
    replicas: int
    profile: Profile

    @property
    def name(self) -> str:
        return f"{self.replicas} x EP{self.group}"

    @property
    def cost(self) -> ExpertParallelCost:
        cost = self.profile.cost
        assert isinstance(cost, ExpertParallelCost), "ep_profile builds expert-parallel costs only"
        return cost


def parse_groups(value: str) -> list[int]:
    """Group sizes from `G,G,...`, in order."""
    items = [item.strip() for item in value.split(",")]
    if not all(item.isdigit() and int(item) > 0 for item in items):
        raise ValueError(f"--ep takes GPUs per replica, comma-separated (e.g. 2,4,8), got {value!r}")
    return [int(item) for item in items]


def layouts(name: str, groups: Sequence[int], gpus: int, gate: Gate, block_size: int | None) -> list[Layout]:
    """The MoE profile `name` in each group size on `gpus` GPUs, with `block_size` if given."""
    result = []
    for group in groups:
        if gpus % group:
            raise ValueError(f"{gpus} GPUs do not split into replicas of {group}")
        profile = ep_profile(name, group, gate)
        if block_size is not None:
            profile = replace(profile, block_size=block_size)
        result.append(Layout(group, gpus // group, profile))
    return result


def reference_steps(layout: Layout) -> tuple[StepTerms, StepTerms]:
    """A decode step and a prefill step with every rank of the group equally busy."""
    decodes = StepShape(
        decode_seqs=DECODE_SEQS_PER_GPU,
        decode_kv_tokens=DECODE_SEQS_PER_GPU * DECODE_CONTEXT,
        sampled=DECODE_SEQS_PER_GPU,
    )
    prefill = chunk_shape(0, RANK_BATCHED_TOKENS)
    return layout.cost.terms([decodes] * layout.group), layout.cost.terms([prefill] * layout.group)


def _step(terms: StepTerms, tokens_per_gpu: int) -> dict[str, float]:
    return {
        "total_s": terms.total_s,
        "dense_s": terms.dense_s,
        "experts_s": terms.experts_s,
        "all_to_all_s": terms.all_to_all_s,
        "imbalance": terms.imbalance,
        "tokens_per_s_per_gpu": tokens_per_gpu / terms.total_s,
    }


def report(
    args: argparse.Namespace,
    chosen: Sequence[Layout],
    results: Sequence[FleetResult],
    workload: str,
    params: dict[str, Any],
    requests: int,
    policy: str,
) -> dict[str, Any]:
    """The two tables on stdout; the JSON and its PNG where `args.json` says."""
    model = get_moe_model(args.profile)
    gate = Gate(args.gate_zipf)
    rows, step_rows, per_layout = [], [], {}
    for layout, result in zip(chosen, results, strict=True):
        decode_terms, prefill_terms = reference_steps(layout)
        decode = _step(decode_terms, DECODE_SEQS_PER_GPU)
        prefill = _step(prefill_terms, RANK_BATCHED_TOKENS)
        kv = layout.profile.kv_capacity_tokens
        per_layout[layout.name] = {
            "group": layout.group,
            "replicas": layout.replicas,
            "kv_tokens_per_replica": kv,
            "kv_tokens_per_gpu": kv_tokens_per_gpu(model, layout.group),
            "weight_bytes_per_gpu": weight_bytes_per_gpu(model, layout.group),
            **result.summary(),
            "completed": result.completed,
            "rejected": result.rejected,
            "decode_step": decode,
            "prefill_step": prefill,
        }
        rows.append(
            [
                layout.name,
                kv,
                kv * layout.replicas,
                result.hit_rate,
                result.ttft_mean_s,
                result.ttft_p99_s,
                result.throughput_tok_s,
                result.completed,
                result.rejected,
            ]
        )
        step_rows.append(
            [layout.name]
            + [1e3 * decode[k] for k in ("total_s", "experts_s", "all_to_all_s")]
            + [decode["imbalance"], decode["tokens_per_s_per_gpu"]]
            + [1e3 * prefill[k] for k in ("total_s", "experts_s", "all_to_all_s")]
            + [prefill["imbalance"], prefill["tokens_per_s_per_gpu"]]
        )
    title = (
        f"EP fleet simulation: {workload}, {requests} requests, {args.profile} on {args.gpus} GPUs, "
        f"{gate.name} gate, {policy}, speed {args.speed:g}"
    )
    print(format_table(title, FLEET_HEADER, rows))
    print(
        format_table(
            f"step model: decodes of {DECODE_SEQS_PER_GPU} sequences at {DECODE_CONTEXT} context per GPU; "
            f"a {RANK_BATCHED_TOKENS}-token prefill per GPU",
            STEP_HEADER,
            step_rows,
        )
    )
    payload = {
        "workload": workload,
        "workload_params": params,
        "trace": args.trace,
        "requests": requests,
        "profile": args.profile,
        "model": {
            "name": model.model_name,
            "params": model.total_params,
            "active_params": model.active_params,
            "experts": model.experts,
            "top_k": model.top_k,
            "hidden": model.hidden,
            "layers": model.layers,
            "kv_bytes_per_token": chosen[0].profile.kv_bytes_per_token,
        },
        "gpus": args.gpus,
        "gate_zipf": gate.zipf,
        "policy": policy,
        "speed": args.speed,
        "seed": args.seed,
        "layouts": per_layout,
    }
    if args.json:
        write_json(args.json, payload)

        def panel(key: str, scale: float = 1.0) -> dict[str, float]:
            return {name: scale * row[key] for name, row in per_layout.items()}

        bar_panels(
            Path(args.json).with_suffix(".png"),
            title,
            [
                ("TTFT mean (s)", panel("ttft_mean_s")),
                ("TTFT p99 (s)", panel("ttft_p99_s")),
                ("output tokens/s", panel("throughput_tok_s")),
                ("KV tokens per replica (M)", panel("kv_tokens_per_replica", 1e-6)),
                ("decode step (ms)", {n: 1e3 * r["decode_step"]["total_s"] for n, r in per_layout.items()}),
            ],
        )
    return payload
