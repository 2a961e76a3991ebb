"""The runner's own duties: KV sizing, step flattening, which rows sample, and its refusals."""

from __future__ import annotations

import pytest
import torch

from workers.engine.batch import ScheduledChunk
from workers.engine.model import LlamaForCausalLM, ModelConfig
from workers.engine.model_runner import ModelRunner, kv_bytes_per_token, num_blocks_for_budget
from workers.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0)
TINY = {
    "model_type": "llama",
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(ModelConfig.from_hf(TINY)).eval()


def chunk(seq_id: int, tokens: list[int], start: int, table: list[int], **kw: object) -> ScheduledChunk:
    return ScheduledChunk(
        seq_id, tokens, start, table, kw.pop("sample", True), kw.pop("sampling", GREEDY), **kw
    )


def test_kv_sizing() -> None:
    smollm2_like = ModelConfig.from_hf(
        {
            **TINY,
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
        }
    )
    assert kv_bytes_per_token(smollm2_like, torch.float32) == 2 * 30 * 3 * 64 * 4
    assert kv_bytes_per_token(smollm2_like, torch.bfloat16) == 2 * 30 * 3 * 64 * 2
    assert num_blocks_for_budget(1 << 30, smollm2_like, 16, torch.float32) == (1 << 30) // (46080 * 16)


def test_cache_layout(model: LlamaForCausalLM) -> None:
    runner = ModelRunner(model, num_blocks=10, block_size=8)
    assert runner.kv_cache.shape == (2, 2, 10, 8, 2, 8)
    assert runner.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4
    assert runner.attention.name == "torch_sdpa"


def test_only_sampling_chunks_produce_outputs_in_order(model: LlamaForCausalLM) -> None:
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    out = runner.execute(
        [
            chunk(7, [1, 2, 3, 4, 5], 0, [0, 1]),
            chunk(3, [6, 7, 8], 0, [2], sample=False),
            chunk(5, [9], 0, [3]),
        ]
    )
    assert [o.seq_id for o in out] == [7, 5]
    assert all(o.logprob is None for o in out)
    assert runner.execute([chunk(3, [1], 0, [4], sample=False)]) == []
    assert runner.execute([]) == []


def test_batched_step_equals_separate_steps(model: LlamaForCausalLM) -> None:
    """Flattening must keep sequences apart: no token may see another sequence's KV."""
    runner = ModelRunner(model, num_blocks=32, block_size=4)
    prompts = [[5, 9, 2, 11, 40, 3, 8], [17, 4], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69]]
    tables = [[0, 1], [2], [3, 4, 5]]
    batched = runner.compute_logits([chunk(i, p, 0, tables[i]) for i, p in enumerate(prompts)])
    separate = torch.cat(
        [runner.compute_logits([chunk(i, p, 0, [t + 10 for t in tables[i]])]) for i, p in enumerate(prompts)]
    )
    assert batched.shape == (3, TINY["vocab_size"]) and batched.dtype == torch.float32
    torch.testing.assert_close(batched, separate, atol=1e-5, rtol=0)
    # A decode in the same step as another sequence's prefill sees only its own context.
    next_logits = runner.compute_logits([chunk(1, [23], 2, [2]), chunk(9, prompts[0], 0, [20, 21])])
    alone = runner.compute_logits([chunk(1, [23], 2, [12])])
    torch.testing.assert_close(next_logits[:1], alone, atol=1e-5, rtol=0)


def test_logprobs_and_seeds_reach_the_outputs(model: LlamaForCausalLM) -> None:
    runner = ModelRunner(model, num_blocks=8, block_size=4)
    params = SamplingParams(temperature=1.0, seed=5, logprobs=3)
    first = runner.execute([chunk(0, [1, 2, 3], 0, [0], sampling=params, num_generated=4)])[0]
    again = runner.execute([chunk(0, [1, 2, 3], 0, [1], sampling=params, num_generated=4)])[0]
    assert first == again
    assert first.logprob is not None and first.logprob <= 0
    assert first.top_logprobs is not None and len(first.top_logprobs) == 3


def test_forks_sample_from_their_parents_row_with_their_own_params(model: LlamaForCausalLM) -> None:
    runner = ModelRunner(model, num_blocks=16, block_size=4)
    seeded = [SamplingParams(temperature=1.0, seed=seed, logprobs=2) for seed in (11, 12)]
    parent = chunk(1, [1, 2, 3, 4, 5], 0, [0, 1], forks=((2, seeded[0]), (3, GREEDY), (4, seeded[1])))
    out = runner.execute([chunk(9, [7, 8], 0, [2]), parent, chunk(5, [9], 0, [3])])
    assert [o.seq_id for o in out] == [9, 1, 2, 3, 4, 5]
    # Each fork's token is what its own params draw from the parent's last position, run alone.
    for o, params in zip(out[2:5], [seeded[0], GREEDY, seeded[1]], strict=True):
        alone = runner.execute([chunk(o.seq_id, [1, 2, 3, 4, 5], 0, [4, 5], sampling=params)])[0]
        assert (o.seq_id, o.token_id) == (alone.seq_id, alone.token_id)
        assert o.logprob == pytest.approx(alone.logprob, abs=1e-4)
    assert out[3].token_id == out[1].token_id, "greedy fork and greedy parent agree"


def test_refusals(model: LlamaForCausalLM) -> None:
    runner = ModelRunner(model, num_blocks=40, block_size=2)
    with pytest.raises(ValueError, match="64-token context"):
        runner.execute([chunk(0, [1] * 10, 60, list(range(35)))])
    with pytest.raises(ValueError, match="cannot hold"):
        runner.execute([chunk(0, [1, 2, 3], 0, [0])])
    with pytest.raises(ValueError, match="num_blocks and block_size"):
        ModelRunner(model, num_blocks=0)
