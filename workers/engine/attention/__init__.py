"""Attention backends over the paged KV cache, behind one interface, and the choice between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention import flash_attn, triton_paged
from workers.engine.attention.backend import AttentionBackend, BackendUnavailableError, StepAttention
from workers.engine.attention.flash_attn import FlashAttnBackend
from workers.engine.attention.metadata import AttentionMetadata, build_metadata
from workers.engine.attention.torch_sdpa import TorchSdpaBackend
from workers.engine.attention.triton_paged import TritonBackend

BACKEND_NAMES = ("auto", "torch_sdpa", "flash_attn", "triton")


@dataclass(frozen=True, slots=True)
class BackendChoice:
    """The backend and, for the worker's log and /health, why it was the one."""

    backend: AttentionBackend
    reason: str


def choose_backend(
    name: str | None, *, device: torch.device, dtype: torch.dtype, block_size: int
) -> BackendChoice:
    """ "auto": flash-attn wherever it can run, else the Triton kernels on CUDA, else SDPA; the reason
    names what ruled each faster one out. An explicit name is honoured or refused loudly."""
    if name in (None, "auto"):
        flash_reasons = flash_attn.unavailable_reasons(device, dtype, block_size)
        if not flash_reasons:
            backend: AttentionBackend = FlashAttnBackend(device, dtype, block_size)
            return BackendChoice(backend, "auto chose flash_attn: it can run here")
        ruled_out = f"flash_attn cannot run ({'; '.join(flash_reasons)})"
        # The interpreter is for tests: auto never picks Triton off CUDA.
        triton_reasons = (
            triton_paged.unavailable_reasons(device) if device.type == "cuda" else ["it needs a CUDA device"]
        )
        if not triton_reasons:
            return BackendChoice(TritonBackend(device), f"auto chose triton: {ruled_out}")
        ruled_out += f"; triton cannot run ({'; '.join(triton_reasons)})"
        return BackendChoice(TorchSdpaBackend(), f"auto chose torch_sdpa: {ruled_out}")
    requested = f"{name} was requested"
    if name == "torch_sdpa":
        return BackendChoice(TorchSdpaBackend(), requested)
    if name == "flash_attn":
        return BackendChoice(FlashAttnBackend(device, dtype, block_size), requested)
    if name == "triton":
        return BackendChoice(TritonBackend(device), requested)
    raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}")


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "BackendChoice",
    "BackendUnavailableError",
    "FlashAttnBackend",
    "StepAttention",
    "TorchSdpaBackend",
    "TritonBackend",
    "build_metadata",
    "choose_backend",
]
