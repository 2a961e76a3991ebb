"""One step's batch layout: how the flattened tokens split into sequences and where their KV lives."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Built once per step and shared by every layer.

    The python tuples ride along with the tensors so that backends can plan their kernels without
    reading device memory back (a sync per step on CUDA).
    """

    block_size: int
    # Per sequence: new tokens this step, and tokens of KV attended over (cached + new).
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    # Per token: position in its sequence (RoPE's input) and the cache slot its K/V is written to.
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    # [num_seqs, max_blocks] int32, short rows padded with block 0 (never read past context_lens).
    block_tables: torch.Tensor
    # Prefix sums of query_lens and context_lens, int32, the varlen kernels' layout.
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    context_lens_tensor: torch.Tensor

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens)


def build_metadata(
    start_positions: Sequence[int],
    query_lens: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    num_blocks: int,
    device: torch.device,
) -> AttentionMetadata:
    """Lay out a step whose sequence i runs query_lens[i] tokens from start_positions[i].

    The checks here are cheap and catch a scheduler bug before it becomes a silent out-of-range write
    into another sequence's KV.
    """
    if not query_lens:
        raise ValueError("a step needs at least one sequence")
    if not len(start_positions) == len(query_lens) == len(block_tables):
        raise ValueError("start_positions, query_lens and block_tables must have one entry per sequence")
    context_lens = tuple(s + q for s, q in zip(start_positions, query_lens, strict=True))
    for i, (q, ctx, table) in enumerate(zip(query_lens, context_lens, block_tables, strict=True)):
        if q < 1:
            raise ValueError(f"sequence {i} runs no tokens")
        if len(table) * block_size < ctx:
            raise ValueError(f"sequence {i}: {len(table)} blocks cannot hold {ctx} tokens of KV")
        if table and not 0 <= min(table) <= max(table) < num_blocks:
            raise ValueError(f"sequence {i}: block ids must lie in [0, {num_blocks})")

    max_blocks = max(len(t) for t in block_tables)
    tables = torch.tensor([list(t) + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int64)
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    cu_q = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
    cu_q[1:] = torch.cumsum(q_lens, 0)
    cu_k = torch.zeros_like(cu_q)
    cu_k[1:] = torch.cumsum(torch.tensor(context_lens, dtype=torch.int64), 0)
    seq_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), q_lens)
    starts = torch.tensor(start_positions, dtype=torch.int64)
    positions = torch.arange(int(cu_q[-1])) - cu_q[seq_of_token] + starts[seq_of_token]
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size

    def to_device(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(device=device, dtype=dtype, non_blocking=True)

    return AttentionMetadata(
        block_size=block_size,
        query_lens=tuple(query_lens),
        context_lens=context_lens,
        positions=to_device(positions, torch.int64),
        slot_mapping=to_device(slots, torch.int64),
        block_tables=to_device(tables, torch.int32),
        cu_seqlens_q=to_device(cu_q, torch.int32),
        cu_seqlens_k=to_device(cu_k, torch.int32),
        context_lens_tensor=to_device(torch.tensor(context_lens), torch.int32),
    )
