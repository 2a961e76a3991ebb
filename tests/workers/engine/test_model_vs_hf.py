"""The engine's greedy outputs against HF transformers `generate`, token for token (fp32, CPU).

A small driver stands in for the scheduler: it gives each sequence its own run of blocks and can
split prompts into chunks that share steps with other sequences' decodes, or start a sequence from
another sequence's cached full blocks. Every schedule must reproduce the HF reference exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from protocol.prompts import chat_prompt_ids
from tests.support.hf_models import hf_greedy
from workers.engine.batch import ScheduledChunk
from workers.engine.loader import LoadedModel, load_model, load_weights
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.real

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 20)
TINY_PROMPT_LENS = (1, 3, 7, 12, 17, 26, 33, 45)


@dataclass
class _Seq:
    seq_id: int
    prompt: list[int]
    block_table: list[int]
    # Tokens whose KV is in the cache: the cached prefix at first, then whatever has run.
    done: int = 0
    out: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out


def drive(
    runner: ModelRunner,
    seqs: Sequence[_Seq],
    max_new: int,
    eos: Sequence[int],
    *,
    batch_size: int,
    chunk: int | None = None,
    admit_per_step: int | None = None,
) -> list[list[int]]:
    """Greedy-decode `seqs` to completion; up to `batch_size` run at once.

    chunk: most prompt tokens a sequence runs per step (None: the whole rest of its prompt).
    admit_per_step: sequences joining per step, so later prompts' chunks meet earlier decodes.
    """
    waiting, running = list(seqs), []
    while waiting or running:
        admit = min(batch_size - len(running), admit_per_step or batch_size, len(waiting))
        running += [waiting.pop(0) for _ in range(admit)]
        chunks = []
        for s in running:
            tokens = s.tokens
            end = len(tokens) if chunk is None else min(len(tokens), s.done + chunk)
            chunks.append(
                ScheduledChunk(
                    s.seq_id,
                    tokens[s.done : end],
                    s.done,
                    s.block_table,
                    end == len(tokens),
                    GREEDY,
                    len(s.out),
                )
            )
            s.done = end
        outputs = {o.seq_id: o.token_id for o in runner.execute(chunks)}
        for s in running:
            if s.seq_id in outputs:
                s.out.append(outputs[s.seq_id])
        running = [s for s in running if len(s.out) < max_new and not (s.out and s.out[-1] in eos)]
    return [s.out for s in seqs]


def fresh_seqs(prompts: Sequence[list[int]], blocks_per_seq: int) -> list[_Seq]:
    return [
        _Seq(i, list(p), list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
        for i, p in enumerate(prompts)
    ]


def run_three_ways(
    runner: ModelRunner,
    prompts: Sequence[list[int]],
    max_new: int,
    eos: Sequence[int],
    blocks_per_seq: int,
    batch_size: int,
    chunk: int,
) -> dict[str, list[list[int]]]:
    """Whole-prompt prefill, chunked prefill mixed with decodes, and a cached prefix."""
    results = {
        "whole": drive(runner, fresh_seqs(prompts, blocks_per_seq), max_new, eos, batch_size=batch_size),
        "chunked": drive(
            runner,
            fresh_seqs(prompts, blocks_per_seq),
            max_new,
            eos,
            batch_size=batch_size,
            chunk=chunk,
            admit_per_step=1,
        ),
    }
    # Cached prefix: sequence i + n starts from sequence i's full prompt blocks (their KV is still in
    # the cache from the chunked run), and prefills only the rest of its prompt.
    seqs = fresh_seqs(prompts, blocks_per_seq)
    n = len(prompts)
    for s in seqs:
        owner_table = list(range(s.seq_id * blocks_per_seq, (s.seq_id + 1) * blocks_per_seq))
        shared = (len(s.prompt) - 1) // BLOCK_SIZE
        own = list(range((s.seq_id + n) * blocks_per_seq, (s.seq_id + n + 1) * blocks_per_seq))
        s.seq_id += n
        s.block_table = owner_table[:shared] + own[shared:]
        s.done = shared * BLOCK_SIZE
    results["cached_prefix"] = drive(runner, seqs, max_new, eos, batch_size=batch_size)
    return results


def tiny_prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in TINY_PROMPT_LENS]


def _tiny_common() -> dict:
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=2,
        bos_token_id=1,
        # Wider than HF's default 0.02, so top logits are far enough apart that float rounding
        # differences between two correct implementations cannot flip a greedy choice.
        initializer_range=0.2,
    )


TINY_MODELS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {"tie_word_embeddings": False}),
    "llama3_rope_bias_tied": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"tie_word_embeddings": True}),
    # head_dim set apart from hidden_size / heads, as Mistral Nemo does.
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 32, "sliding_window": None}),
}


@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, Path]:
    config_cls, model_cls, extra = TINY_MODELS[request.param]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**_tiny_common(), **extra)).eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return hf, folder


@pytest.mark.parametrize("batch_size", [1, 8])
def test_tiny_models_match_hf_greedy(tiny: tuple[PreTrainedModel, Path], batch_size: int) -> None:
    hf, folder = tiny
    model = load_weights(folder)
    max_new = 12
    prompts = tiny_prompts(model.config.vocab_size, seed=1)
    expected = hf_greedy(hf, prompts, max_new)
    assert sum(len(e) for e in expected) > 4 * len(prompts), "the reference stopped too early to test much"
    blocks_per_seq = -(-(max(TINY_PROMPT_LENS) + max_new) // BLOCK_SIZE)
    runner = ModelRunner(model, num_blocks=2 * len(prompts) * blocks_per_seq, block_size=BLOCK_SIZE)
    results = run_three_ways(
        runner, prompts, max_new, model.config.eos_token_ids, blocks_per_seq, batch_size, 5
    )
    for how, got in results.items():
        assert got == expected, how


@pytest.mark.parametrize("shared_blocks", [6, 11])
def test_cached_prefix_logits_equal_cold_run(tiny: tuple[PreTrainedModel, Path], shared_blocks: int) -> None:
    _, folder = tiny
    model = load_weights(folder)
    runner = ModelRunner(model, num_blocks=32, block_size=BLOCK_SIZE)
    prompt = tiny_prompts(model.config.vocab_size, seed=2)[-1]
    assert shared_blocks * BLOCK_SIZE < len(prompt)
    cold = runner.compute_logits([ScheduledChunk(0, prompt, 0, list(range(16)), True, GREEDY)])
    # The same prompt again, its first full blocks taken from the cold run's table.
    table = list(range(shared_blocks)) + list(range(16 + shared_blocks, 32))
    start = shared_blocks * BLOCK_SIZE
    warm = runner.compute_logits([ScheduledChunk(1, prompt[start:], start, table, True, GREEDY)])
    torch.testing.assert_close(warm, cold, atol=1e-4, rtol=0)


# --- SmolLM2-135M-Instruct, the default model --------------------------------------------------------

SMOL_MESSAGES = [
    "Hi!",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence why the sky is blue.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12? Answer with the number only and then explain how you computed it step by step.",
    "Give me a short tip for writing clean Python code, and an example of a function that follows it.",
]
SMOL_NEW_TOKENS = 16


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    """Converted from the GGUF once per cache root (the first time takes about half a minute)."""
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    return load_model(None)


@pytest.fixture(scope="module")
def smol_reference(smollm2: LoadedModel) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts as transformers templates them, and HF's greedy continuations of them."""
    tok = AutoTokenizer.from_pretrained(str(smollm2.path), local_files_only=True)
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=True
            )["input_ids"]
        )
        for m in SMOL_MESSAGES
    ]
    hf = AutoModelForCausalLM.from_pretrained(
        str(smollm2.path), dtype=torch.float32, local_files_only=True
    ).eval()
    return prompts, hf_greedy(hf, prompts, SMOL_NEW_TOKENS)


