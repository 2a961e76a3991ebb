"""The Triton backend's kernels against attention written out in torch, on scattered blocks, every head
layout and mixed steps; the engine on them against SDPA; and the choice of backend.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, which tests/conftest.py sets
before anything imports Triton); with one they run compiled. triton_sm90.py compiles them for sm_90
here too, since the interpreter skips the compiler's checks.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.engines import prompts, run
from workers.engine.attention import (
    BackendUnavailableError,
    TritonBackend,
    build_metadata,
    choose_backend,
    triton_paged,
)
from workers.engine.engine_core import Engine, EngineConfig

pytestmark = pytest.mark.real

pytest.importorskip("triton", reason="the triton package is not installed (make test installs it)")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 4
NUM_BLOCKS = 96
DIM = 8  # not a tile size: the kernels pad head_dim to 16
# Small tiles, so that small inputs cross query tiles, key tiles and decode splits; 4 splits at most,
# so that a 70-token context hits the cap and its splits are widened to 32 keys.
TILES = {"query_tile": 16, "key_tile": 16, "split_len": 16, "max_splits": 4}
# fp32 kernels against a float64 reference: the largest error measured is 4.2e-7 (unit-scale outputs).
ATOL, RTOL = 2e-6, 1e-5


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention, in float64, of q [tokens, heads, dim] at positions start.. over one
    sequence's keys and values [context, kv_heads, dim]; query head h reads KV head h // group."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, 1)
    v = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("thd,khd->htk", q.double(), k) * DIM**-0.5
    visible = torch.arange(keys.shape[0]) <= torch.arange(start, start + q.shape[0])[:, None]
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.einsum("htk,khd->thd", weights, v).float()


def run_step(
    starts: list[int],
    q_lens: list[int],
    heads: int,
    kv_heads: int,
    seed: int,
    static_context: int | None = None,
) -> int | None:
    """One step of sequences that hold `starts` tokens of KV and run `q_lens` more, on blocks handed
    out in random order; checks the output and the whole cache, and returns the decodes' planned
    splits, None if the step has no decodes. static_context: plan the decodes as a captured decode
    graph does (TritonBackend.prepare_decodes), for contexts of up to that many tokens."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, DIM, generator=g)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, DIM, generator=g)
    free = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, full_k, full_v = [], [], []
    for start, q_len in zip(starts, q_lens, strict=True):
        total = start + q_len
        tables.append([free.pop() for _ in range(-(-total // BLOCK_SIZE))])
        full_k.append(torch.randn(total, kv_heads, DIM, generator=g))
        full_v.append(torch.randn(total, kv_heads, DIM, generator=g))
        for pos in range(start):
            block, offset = tables[-1][pos // BLOCK_SIZE], pos % BLOCK_SIZE
            k_cache[block, offset], v_cache[block, offset] = full_k[-1][pos], full_v[-1][pos]
    # What the cache must hold after the step: every slot it did not write is left as it was.
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for table, fk, fv, start in zip(tables, full_k, full_v, starts, strict=True):
        for pos in range(start, fk.shape[0]):
            block, offset = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            expected_k[block, offset], expected_v[block, offset] = fk[pos], fv[pos]
    meta = build_metadata(starts, q_lens, tables, BLOCK_SIZE, NUM_BLOCKS, DEVICE)
    q = torch.randn(sum(q_lens), heads, DIM, generator=g)
    k = torch.cat([fk[s:] for fk, s in zip(full_k, starts, strict=True)])
    v = torch.cat([fv[s:] for fv, s in zip(full_v, starts, strict=True)])
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)

    backend = TritonBackend(DEVICE, **TILES)
    if static_context is None:
        step = backend.prepare(meta, DIM**-0.5)
    else:
        items = torch.tensor([[i, i, s, 1] for i, s in enumerate(starts)], dtype=torch.int32, device=DEVICE)
        step = backend.prepare_decodes(
            items, meta.slot_mapping, meta.block_tables, BLOCK_SIZE, static_context, DIM**-0.5
        )
    out = step(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), k_cache, v_cache).cpu()

    assert torch.equal(k_cache.cpu(), expected_k)
    assert torch.equal(v_cache.cpu(), expected_v)
    row = 0
    for i, (start, q_len) in enumerate(zip(starts, q_lens, strict=True)):
        expected = reference(q[row : row + q_len], full_k[i], full_v[i], start)
        torch.testing.assert_close(out[row : row + q_len], expected, atol=ATOL, rtol=RTOL)
        row += q_len
    return None if step.decodes is None else step.decodes.num_splits


LAYOUTS = {"MHA": (4, 4), "GQA-4:1": (8, 2), "GQA-3:1": (6, 2), "MQA": (4, 1)}
STEPS = {
    # A prompt of three query tiles, the last one partial, its keys crossing blocks and key tiles.
    "prefill": ([0], [37]),
    # A chunk continuing mid-block after a cached prefix, over two query tiles.
    "cached-prefix": ([6], [19]),
    # Decodes of contexts 1 (a fresh one), block and key-tile boundaries, and longer than a split.
    "decodes": ([0, 7, 15, 40], [1, 1, 1, 1]),
    # Everything in one step, with a context (70) long enough to hit the split cap.
    "mixed": ([10, 0, 3, 69, 0, 8], [1, 6, 20, 1, 1, 5]),
}
# Decode splits each step must plan: 41 keys in 3 splits of 16; 70 keys capped at 4 splits, widened to
# whole key tiles of 32, which 3 splits cover. Each shorter context is cut in as many splits of its own.
EXPECTED_SPLITS = {"prefill": None, "cached-prefix": None, "decodes": 3, "mixed": 3}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("case", sorted(STEPS))
def test_triton_backend_matches_reference(case: str, layout: str) -> None:
    starts, q_lens = STEPS[case]
    heads, kv_heads = LAYOUTS[layout]
    planned = run_step(starts, q_lens, heads, kv_heads, seed=sum(starts) * 31 + sum(q_lens) + heads)
    assert planned == EXPECTED_SPLITS[case]


@pytest.mark.parametrize("layout", ["GQA-3:1", "MQA"])
def test_decodes_planned_for_any_context_match_reference(layout: str) -> None:
    """A decode graph's launch: planned for 96-token contexts (3 splits of 32), run on contexts of 1 to
    70, so that short ones leave whole splits empty."""
    heads, kv_heads = LAYOUTS[layout]
    planned = run_step([0, 6, 39, 69], [1, 1, 1, 1], heads, kv_heads, seed=heads, static_context=96)
    assert planned == 3


def test_engine_on_triton_matches_sdpa(tiny) -> None:
    """Greedy tokens through chunked prefill, prefix-cache hits and decodes, against the SDPA engine."""
    _, loaded = tiny
    vocab = len(loaded.tokenizer)
    rng = random.Random(3)
    system = [rng.randrange(vocab) for _ in range(21)]
    batch = [system + p for p in prompts(vocab, lengths=(1, 6, 19), seed=4)] + prompts(vocab, (2,), seed=5)
    tokens = {}
    for backend in ("torch_sdpa", "triton"):
        config = EngineConfig(block_size=4, num_blocks=128, max_prefill_chunk=12, backend=backend)
        engine = Engine(loaded, config)
        assert engine.runner.attention.name == backend
        # The first prompt alone first, so that the others find the system prompt cached.
        tokens[backend] = list(run(engine, batch[:1]).values()) + list(run(engine, batch[1:]).values())
    assert tokens["triton"] == tokens["torch_sdpa"]


def test_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.workers.engine.triton_sm90"],
        cwd=Path(__file__).parents[3],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "compiled for sm_90" in done.stdout


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the refusal is for a CPU without the interpreter")
def test_explicit_triton_on_cpu_needs_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    choice = choose_backend("triton", device=torch.device("cpu"), dtype=torch.float32, block_size=16)
    assert choice.backend.name == "triton"
    assert choice.reason == "triton was requested"
    # As if TRITON_INTERPRET had not been set when the kernels were first imported.
    monkeypatch.setattr(triton_paged.kernels(), "INTERPRETED", False)
    with pytest.raises(BackendUnavailableError, match=r"triton backend cannot run: .*TRITON_INTERPRET=1"):
        choose_backend("triton", device=torch.device("cpu"), dtype=torch.float32, block_size=16)


def test_missing_triton_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_paged.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError, match=r"triton package is not installed \(pip install"):
        TritonBackend(DEVICE)


def test_auto_never_picks_the_interpreter() -> None:
    choice = choose_backend(None, device=torch.device("cpu"), dtype=torch.float32, block_size=16)
    assert choice.backend.name == "torch_sdpa"
    assert choice.reason.startswith("auto chose torch_sdpa: flash_attn cannot run (")
    assert choice.reason.endswith("; triton cannot run (it needs a CUDA device)")


@pytest.mark.parametrize("tiles", [{"key_tile": 8}, {"query_tile": 24}])
def test_tiles_must_suit_tl_dot(tiles: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="must be a power of two of at least 16"):
        TritonBackend(DEVICE, **tiles)
