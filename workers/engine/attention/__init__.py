"""Attention backends over the paged KV cache, behind one interface, and the choice between them."""

from __future__ import annotations

import torch

from workers.engine.attention.backend import AttentionBackend, BackendUnavailableError, StepAttention
from workers.engine.attention.flash_attn import FlashAttnBackend, unavailable_reasons
from workers.engine.attention.metadata import AttentionMetadata, build_metadata
from workers.engine.attention.torch_sdpa import TorchSdpaBackend

BACKEND_NAMES = ("auto", "torch_sdpa", "flash_attn")


def select_backend(
    name: str | None, *, device: torch.device, dtype: torch.dtype, block_size: int
) -> AttentionBackend:
    """flash-attn wherever it can run, SDPA otherwise; an explicit name is honoured or refused loudly."""
    if name in (None, "auto"):
        if not unavailable_reasons(device, dtype, block_size):
            return FlashAttnBackend(device, dtype, block_size)
        return TorchSdpaBackend()
    if name == "torch_sdpa":
        return TorchSdpaBackend()
    if name == "flash_attn":
        return FlashAttnBackend(device, dtype, block_size)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendUnavailableError",
    "FlashAttnBackend",
    "StepAttention",
    "TorchSdpaBackend",
    "build_metadata",
    "select_backend",
]
