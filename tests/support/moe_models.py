"""Tiny random Mixtral- and Qwen2-MoE-shaped checkpoints built with transformers, and a greedy driver
for the engine, shared by the MoE and expert-parallel tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.loader import LoadedModel
from workers.engine.sampling_params import SamplingParams

NUM_EXPERTS = 8

_COMMON: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=2,
    bos_token_id=1,
    num_experts_per_tok=2,
    # Wide weights, so that two correct implementations' rounding cannot flip a greedy choice or a
    # top-k expert pick.
    initializer_range=0.2,
)


def mixtral(**overrides: Any) -> MixtralForCausalLM:
    config = MixtralConfig(
        **_COMMON, intermediate_size=96, num_hidden_layers=2, num_local_experts=NUM_EXPERTS, **overrides
    )
    return MixtralForCausalLM(config).eval()


def qwen2_moe() -> Qwen2MoeForCausalLM:
    """Three layers, the middle one dense (`mlp_only_layers`), a shared expert, unnormalised top-k."""
    config = Qwen2MoeConfig(
        **_COMMON,
        intermediate_size=80,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=72,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        num_experts=NUM_EXPERTS,
        norm_topk_prob=False,
    )
    return Qwen2MoeForCausalLM(config).eval()


def save(hf: PreTrainedModel, folder: Path) -> Path:
    hf.save_pretrained(folder)
    return folder


def prompts(vocab: int, lens: Sequence[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


class NoText:
    """The engine's detokenizer needs a decoder; these tests compare token ids only."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def engine_greedy(engine: Engine, prompt_ids: Sequence[list[int]], max_new: int) -> list[list[int]]:
    """Every prompt at once through the engine's scheduler (continuous batching, chunked prefill)."""
    sampling = SamplingParams(temperature=0.0, max_tokens=max_new)
    ids = [engine.add_request(list(p), sampling) for p in prompt_ids]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def small_engine(loaded: LoadedModel) -> Engine:
    """Block size 4 and 9-token prefill chunks, so prompts span blocks and share steps with decodes."""
    config = EngineConfig(block_size=4, num_blocks=128, max_prefill_chunk=9, num_threads=1)
    return Engine(loaded, config)
