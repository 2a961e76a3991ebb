"""The SwiGLU MLP: the dense layers' feed-forward, and Qwen2-MoE's shared expert.

gate and up are fused into one matmul (one pass over x); `weights.py` splits checkpoint tensors onto it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.engine.model.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
