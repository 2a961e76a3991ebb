"""The SDPA backend against attention written out by hand, on scattered blocks and mixed steps."""

from __future__ import annotations

import pytest
import torch

from workers.engine.attention import TorchSdpaBackend, build_metadata, choose_backend

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEADS, KV_HEADS, DIM = 6, 2, 8


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal GQA attention of q (positions start..) over one sequence's whole K/V, head by head."""
    group = HEADS // KV_HEADS
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        visible = start + t + 1
        for h in range(HEADS):
            scores = keys[:visible, h // group] @ q[t, h] * DIM**-0.5
            out[t, h] = torch.softmax(scores, dim=0) @ values[:visible, h // group]
    return out


def run_step(starts: list[int], q_lens: list[int], seed: int) -> None:
    """One step of sequences that already hold `starts` tokens of KV and run `q_lens` more."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    # Scattered, non-increasing block ids, as a block manager hands them out after churn.
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, full_k, full_v = [], [], []
    for start, q_len in zip(starts, q_lens, strict=True):
        total = start + q_len
        tables.append([free.pop() for _ in range(-(-total // BLOCK_SIZE))])
        full_k.append(torch.randn(total, KV_HEADS, DIM, generator=g))
        full_v.append(torch.randn(total, KV_HEADS, DIM, generator=g))
        for pos in range(start):
            block, offset = tables[-1][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            k_cache[block, offset], v_cache[block, offset] = full_k[-1][pos], full_v[-1][pos]
    meta = build_metadata(starts, q_lens, tables, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    q = torch.randn(sum(q_lens), HEADS, DIM, generator=g)
    k = torch.cat([fk[s:] for fk, s in zip(full_k, starts, strict=True)])
    v = torch.cat([fv[s:] for fv, s in zip(full_v, starts, strict=True)])

    out = TorchSdpaBackend().prepare(meta, DIM**-0.5)(q, k, v, k_cache, v_cache)

    row = 0
    for i, (start, q_len) in enumerate(zip(starts, q_lens, strict=True)):
        expected = reference(q[row : row + q_len], full_k[i], full_v[i], start)
        torch.testing.assert_close(out[row : row + q_len], expected, atol=1e-5, rtol=1e-5)
        row += q_len
        for pos in range(start + q_len):
            block, offset = tables[i][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            assert torch.equal(k_cache[block, offset], full_k[i][pos])
            assert torch.equal(v_cache[block, offset], full_v[i][pos])


@pytest.mark.parametrize(
    ("starts", "q_lens"),
    [
        ([0], [9]),  # one prompt, nothing cached: the no-gather path
        ([8], [5]),  # a chunk after a block-aligned cached prefix
        ([6], [7]),  # a chunk continuing mid-block
        ([5, 0, 12, 3], [1, 1, 1, 1]),  # decodes of different context lengths, one of them fresh
        ([4, 4], [1, 1]),  # decodes filling their blocks exactly: no padding mask
        ([10, 0, 3, 7, 0], [1, 6, 4, 1, 1]),  # everything mixed in one step
    ],
)
def test_sdpa_backend_matches_reference(starts: list[int], q_lens: list[int]) -> None:
    run_step(starts, q_lens, seed=sum(starts) * 31 + sum(q_lens))


def test_metadata_layout() -> None:
    meta = build_metadata([3, 0], [2, 3], [[7, 2], [5]], BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    assert meta.positions.tolist() == [3, 4, 0, 1, 2]
    # Position 3 is the last slot of block 7, position 4 the first of block 2.
    assert meta.slot_mapping.tolist() == [7 * 4 + 3, 2 * 4 + 0, 5 * 4, 5 * 4 + 1, 5 * 4 + 2]
    assert meta.block_tables.tolist() == [[7, 2], [5, 0]]
    assert meta.cu_seqlens_q.tolist() == [0, 2, 5]
    assert meta.cu_seqlens_k.tolist() == [0, 5, 8]
    assert meta.context_lens == (5, 3)


@pytest.mark.parametrize(
    ("starts", "q_lens", "tables", "message"),
    [
        ([6], [3], [[0, 1]], "cannot hold 9 tokens"),
        ([0], [2], [[NUM_BLOCKS]], "block ids must lie in"),
        ([0], [0], [[1]], "runs no tokens"),
    ],
)
def test_metadata_refuses_bad_steps(starts: list[int], q_lens: list[int], tables: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_metadata(starts, q_lens, tables, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))


def test_auto_selects_sdpa_on_cpu() -> None:
    choice = choose_backend(None, device=torch.device("cpu"), dtype=torch.float32, block_size=16)
    backend = choice.backend
    assert "auto chose torch_sdpa" in choice.reason
    assert backend.name == "torch_sdpa"
    with pytest.raises(ValueError, match="unknown attention backend"):
        choose_backend("xformers", device=torch.device("cpu"), dtype=torch.float32, block_size=16)
