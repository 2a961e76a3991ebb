"""Paged attention with torch's scaled_dot_product_attention: runs anywhere torch does.

SDPA wants dense K/V, so each step gathers the blocks a sequence reads. Decodes (one query token)
are batched into a single call, padded to the longest context with a mask; a chunk that starts at
position 0 attends over its own K/V and skips the gather; a chunk that continues a cached context
gathers it and masks causally with the chunk's offset.

GQA needs no repeated K/V: for decodes the query heads sharing a KV head are folded into the query
length, and for chunks SDPA's `enable_gqa` broadcasts the KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.attention.backend import write_kv
from workers.engine.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class _Chunk:
    """A sequence running more than one token this step: rows [start, end) of the batch."""

    start: int
    end: int
    # Blocks holding its context and the [query, context] causal mask; None when the chunk starts at
    # position 0 and so attends to nothing but itself.
    blocks: torch.Tensor | None
    context_len: int
    mask: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class _Decodes:
    """All sequences running exactly one token, padded to the widest block table among them."""

    rows: torch.Tensor
    # [num_decodes * max_blocks] block ids, gathered in one index_select per layer.
    blocks: torch.Tensor
    # [num_decodes, 1, 1, width] True where a key is inside the sequence's context; None if all are.
    mask: torch.Tensor | None
    num_blocks: int


@dataclass(frozen=True, slots=True)
class _SdpaStep:
    slot_mapping: torch.Tensor
    scale: float
    chunks: tuple[_Chunk, ...]
    decodes: _Decodes | None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, self.slot_mapping)
        if self.decodes is None and len(self.chunks) == 1:
            return self._chunk(self.chunks[0], q, k, v, k_cache, v_cache)
        out = torch.empty_like(q)
        for chunk in self.chunks:
            out[chunk.start : chunk.end] = self._chunk(chunk, q, k, v, k_cache, v_cache)
        if self.decodes is not None:
            out.index_copy_(0, self.decodes.rows, self._decode(self.decodes, q, k_cache, v_cache))
        return out

    def _chunk(
        self,
        chunk: _Chunk,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        if chunk.blocks is None:
            keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        else:
            keys = k_cache.index_select(0, chunk.blocks).flatten(0, 1)[: chunk.context_len]
            values = v_cache.index_select(0, chunk.blocks).flatten(0, 1)[: chunk.context_len]
        out = F.scaled_dot_product_attention(
            q[chunk.start : chunk.end].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)

    def _decode(
        self, decodes: _Decodes, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        _, block_size, num_kv_heads, head_dim = k_cache.shape
        num_heads = q.shape[1]
        n = decodes.rows.shape[0]
        width = decodes.num_blocks * block_size
        # Query head h reads KV head h // group, so [heads] -> [kv_heads, group] lines them up.
        queries = q.index_select(0, decodes.rows).view(n, num_kv_heads, num_heads // num_kv_heads, head_dim)
        shape = (n, width, num_kv_heads, head_dim)
        keys = k_cache.index_select(0, decodes.blocks).view(shape).transpose(1, 2)
        values = v_cache.index_select(0, decodes.blocks).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=decodes.mask, scale=self.scale)
        return out.reshape(n, num_heads, head_dim)


class TorchSdpaBackend:
    name = "torch_sdpa"

    def prepare(self, meta: AttentionMetadata, scale: float) -> _SdpaStep:
        device = meta.positions.device
        block_size = meta.block_size
        chunks: list[_Chunk] = []
        decode_seqs: list[int] = []
        row = 0
        for i, (q_len, ctx) in enumerate(zip(meta.query_lens, meta.context_lens, strict=True)):
            if q_len == 1:
                decode_seqs.append(i)
            elif ctx == q_len:
                chunks.append(_Chunk(row, row + q_len, None, ctx, None))
            else:
                n_blocks = -(-ctx // block_size)
                key_pos = torch.arange(ctx, device=device)
                query_pos = torch.arange(ctx - q_len, ctx, device=device)
                mask = key_pos[None, :] <= query_pos[:, None]
                chunks.append(_Chunk(row, row + q_len, meta.block_tables[i, :n_blocks].long(), ctx, mask))
            row += q_len
        return _SdpaStep(meta.slot_mapping, scale, tuple(chunks), self._plan_decodes(meta, decode_seqs))

    @staticmethod
    def _plan_decodes(meta: AttentionMetadata, seqs: list[int]) -> _Decodes | None:
        if not seqs:
            return None
        device = meta.positions.device
        contexts = [meta.context_lens[i] for i in seqs]
        n_blocks = -(-max(contexts) // meta.block_size)
        index = torch.tensor(seqs, device=device)
        rows = meta.cu_seqlens_q[:-1].long().index_select(0, index)
        blocks = meta.block_tables.index_select(0, index)[:, :n_blocks].long().reshape(-1)
        width = n_blocks * meta.block_size
        mask = None
        if any(c != width for c in contexts):
            key_pos = torch.arange(width, device=device)
            lens = torch.tensor(contexts, device=device)
            mask = (key_pos[None, :] < lens[:, None]).view(len(seqs), 1, 1, width)
        return _Decodes(rows, blocks, mask, n_blocks)
