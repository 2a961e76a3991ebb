"""Decode graphs: the padded step a CUDA graph captures, run here without capturing it (the Triton
kernels in their interpreter), gives eager's tokens and logits and stores no pad row's K/V; where
graphs cannot be captured, the runner says why, and refuses when told to insist."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.support.engines import prompts
from tests.support.moe_models import mixtral, save
from workers.engine.attention import BackendUnavailableError
from workers.engine.batch import ScheduledChunk
from workers.engine.decode_graphs import BATCH_LADDER, DecodeGraphs, batch_sizes_for
from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.loader import load_weights
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams

pytest.importorskip("triton", reason="the triton package is not installed (make test installs it)")

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)


def graphs_for(runner: ModelRunner, batch_sizes: tuple[int, ...], max_context: int = 128) -> DecodeGraphs:
    return runner.build_decode_graphs(batch_sizes, capture=False, max_context=max_context)


def decode(seq_id: int, token: int, position: int, sample: bool = True) -> ScheduledChunk:
    """Sequence seq_id owns blocks [8 * seq_id, 8 * seq_id + 8): 32 positions."""
    table = list(range(8 * seq_id, 8 * seq_id + position // BLOCK_SIZE + 1))
    return ScheduledChunk(seq_id, [token], position, table, sample, GREEDY)


def shrinking_batch(engine: Engine, batch: list[list[int]]) -> list[list[int]]:
    """Greedy tokens of five prompts asking for 2, 4, 6, 8 and 10 tokens: once all are prefilled, the
    decode batch shrinks from 5 to 1 as they finish."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 4, 6, 8, 10)]
    ids = [engine.add_request(p, s) for p, s in zip(batch, params, strict=True)]
    out: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for delta in engine.step():
            out[delta.request_id] += delta.new_token_ids
    return [out[i] for i in ids]


def test_the_ladder_ends_at_the_first_size_that_holds_the_batch() -> None:
    assert batch_sizes_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_sizes_for(100) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert batch_sizes_for(1) == (1,)
    assert batch_sizes_for(300) == (*BATCH_LADDER, 300)
    with pytest.raises(ValueError, match="at least 1"):
        batch_sizes_for(0)


@pytest.mark.real
def test_padded_decodes_give_eager_greedy_tokens(tiny) -> None:
    """Five requests prefilled in one step, whose batch then shrinks as they finish: steps of 5, 4, 3, 2
    and 1 decodes, padded to 8, 4, 4, 2 and 1."""
    _, loaded = tiny
    vocab = len(loaded.tokenizer)
    batch = prompts(vocab, lengths=(3, 9, 17, 30, 5), seed=8)
    tokens, padded_to = {}, []
    for graphs in (False, True):
        config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=128, backend="triton")
        engine = Engine(loaded, config)
        runner = engine.runner
        assert isinstance(runner, ModelRunner) and runner.decode_graphs is None  # no CUDA here
        if graphs:
            runner.decode_graphs = graphs_for(runner, (1, 2, 4, 8))
            run_padded = runner.decode_graphs.run

            def counted(chunks, run_padded=run_padded) -> torch.Tensor:
                padded_to.append(len(chunks))
                return run_padded(chunks)

            runner.decode_graphs.run = counted  # type: ignore[method-assign]
        tokens[graphs] = shrinking_batch(engine, batch)
    assert tokens[True] == tokens[False]
    assert [len(t) for t in tokens[True]] == [2, 4, 6, 8, 10]
    # Every decode-only step went through the padded path, at every batch size from 5 down to 1.
    assert set(padded_to) == {1, 2, 3, 4, 5}


