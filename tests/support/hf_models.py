"""Tiny random Hugging Face models for engine tests, and HF's own greedy generation as the reference
the engine's tokens are compared with."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import LlamaConfig, PreTrainedModel


def tiny_llama_config(vocab_size: int, eos_token_id: int | None = None) -> LlamaConfig:
    """A 2-layer Llama with GQA (4 query heads on 2 KV heads), small enough for a test's CPU."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
    )


def hf_greedy(
    model: PreTrainedModel, prompts: Sequence[list[int]], max_new: int, ignore_eos: bool = False
) -> list[list[int]]:
    """The HF reference: one unpadded sequence at a time, so padding never enters HF's numbers;
    `ignore_eos` generates exactly `max_new` tokens whatever comes out."""
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new if ignore_eos else None,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs
