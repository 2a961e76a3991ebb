"""Triton kernels over the paged KV cache: store a step's K/V at their slots, attend, merge split-K.

One attention kernel serves prefill and decode. A program takes one *work item* (a run of at most
BLOCK_Q consecutive query tokens of one sequence, as four int32: sequence, first row in the flattened
batch, position of that row, number of tokens) and one KV head, and reads the sequence's keys straight
from its block table token by token (slot = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE):
a key tile may span several small blocks, and nothing is gathered into dense tensors. The query heads
sharing the KV head are folded into the tile's rows (row = token * BLOCK_G + head in group), so GQA
and MQA read each K/V tile once for the whole group, and the tile's matmuls stay tl.dot-sized.

A chunk's keys include its own tokens, which the store kernel wrote first, so a prefill over a cached
prefix is the same loop as a fresh one: the mask is causal over [cached prefix + new tokens].

Decodes (BLOCK_Q = 1) of long contexts split their keys over a third grid axis (SPLIT): each decode
cuts its own context into as many equal splits, whole key tiles each, so that a short context beside
a long one is not left to one program, and the launch depends only on the number of splits (which is
what lets a captured CUDA graph serve any contexts, decode_graphs.py). Each split writes its
normalised partial output and log-sum-exp, and the merge kernel combines them. Softmax
runs in base 2 (exp2 is one instruction), so the log-sum-exps are base 2 as well.

Offsets into the cache are int64: a layer's cache can exceed 2**31 elements on a large GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    stride_k_tok,
    stride_k_head,
    stride_v_tok,
    stride_v_head,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: copy its K and V [kv_heads, head_dim] to the cache slot it was given.
    Slot -1 stores nothing: the pad rows of a replayed decode graph (decode_graphs.py) have it."""
    tok = tl.program_id(0)
    slot = tl.load(slots_ptr + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    stored_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (heads < stored_heads) & (dims < HEAD_DIM)
    dst = (slot // BLOCK_SIZE) * stride_c_block + (slot % BLOCK_SIZE) * stride_c_off + heads * stride_c_head
    k = tl.load(k_ptr + tok * stride_k_tok + heads * stride_k_head + dims, mask=mask)
    v = tl.load(v_ptr + tok * stride_v_tok + heads * stride_v_head + dims, mask=mask)
    tl.store(k_cache_ptr + dst + dims, k, mask=mask)
    tl.store(v_cache_ptr + dst + dims, v, mask=mask)


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    items_ptr,
    out_ptr,
    lse_ptr,
    qk_scale,
    stride_q_tok,
    stride_q_head,
    stride_c_block,
    stride_c_off,
    stride_c_head,
    stride_item,
    stride_table,
    stride_o_tok,
    stride_o_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Grid (items, kv_heads, splits). qk_scale is the softmax scale times log2(e).

    Without SPLIT the output goes to out [tokens, heads, dim]; with it (decode items only) the split's
    partial goes to out [items, heads, splits, HEAD_DIM] and its log-sum-exp to lse [items, heads, splits].
    """
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(items_ptr + item * stride_item)
    row0 = tl.load(items_ptr + item * stride_item + 1)
    pos0 = tl.load(items_ptr + item * stride_item + 2)
    count = tl.load(items_ptr + item * stride_item + 3)

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)
    tok = rows // BLOCK_G
    head = kv_head * GROUP + rows % BLOCK_G
    row_ok = (tok < count) & (rows % BLOCK_G < GROUP)
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_offsets = (row0 + tok)[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    # Padding rows lie past the item's last token, so they see every key and never make a NaN.
    q_pos = pos0 + tok

    # The item's last token sees every key up to its own position; this split reads [start, end).
    context = pos0 + count
    split_len = tl.cdiv(tl.cdiv(context, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context)
    table = block_tables_ptr + seq * stride_table
    head_offset = kv_head * stride_c_head

    row_max = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off + head_offset
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        visible = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        alpha = tl.exp2(row_max - new_max)
        p = tl.exp2(scores - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + slot[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max

    if SPLIT:
        # A split past a short context's end read nothing: weight zero in the merge, and no 0/0.
        has_keys = row_sum > 0
        safe_sum = tl.where(has_keys, row_sum, 1.0)
        out = acc / safe_sum[:, None]
        partial = (item * tl.num_programs(1) * GROUP + head) * tl.num_programs(2) + split
        lse = tl.where(has_keys, row_max + tl.log2(safe_sum), float("-inf"))
        tl.store(lse_ptr + partial, lse, mask=row_ok)
        tl.store(
            out_ptr + partial[:, None] * HEAD_DIM + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :]
        )
    else:
        out = acc / row_sum[:, None]
        o_offsets = (row0 + tok)[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :]
        tl.store(
            out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :]
        )


@triton.jit
def merge_splits_kernel(
    partial_ptr,
    lse_ptr,
    items_ptr,
    out_ptr,
    num_splits,
    stride_item,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Grid (decode items, heads): weight each split's output by its share of the softmax mass."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    row = tl.load(items_ptr + item * stride_item + 1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_ok = splits < num_splits
    base = (item * tl.num_programs(1) + head) * num_splits
    lse = tl.load(lse_ptr + base + splits, mask=split_ok, other=float("-inf"))
    # Split 0 always holds keys (a context has at least one), so the maximum is finite.
    weights = tl.exp2(lse - tl.max(lse, 0))
    mask = split_ok[:, None] & (dims < HEAD_DIM)[None, :]
    parts = tl.load(partial_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + row * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


# Kernels are decorated for the interpreter or the compiler when this module is imported, whatever
# TRITON_INTERPRET says later; this is the truth the backend checks.
INTERPRETED = isinstance(paged_attention_kernel, InterpretedFunction)