@pytest.mark.real
def test_padded_logits_equal_eager_and_pad_rows_store_nothing(tiny) -> None:
    _, loaded = tiny
    config = EngineConfig(block_size=BLOCK_SIZE, num_blocks=64, backend="triton")
    runner = Engine(loaded, config).runner
    assert isinstance(runner, ModelRunner)
    graphs = graphs_for(runner, (1, 4))
    prompt = prompts(len(loaded.tokenizer), lengths=(6, 11, 2, 9), seed=2)
    runner.compute_logits(
        [ScheduledChunk(i, p, 0, list(range(8 * i, 8 * i + 3)), True, GREEDY) for i, p in enumerate(prompt)]
    )
    # A step of four decodes leaves its slots in the buffers; the next step has three.
    four = [decode(i, 7 + i, len(p)) for i, p in enumerate(prompt)]
    torch.testing.assert_close(graphs.run(four), runner.compute_logits(four), atol=1e-5, rtol=1e-5)
    three = [decode(i, 11 + i, len(p) + 1) for i, p in enumerate(prompt[:3])]
    # Sequence 3 is gone, and its last slot is about to be someone else's: the pad row that takes its
    # place in the buffers must not write its stale K/V there again.
    stale = len(prompt[3])
    runner.kv_cache[:, :, 8 * 3 + stale // BLOCK_SIZE, stale % BLOCK_SIZE] = 0
    before = runner.kv_cache.clone()
    padded = graphs.run(three)
    after = runner.kv_cache.clone()
    runner.kv_cache.copy_(before)
    eager = runner.compute_logits(three)
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    # The padded step wrote what the eager one did (to float rounding: a batch of four rows is not
    # multiplied in the same order as one of three), at the three decodes' slots and nowhere else.
    torch.testing.assert_close(after, runner.kv_cache, atol=1e-5, rtol=1e-5)
    changed = (after != before).flatten(4).any(-1)  # [layers, K/V, blocks, offsets]
    written = {(int(b), int(o)) for b, o in changed.any(0).any(0).nonzero()}
    assert written == {
        (8 * i + (len(p) + 1) // BLOCK_SIZE, (len(p) + 1) % BLOCK_SIZE) for i, p in enumerate(prompt[:3])
    }


def test_only_the_sampling_rows_come_back(tiny) -> None:
    _, loaded = tiny
    runner = Engine(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=64, backend="triton")).runner
    assert isinstance(runner, ModelRunner)
    graphs = graphs_for(runner, (2,))
    # A one-token prefill chunk that does not end its prompt writes its K/V but samples nothing.
    step = [decode(0, 5, 0, sample=False), decode(1, 6, 0)]
    logits = graphs.run(step)
    assert logits.shape == (1, loaded.config.vocab_size)
    torch.testing.assert_close(logits, runner.compute_logits(step), atol=1e-5, rtol=1e-5)


def test_what_the_graphs_cover(tiny) -> None:
    _, loaded = tiny
    runner = Engine(loaded, EngineConfig(block_size=BLOCK_SIZE, num_blocks=64, backend="triton")).runner
    assert isinstance(runner, ModelRunner)
    graphs = graphs_for(runner, (1, 2), max_context=24)
    assert graphs.covers([decode(0, 1, 23), decode(1, 1, 0)])
    assert not graphs.covers([])
    assert not graphs.covers([decode(0, 1, 3), decode(1, 1, 3), decode(2, 1, 3)])  # more than the largest
    assert not graphs.covers([decode(0, 1, 24)])  # past the buffers' context
    assert not graphs.covers([ScheduledChunk(0, [1], 3, list(range(7)), True, GREEDY)])  # a longer table
    prefill = ScheduledChunk(0, [1, 2], 0, [0], True, GREEDY)
    assert not graphs.covers([prefill])
    with pytest.raises(ValueError, match="distinct, ascending and positive"):
        graphs_for(runner, (4, 2))


def test_the_runner_says_why_decode_runs_eager(tiny, tmp_path) -> None:
    _, loaded = tiny
    sdpa = ModelRunner(loaded.model, num_blocks=8, block_size=BLOCK_SIZE)
    assert sdpa.decode_graphs is None
    assert sdpa.graphs_reason == (
        "decode runs eager: CUDA graphs need a CUDA device, and the model is on cpu; decode graphs are "
        "captured over the Triton kernels, and attention is torch_sdpa"
    )
    with pytest.raises(
        BackendUnavailableError, match="decode graphs need the triton backend, not torch_sdpa"
    ):
        sdpa.build_decode_graphs((1,), capture=False)
    off = ModelRunner(loaded.model, num_blocks=8, block_size=BLOCK_SIZE, cuda_graphs=False)
    assert off.graphs_reason == "decode runs eager: CUDA graphs were turned off"
    with pytest.raises(
        BackendUnavailableError, match="decode CUDA graphs cannot be captured: CUDA graphs need"
    ):
        ModelRunner(loaded.model, num_blocks=8, block_size=BLOCK_SIZE, backend="triton", cuda_graphs=True)
    moe = load_weights(save(mixtral(), tmp_path / "mixtral"))
    moe_runner = ModelRunner(moe, num_blocks=8, block_size=BLOCK_SIZE, backend="triton")
    assert moe_runner.graphs_reason.endswith(
        "a mixture-of-experts layer groups tokens by expert in shapes the gate decides"
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="capture and replay need a CUDA device")
def test_captured_graphs_give_eager_greedy_tokens_on_cuda(tiny) -> None:
    """What the CPU tests cannot run: the graphs captured and replayed, against eager on the same GPU."""
    _, loaded = tiny
    on_gpu = dataclasses.replace(loaded, model=load_weights(loaded.path, device="cuda"))
    batch = prompts(len(loaded.tokenizer), lengths=(3, 9, 17, 30, 5), seed=8)
    tokens = {}
    for graphs in (False, True):
        config = EngineConfig(
            block_size=16, num_blocks=64, max_num_seqs=8, backend="triton", cuda_graphs=graphs
        )
        engine = Engine(on_gpu, config)
        assert isinstance(engine.runner, ModelRunner)
        assert (engine.runner.decode_graphs is not None) == graphs
        tokens[graphs] = shrinking_batch(engine, batch)
    assert tokens[True] == tokens[False]
