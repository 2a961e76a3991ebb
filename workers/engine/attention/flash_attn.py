"""Paged attention with flash-attn 2 on CUDA: the kernels read K/V straight from the block table.

flash-attn has no varlen "append to paged cache" call, so K/V are written with the shared
`write_kv` first; then a pure-decode step uses `flash_attn_with_kvcache` (split-KV, fastest for one
query token) and any step with a longer chunk uses `flash_attn_varlen_func` with `block_table`, whose
causal mask is aligned to the end of each sequence's context, as chunked prefill needs.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.engine.attention.backend import BackendUnavailableError, write_kv
from workers.engine.attention.metadata import AttentionMetadata

# Upstream flash-attn 2 paged KV requires the page (block) size to be a multiple of this.
FLASH_BLOCK_MULTIPLE = 256
FLASH_DTYPES = (torch.float16, torch.bfloat16)


def unavailable_reasons(device: torch.device, dtype: torch.dtype, block_size: int) -> list[str]:
    """Everything that stops flash-attn here, all at once, so one error message fixes them all."""
    reasons = []
    if importlib.util.find_spec("flash_attn") is None:
        reasons.append("the flash_attn package is not installed (pip install 'prefixgate[cuda]')")
    if device.type != "cuda" or not torch.cuda.is_available():
        reasons.append(f"it needs a CUDA device, and the model is on {device.type}")
    if dtype not in FLASH_DTYPES:
        reasons.append(f"it needs float16 or bfloat16, and the model is {dtype}")
    if block_size % FLASH_BLOCK_MULTIPLE:
        reasons.append(f"paged KV needs block_size a multiple of {FLASH_BLOCK_MULTIPLE}, got {block_size}")
    return reasons


@dataclass(frozen=True, slots=True)
class _FlashStep:
    meta: AttentionMetadata
    scale: float
    varlen: Callable[..., torch.Tensor]
    with_kvcache: Callable[..., torch.Tensor]

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        meta = self.meta
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.max_query_len == 1:
            # The new token is already in the cache, so cache_seqlens counts it.
            out = self.with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.context_lens_tensor,
                block_table=meta.block_tables,
                softmax_scale=self.scale,
                causal=True,
            )
            return out.squeeze(1)
        return self.varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=meta.cu_seqlens_k,
            max_seqlen_q=meta.max_query_len,
            max_seqlen_k=meta.max_context_len,
            softmax_scale=self.scale,
            causal=True,
            block_table=meta.block_tables,
        )


class FlashAttnBackend:
    name = "flash_attn"

    def __init__(self, device: torch.device, dtype: torch.dtype, block_size: int) -> None:
        reasons = unavailable_reasons(device, dtype, block_size)
        if reasons:
            raise BackendUnavailableError("the flash_attn backend cannot run: " + "; ".join(reasons))
        flash: Any = importlib.import_module("flash_attn")
        self._varlen = flash.flash_attn_varlen_func
        self._with_kvcache = flash.flash_attn_with_kvcache

    def prepare(self, meta: AttentionMetadata, scale: float) -> _FlashStep:
        return _FlashStep(meta, scale, self._varlen, self._with_kvcache)
