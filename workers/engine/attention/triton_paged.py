"""Paged attention with this project's Triton kernels (triton_kernels.py): the CUDA path wherever
flash-attn cannot be had, and the CPU under TRITON_INTERPRET=1 (slowly), which is how the tests check
the kernels against SDPA without a GPU.

prepare() cuts the step into work items once: every chunk of more than one token into tiles of
`query_tile` tokens, and every decode into one item. Each layer then launches the KV-store kernel, the
attention kernel over the chunk tiles, the attention kernel over the decodes (split over their keys
when the longest context exceeds `split_len`), and the merge of the splits.

Prefill over a cached prefix is the same paged kernel, causal over [cached prefix + new tokens],
rather than SDPA over the new tokens plus the paged kernel over the prefix. The split was decided
without a GPU at hand, on two grounds: SDPA returns no log-sum-exp, so merging its output with the
paged part would need torch's private `_scaled_dot_product_*` ops and a merge pass per layer; and
the one kernel reads each key once from the cache the store kernel has just written, whatever the
chunk's length, with no second code path to keep equal. `prefixgate bench cuda-check` measures the
result (TTFT with 1,984 of 2,000 tokens cached against cold) when a GPU is.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from workers.engine.attention.backend import BackendUnavailableError
from workers.engine.attention.metadata import AttentionMetadata

# tl.dot's smallest M, N and K on NVIDIA GPUs: every tile dimension is padded up to it.
MIN_DOT = 16
LOG2_E = 1.4426950408889634


def kernels() -> ModuleType:
    """The kernels module, imported on first use rather than with this package: Triton decides between
    its compiler and its interpreter when kernels are decorated, so TRITON_INTERPRET must be set first."""
    return importlib.import_module("workers.engine.attention.triton_kernels")


def unavailable_reasons(device: torch.device) -> list[str]:
    """What stops the Triton kernels here, if anything, in words for an error message."""
    if importlib.util.find_spec("triton") is None:
        return ["the triton package is not installed (pip install 'prefixgate[cuda]')"]
    if device.type == "cuda" and torch.cuda.is_available():
        return []
    if device.type == "cpu" and kernels().INTERPRETED:
        return []
    return [
        f"its kernels need a CUDA device, and the model is on {device.type} (TRITON_INTERPRET=1, set "
        "before anything imports Triton, runs them on the CPU in its interpreter, slowly: for tests)"
    ]


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True, slots=True)
class _Launch:
    """Work items for one attention launch: [n, 4] int32 of (sequence, first row, its position, tokens)."""

    items: torch.Tensor
    block_q: int
    num_splits: int


@dataclass(frozen=True, slots=True)
class _TritonStep:
    kernels: ModuleType
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    scale: float
    key_tile: int
    chunks: _Launch | None
    decodes: _Launch | None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = k_cache.shape[-2:]
        if any(t.stride(-1) != 1 for t in (q, k, v, k_cache)) or v_cache.stride() != k_cache.stride():
            raise ValueError("the Triton kernels need head_dim contiguous, and K and V caches of one layout")
        self.kernels.store_kv_kernel[(k.shape[0],)](
            k,
            v,
            k_cache,
            v_cache,
            self.slot_mapping,
            *k.stride()[:2],
            *v.stride()[:2],
            *k_cache.stride()[:3],
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=self.block_size,
            BLOCK_H=_pow2(num_kv_heads),
            BLOCK_D=_pow2(head_dim),
        )
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for launch in (self.chunks, self.decodes):
            if launch is not None:
                self._attend(launch, q, k_cache, v_cache, out)
        return out

    def _attend(
        self,
        launch: _Launch,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        num_heads = q.shape[1]
        num_kv_heads, head_dim = k_cache.shape[-2:]
        group = num_heads // num_kv_heads
        # A decode tile is one token: its group's heads alone must fill tl.dot's rows.
        block_g = _pow2(group) if launch.block_q > 1 else max(MIN_DOT, _pow2(group))
        block_d = max(MIN_DOT, _pow2(head_dim))
        n = launch.items.shape[0]
        split = launch.num_splits > 1
        if split:
            shape = (n, num_heads, launch.num_splits)
            target = torch.empty(*shape, head_dim, dtype=torch.float32, device=q.device)
            lse = torch.empty(shape, dtype=torch.float32, device=q.device)
        else:
            target, lse = out, out  # lse is unused without splits
        self.kernels.paged_attention_kernel[(n, num_kv_heads, launch.num_splits)](
            q,
            k_cache,
            v_cache,
            self.block_tables,
            launch.items,
            target,
            lse,
            self.scale * LOG2_E,
            *q.stride()[:2],
            *k_cache.stride()[:3],
            launch.items.stride(0),
            self.block_tables.stride(0),
            *out.stride()[:2],
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=self.block_size,
            BLOCK_Q=launch.block_q,
            BLOCK_G=block_g,
            BLOCK_D=block_d,
            BLOCK_N=self.key_tile,
            SPLIT=split,
            # fp32 models get fp32 products, not TF32's 10-bit mantissas: greedy tokens must match.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )
        if split:
            self.kernels.merge_splits_kernel[(n, num_heads)](
                target,
                lse,
                launch.items,
                out,
                launch.num_splits,
                launch.items.stride(0),
                *out.stride()[:2],
                HEAD_DIM=head_dim,
                BLOCK_S=_pow2(launch.num_splits),
                BLOCK_D=_pow2(head_dim),
            )


class TritonBackend:
    """query_tile: tokens per chunk tile; key_tile: keys per loop iteration; split_len, max_splits:
    how decodes split their keys. The defaults are for a GPU; tests shrink them to cross tile and
    split boundaries on small inputs. Tiles are powers of two, at least MIN_DOT."""

    name = "triton"

    def __init__(
        self,
        device: torch.device,
        *,
        query_tile: int = 16,
        key_tile: int = 64,
        split_len: int = 512,
        max_splits: int = 16,
    ) -> None:
        reasons = unavailable_reasons(device)
        if reasons:
            raise BackendUnavailableError("the triton backend cannot run: " + "; ".join(reasons))
        for label, tile in (("query_tile", query_tile), ("key_tile", key_tile)):
            if tile < MIN_DOT or tile != _pow2(tile):
                raise ValueError(f"{label} must be a power of two of at least {MIN_DOT}, got {tile}")
        if split_len < 1 or max_splits < 1:
            raise ValueError(f"need split_len and max_splits >= 1, got {split_len} and {max_splits}")
        self._kernels = kernels()
        self.query_tile = query_tile
        self.key_tile = key_tile
        self.split_len = split_len
        self.max_splits = max_splits

    def prepare(self, meta: AttentionMetadata, scale: float) -> _TritonStep:
        chunk_items: list[tuple[int, int, int, int]] = []
        decode_items: list[tuple[int, int, int, int]] = []
        row = 0
        for seq, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            first = ctx - q_len
            if q_len == 1:
                decode_items.append((seq, row, first, 1))
            else:
                for t in range(0, q_len, self.query_tile):
                    chunk_items.append((seq, row + t, first + t, min(self.query_tile, q_len - t)))
            row += q_len
        device = meta.positions.device
        # One host-to-device copy for both launches.
        items = torch.tensor(chunk_items + decode_items, dtype=torch.int32).to(device, non_blocking=True)
        chunks = decodes = None
        if chunk_items:
            chunks = _Launch(items[: len(chunk_items)], self.query_tile, 1)
        if decode_items:
            longest = max(pos + 1 for _, _, pos, _ in decode_items)
            decodes = self._decode_launch(items[len(chunk_items) :], longest)
        return _TritonStep(
            self._kernels,
            meta.slot_mapping,
            meta.block_tables,
            meta.block_size,
            scale,
            self.key_tile,
            chunks,
            decodes,
        )

    def prepare_decodes(
        self,
        items: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        block_size: int,
        max_context: int,
        scale: float,
    ) -> _TritonStep:
        """A step of decodes only, over buffers the caller fills before every launch (decode_graphs.py):
        items [n, 4] as prepare() lays them out, one token each; the launch is planned for `max_context`
        keys, whatever the contexts are, so that it never changes with them. A split that starts past a
        sequence's context reads nothing and weighs nothing in the merge."""
        launch = self._decode_launch(items, max_context)
        return _TritonStep(
            self._kernels, slot_mapping, block_tables, block_size, scale, self.key_tile, None, launch
        )

    def _decode_launch(self, items: torch.Tensor, longest: int) -> _Launch:
        """As many splits as the longest context needs at split_len keys each, up to max_splits; fewer
        where whole key tiles per split leave the last ones empty even for the longest."""
        num_splits = min(self.max_splits, -(-longest // self.split_len))
        per_split = -(-longest // num_splits)
        split_len = -(-per_split // self.key_tile) * self.key_tile
        return _Launch(items, 1, -(-longest // split_len))
