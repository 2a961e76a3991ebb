"""Mixtral and Qwen2-MoE against transformers' implementations of the same random configs (fp32, CPU):
last-position logits through the paged KV runner, and greedy tokens through the whole engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.support.hf_models import hf_greedy
from tests.support.moe_models import NoText, engine_greedy, mixtral, prompts, qwen2_moe, save, small_engine
from workers.engine.batch import ScheduledChunk
from workers.engine.loader import LoadedModel, load_weights
from workers.engine.model import ModelConfig, UnsupportedModelError
from workers.engine.model.moe import SparseMoeBlock
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams

PROMPT_LENS = (1, 5, 11, 19, 30)
MAX_NEW = 10


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe"])
def tiny_moe(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    torch.manual_seed(0)
    hf = mixtral() if request.param == "mixtral" else qwen2_moe()
    return hf, save(hf, tmp_path_factory.mktemp(request.param))


def test_moe_layers_and_experts_load_where_the_config_says(tiny_moe: tuple[PreTrainedModel, Path]) -> None:
    hf, folder = tiny_moe
    model = load_weights(folder)
    moe = model.config.moe
    assert moe is not None and moe.num_experts == 8 and moe.top_k == 2
    sparse = [i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == list(moe.layers) == ([0, 1] if hf.config.model_type == "mixtral" else [0, 2])
    # transformers 5 keeps experts stacked as we do (and saves them per expert), so expert 5's weights
    # compare directly after the round trip through the checkpoint's names.
    block, hf_experts = model.model.layers[0].mlp, hf.model.layers[0].mlp.experts
    torch.testing.assert_close(block.experts.gate_up_proj[5], hf_experts.gate_up_proj[5], atol=0, rtol=0)
    torch.testing.assert_close(block.experts.down_proj[5], hf_experts.down_proj[5], atol=0, rtol=0)
    assert (block.shared_expert is not None) == (hf.config.model_type == "qwen2_moe")


def test_moe_logits_match_hf(tiny_moe: tuple[PreTrainedModel, Path]) -> None:
    hf, folder = tiny_moe
    model = load_weights(folder)
    runner = ModelRunner(model, num_blocks=64, block_size=4, num_threads=1)
    greedy = SamplingParams(temperature=0.0)
    for i, prompt in enumerate(prompts(256, PROMPT_LENS, seed=3)):
        table = list(range(i * 10, (i + 1) * 10))
        ours = runner.compute_logits([ScheduledChunk(i, prompt, 0, table, True, greedy)])
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0, -1:].float()
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


def test_moe_engine_greedy_matches_hf_generate(tiny_moe: tuple[PreTrainedModel, Path]) -> None:
    hf, folder = tiny_moe
    model = load_weights(folder)
    loaded = LoadedModel(model, NoText(), "tiny-moe", model.config, folder)  # type: ignore[arg-type]
    prompt_ids = prompts(256, PROMPT_LENS, seed=4)
    expected = hf_greedy(hf, prompt_ids, MAX_NEW)
    assert sum(len(e) for e in expected) > 3 * len(prompt_ids), "the reference stopped too early to test much"
    assert engine_greedy(small_engine(loaded), prompt_ids, MAX_NEW) == expected


def test_routing_counts_each_token_top_k_times_per_moe_layer(tiny_moe: tuple[PreTrainedModel, Path]) -> None:
    _, folder = tiny_moe
    model = load_weights(folder)
    assert model.routing is not None and model.config.moe is not None
    runner = ModelRunner(model, num_blocks=16, block_size=4, num_threads=1)
    layers = len(model.config.moe.layers)
    for tokens in (17, 5):
        chunk = ScheduledChunk(tokens, list(range(3, 3 + tokens)), 0, list(range(8)), True, SamplingParams())
        runner.compute_logits([chunk])
        assert model.routing.last_step.shape == (8,)
        assert int(model.routing.last_step.sum()) == tokens * 2 * layers
    assert int(model.routing.total.sum()) == (17 + 5) * 2 * layers
    by_rank = model.routing.per_rank(model.routing.total, 4)
    assert by_rank.tolist() == model.routing.total.view(4, 2).sum(1).tolist()


def test_unsupported_moe_variants_are_refused() -> None:
    base = {
        "model_type": "qwen2_moe",
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 4,
    }
    with pytest.raises(UnsupportedModelError, match="without MoE layers"):
        ModelConfig.from_hf({**base, "mlp_only_layers": [0, 1]})
    with pytest.raises(UnsupportedModelError, match="deepseek"):
        ModelConfig.from_hf({**base, "model_type": "deepseek_v3"})
