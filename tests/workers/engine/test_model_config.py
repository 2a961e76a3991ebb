"""config.json parsing and RoPE frequencies, against transformers' own reading of the same files."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from workers.engine.model import ModelConfig, UnsupportedModelError
from workers.engine.model.rope import inverse_frequencies

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    "rope_fields",
    [
        {"rope_theta": 10000.0},
        {"rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_theta": 500000.0, "rope_scaling": LLAMA3},
        {"rope_parameters": {"rope_theta": 500000.0, **LLAMA3}},
    ],
    ids=["default", "linear-legacy", "llama3-legacy", "llama3-rope_parameters"],
)
def test_inverse_frequencies_match_transformers(rope_fields: dict) -> None:
    hf = LlamaConfig(**{k: v for k, v in BASE.items() if k != "model_type"}, **rope_fields)
    rotary = LlamaRotaryEmbedding(hf)
    rope_type = hf.rope_parameters["rope_type"]
    config = ModelConfig.from_hf({**BASE, **rope_fields})
    assert config.rope.type == rope_type
    assert rotary.attention_scaling == 1.0
    assert torch.equal(inverse_frequencies(config.rope, config.head_dim), rotary.inv_freq)


def test_llama3_scaling_changes_only_slow_frequencies() -> None:
    plain = inverse_frequencies(ModelConfig.from_hf({**BASE, "rope_theta": 500000.0}).rope, 16)
    scaled = inverse_frequencies(
        ModelConfig.from_hf({**BASE, "rope_theta": 500000.0, "rope_scaling": LLAMA3}).rope, 16
    )
    assert scaled[0] == plain[0]
    assert torch.allclose(scaled[-1], plain[-1] / 8)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn", "longrope"])
def test_unsupported_rope_type_fails_loudly(rope_type: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"rope scaling type '{rope_type}' is not supported"):
        ModelConfig.from_hf({**BASE, "rope_scaling": {"rope_type": rope_type, "factor": 2.0}})


def test_unsupported_architecture_and_activation_fail_loudly() -> None:
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**BASE, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'gelu'"):
        ModelConfig.from_hf({**BASE, "hidden_act": "gelu"})


def test_family_differences() -> None:
    qwen = ModelConfig.from_hf(
        {**BASE, "model_type": "qwen2", "sliding_window": 32, "use_sliding_window": False}
    )
    assert (qwen.qkv_bias, qwen.o_bias) == (True, False)
    assert qwen.max_context_len == 4096
    llama = ModelConfig.from_hf({**BASE, "attention_bias": True})
    assert (llama.qkv_bias, llama.o_bias) == (True, True)
    mistral = ModelConfig.from_hf({**BASE, "model_type": "mistral", "head_dim": 32, "sliding_window": 1024})
    assert (mistral.head_dim, mistral.q_size, mistral.kv_size) == (32, 128, 64)
    # Windowed attention equals full attention while the context fits in the window.
    assert mistral.max_context_len == 1024


def test_eos_ids_merge_config_and_generation_config() -> None:
    config = ModelConfig.from_hf({**BASE, "eos_token_id": 2}, {"eos_token_id": [7, 2]})
    assert config.eos_token_ids == (2, 7)
    assert ModelConfig.from_hf(BASE).num_kv_heads == 2
    assert ModelConfig.from_hf({**BASE, "num_key_value_heads": None}).num_kv_heads == 4
