"""flash-attn cannot run on this CPU-only machine: asking for it must fail and say exactly why."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from workers.engine.attention import BackendUnavailableError, choose_backend
from workers.engine.attention.flash_attn import unavailable_reasons
from workers.engine.model import LlamaForCausalLM, ModelConfig
from workers.engine.model_runner import ModelRunner


def test_explicit_flash_attn_fails_with_every_reason() -> None:
    with pytest.raises(BackendUnavailableError) as err:
        choose_backend("flash_attn", device=torch.device("cpu"), dtype=torch.float32, block_size=16)
    message = str(err.value)
    assert message.startswith("the flash_attn backend cannot run: ")
    assert "CUDA device" in message
    assert "float16 or bfloat16" in message
    assert "multiple of 256, got 16" in message
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn package is not installed" in message


def test_block_size_is_checked_on_its_own() -> None:
    reasons = unavailable_reasons(torch.device("cpu"), torch.bfloat16, 512)
    assert not any("block_size" in r for r in reasons)
    assert not any("bfloat16" in r for r in reasons)
    assert any("block_size" in r for r in unavailable_reasons(torch.device("cpu"), torch.bfloat16, 200))


def test_runner_refuses_flash_attn_here() -> None:
    config = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 16,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
        }
    )
    with pytest.raises(BackendUnavailableError, match="flash_attn backend cannot run"):
        ModelRunner(LlamaForCausalLM(config), num_blocks=4, block_size=256, backend="flash_attn")
