"""The attention backend interface: plan once per step, then attend once per layer.

Every backend shares one paged KV layout, [num_blocks, block_size, num_kv_heads, head_dim] per layer
for K and for V (flash-attn's own paged layout), so the runner allocates the cache without knowing
which backend reads it.
"""

from __future__ import annotations

from typing import Protocol

import torch

from workers.engine.attention.metadata import AttentionMetadata


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run here; the message says why."""


class StepAttention(Protocol):
    """Attention for one step, planned from its metadata; called by each layer with its own cache."""

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Write k/v [tokens, kv_heads, dim] into the cache; return attention for q [tokens, heads, dim]."""
        ...


class AttentionBackend(Protocol):
    name: str

    def prepare(self, meta: AttentionMetadata, scale: float) -> StepAttention:
        """Do the per-step work (gather indices, masks) that every layer would otherwise repeat."""
        ...


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Store this step's K/V at their slots (slot = block * block_size + offset)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
