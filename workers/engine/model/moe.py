"""The sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE): a gate picks top-k experts per token.

Routing follows the reference math exactly: softmax of the gate's logits in fp32, the top-k
probabilities, renormalised to sum to 1 where the config says so, and each token's output is the
weighted sum of its experts' SwiGLU outputs (plus, for Qwen2-MoE, a shared expert scaled by a sigmoid
gate). Expert work is grouped by expert: each expert runs one matmul over just the rows routed to it,
so the cost is top_k rows per token, never num_experts.

Where the experts live is the block's `dispatch`: `dispatch_local` when this process holds them all;
expert parallelism (workers.engine.expert_parallel) swaps in one that sends rows to the rank holding
their expert and brings the outputs back. Both run each expert over its rows in token order and weigh
and sum a token's slots with `combine`, so the output is the same however the experts are spread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.model.linear import Linear
from workers.engine.model.mlp import MLP
from workers.engine.model.model_config import ModelConfig, MoeConfig, UnsupportedModelError


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """This process's share of every MoE layer's experts: a contiguous run, num_experts / size of them."""

    rank: int = 0
    size: int = 1

    def experts(self, num_experts: int) -> range:
        if num_experts % self.size:
            raise UnsupportedModelError(
                f"{num_experts} experts do not split evenly over {self.size} expert-parallel ranks"
            )
        per_rank = num_experts // self.size
        return range(self.rank * per_rank, (self.rank + 1) * per_rank)


class ExpertBank(nn.Module):
    """The experts one process holds, stacked ([local, 2 * inter, hidden] and [local, hidden, inter]) so
    that a shard is one slice of the checkpoint's experts and loading indexes it by expert."""

    def __init__(self, hidden_size: int, moe: MoeConfig, shard: ExpertShard) -> None:
        super().__init__()
        self.global_ids = shard.experts(moe.num_experts)
        self.intermediate_size = moe.intermediate_size
        local = len(self.global_ids)
        self.gate_up_proj = nn.Parameter(torch.empty(local, 2 * moe.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(local, hidden_size, moe.intermediate_size))

    def forward(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Row i through local expert local_ids[i]; rows come in any order and leave in the same one."""
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=len(self.global_ids)).tolist()
        grouped = x.index_select(0, order)
        out = torch.empty_like(grouped)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = grouped[start : start + count]
                gate, up = F.linear(rows, self.gate_up_proj[expert]).split(self.intermediate_size, dim=-1)
                out[start : start + count] = F.linear(F.silu(gate) * up, self.down_proj[expert])
            start += count
        return torch.empty_like(out).index_copy_(0, order, out)


# (hidden [n, H], top-k weights [n, k] fp32, top-k expert ids [n, k], experts)
#   -> (the tokens' MoE outputs [n, H], tokens routed to each expert this call [num_experts]).
Dispatch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, ExpertBank], tuple[torch.Tensor, torch.Tensor]]


def combine(expert_out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's slot outputs [n, k, H] weighted by the gate and summed, in slot order."""
    return (expert_out * weights.to(expert_out.dtype).unsqueeze(-1)).sum(dim=1)


def dispatch_local(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: ExpertBank
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert is here: each (token, slot) row goes straight to its expert."""
    n, k = expert_ids.shape
    rows = torch.arange(n, device=x.device).repeat_interleave(k)
    flat = expert_ids.reshape(-1)
    out = experts(x.index_select(0, rows), flat)
    return combine(out.view(n, k, -1), weights), torch.bincount(flat, minlength=len(experts.global_ids))


class RoutingCounts:
    """Tokens routed to each expert, summed over MoE layers, per step and in total, so that load
    imbalance across experts and ranks is visible in the worker's /metrics while it serves."""

    def __init__(self, num_experts: int) -> None:
        # On the CPU explicitly: models are built under the meta device (LlamaForCausalLM.empty).
        self._step = torch.zeros(num_experts, dtype=torch.int64, device="cpu")
        self.last_step = torch.zeros_like(self._step)
        self.total = torch.zeros_like(self._step)

    def add(self, counts: torch.Tensor) -> None:
        self._step += counts.cpu()

    def end_step(self) -> None:
        """New tensors rather than in-place updates, so a reader on another thread sees whole steps."""
        self.last_step, self.total = self._step, self.total + self._step
        self._step = torch.zeros_like(self._step)

    @staticmethod
    def per_rank(counts: torch.Tensor, ranks: int) -> torch.Tensor:
        """Per-expert counts summed over each rank's contiguous run of experts (ExpertShard)."""
        return counts.view(ranks, -1).sum(dim=1)


class SparseMoeBlock(nn.Module):
    """Parameter names follow Qwen2-MoE's checkpoints (`gate`, `experts`, `shared_expert`,
    `shared_expert_gate`); weights.py maps Mixtral's `block_sparse_moe.*` onto them."""

    def __init__(self, config: ModelConfig, shard: ExpertShard, routing: RoutingCounts) -> None:
        super().__init__()
        moe = config.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.gate = Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = ExpertBank(config.hidden_size, moe, shard)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(config.hidden_size, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)
        self.routing = routing
        self.dispatch: Dispatch = dispatch_local

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k (weights [n, k] fp32, expert ids [n, k]) of each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        out, counts = self.dispatch(x, weights, ids, self.experts)
        self.routing.add(counts)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