def test_smollm2_default_model_shape(smollm2: LoadedModel) -> None:
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert smollm2.config.max_context_len == 8192
    assert [smollm2.tokenizer.backend.id_to_token(i) for i in smollm2.config.eos_token_ids] == ["<|im_end|>"]
    assert "<|im_start|>" in (smollm2.tokenizer.chat_template or "")


def test_smollm2_prompts_are_hfs(
    smollm2: LoadedModel, smol_reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """The engine's own tokenizer (protocol.tokenizer) templates the prompts to the reference's ids."""
    prompts, _ = smol_reference
    ours = [chat_prompt_ids(smollm2.tokenizer, [{"role": "user", "content": m}]) for m in SMOL_MESSAGES]
    assert ours == prompts
    # Tied embeddings: one tensor, not a stale copy that loading left behind.
    assert smollm2.model.lm_head.weight is smollm2.model.model.embed_tokens.weight
    assert smollm2.model.model.embed_tokens.weight.dtype == torch.float32


def test_smollm2_matches_hf_greedy(
    smollm2: LoadedModel, smol_reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompts, expected = smol_reference
    assert len({len(p) for p in prompts}) == len(prompts)
    eos = smollm2.config.eos_token_ids
    blocks_per_seq = -(-(max(len(p) for p in prompts) + SMOL_NEW_TOKENS) // BLOCK_SIZE)
    runner = ModelRunner(smollm2.model, num_blocks=2 * len(prompts) * blocks_per_seq, block_size=BLOCK_SIZE)
    assert drive(runner, fresh_seqs(prompts, blocks_per_seq), SMOL_NEW_TOKENS, eos, batch_size=1) == expected
    results = run_three_ways(runner, prompts, SMOL_NEW_TOKENS, eos, blocks_per_seq, 8, chunk=13)
    for how, got in results.items():
        assert got == expected, how


def test_smollm2_cached_prefix_logits_equal_cold_run(
    smollm2: LoadedModel, smol_reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    prompt = smol_reference[0][-1]
    runner = ModelRunner(smollm2.model, num_blocks=64, block_size=16)
    cold = runner.compute_logits([ScheduledChunk(0, prompt, 0, [0, 1, 2, 3], True, GREEDY)])
    # The chat template's system prompt is the prefix every conversation shares.
    shared = (len(prompt) - 1) // 16
    warm = runner.compute_logits(
        [
            ScheduledChunk(
                1,
                prompt[shared * 16 :],
                shared * 16,
                [0, 1, 2, 3][:shared] + [8, 9, 10, 11][shared:],
                True,
                GREEDY,
            )
        ]
    )
    assert shared >= 2
    torch.testing.assert_close(warm, cold, atol=1e-4, rtol=0)


def test_smollm2_engine_matches_hf_with_preemption_chunking_and_prefix_hits(
    smollm2: LoadedModel, smol_reference: tuple[list[list[int]], list[list[int]]]
) -> None:
    """The whole engine at once: 13-token prefill chunks, a pool half the batch needs (preemption),
    and the chat template's shared system prompt served from the prefix cache."""
    from unittest import mock

    from workers.engine.engine_core import Engine, EngineConfig

    prompts, expected = smol_reference
    need = [-(-(len(p) + SMOL_NEW_TOKENS) // 16) for p in prompts]
    config = EngineConfig(
        block_size=16,
        num_blocks=max(max(need), sum(need) // 2),
        max_prefill_chunk=13,
        max_num_batched_tokens=64,
    )
    engine = Engine(smollm2, config)
    sampling = SamplingParams(temperature=0.0, max_tokens=SMOL_NEW_TOKENS)
    with mock.patch.object(engine.scheduler, "_preempt", wraps=engine.scheduler._preempt) as preempt:
        ids = [engine.add_request(p, sampling) for p in prompts]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        cached: dict[int, int] = {}
        while engine.has_work():
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
                cached[out.request_id] = out.cached_tokens
    assert [tokens[i] for i in ids] == expected
    assert preempt.call_count > 0
    assert sum(1 for i in ids if cached[i] > 0) >= 2
    assert engine.block_manager.num_used_blocks == 0
