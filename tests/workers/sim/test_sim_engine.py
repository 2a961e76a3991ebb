"""SimEngine: the real scheduler and block manager behind the engine's surface, on either clock."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from pathlib import Path

import pytest
import torch

from tests.support.sims import SMALL
from workers.engine.engine_core import Engine, EngineConfig, PromptTooLong, RequestOutput
from workers.engine.llm import AsyncLLM, Completion
from workers.engine.loader import LoadedModel
from workers.engine.model import LlamaForCausalLM, ModelConfig
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence
from workers.sim.cost_model import CostModel
from workers.sim.profiles import CPU_SMOLLM2, H100_8B, Profile
from workers.sim.runner import RealClock, VirtualClock
from workers.sim.sim_engine import SimEngine


def drain(engine: Engine | SimEngine) -> dict[int, list[RequestOutput]]:
    outputs: dict[int, list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def test_every_request_finishes_with_its_max_tokens_and_frees_the_pool() -> None:
    rng = random.Random(0)
    engine = SimEngine(SMALL, clock=VirtualClock())
    sequences: list[Sequence] = []
    add = engine.scheduler.add
    engine.scheduler.add = lambda seq: (sequences.append(seq), add(seq))[1]  # type: ignore[method-assign]
    shared = [rng.randrange(1000) for _ in range(40)]
    wanted = {}
    for i in range(30):
        prompt = (shared if i % 3 == 0 else []) + [rng.randrange(1000) for _ in range(rng.randrange(1, 200))]
        max_tokens = rng.randrange(1, 40)
        wanted[engine.add_request(prompt, SamplingParams(max_tokens=max_tokens))] = max_tokens
    outputs = drain(engine)
    assert outputs.keys() == wanted.keys()
    for request_id, deltas in outputs.items():
        tokens = [t for d in deltas for t in d.new_token_ids]
        assert len(tokens) == wanted[request_id] == deltas[-1].completion_tokens
        assert deltas[-1].finished and deltas[-1].finish_reason == "length"
        assert all(d.new_text for d in deltas)
        assert CPU_SMOLLM2.eos_token_ids[0] not in tokens
    assert engine.block_manager.num_used_blocks == 0
    # The small pool and budget made the scheduler share prefixes and preempt, as a real one would.
    assert sum(seq.num_preemptions for seq in sequences) > 0
    assert sum(seq.num_cached_tokens for seq in sequences) > 0
    assert engine.clock.now() > 0


def test_virtual_time_runs_a_large_workload_in_little_wall_time() -> None:
    engine = SimEngine(H100_8B, clock=VirtualClock())
    n, prompt_len, max_tokens = 200, 8192 - 64, 64
    start = time.perf_counter()
    for i in range(n):
        engine.add_request(
            [(i + 31 * j) % H100_8B.vocab_size for j in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens),
        )
    outputs = drain(engine)
    wall = time.perf_counter() - start
    assert len(outputs) == n
    assert all(d[-1].completion_tokens == max_tokens for d in outputs.values())
    assert engine.block_manager.num_used_blocks == 0
    # 1.6M prompt tokens at the profile's ~30k tokens/s of prefill, plus decodes: about a minute.
    assert 40 < engine.clock.now() < 120
    # Simulated time runs far ahead of the wall clock (about 80x on a 2-core VM: the bound leaves room).
    assert engine.clock.now() > 4 * wall


def test_a_repeated_prompt_reports_its_cached_blocks() -> None:
    engine = SimEngine(SMALL, clock=VirtualClock())
    prompt = list(range(100, 150))
    first = engine.add_request(prompt, SamplingParams(max_tokens=2))
    cold = drain(engine)[first][-1]
    second = engine.add_request([*prompt, 7, 8], SamplingParams(max_tokens=2))
    warm = drain(engine)[second][-1]
    assert cold.cached_tokens == 0
    assert warm.cached_tokens == 48  # three full blocks of 16; the partial fourth is recomputed


def test_n_choices_run_as_sequences_of_their_own_off_one_prefill() -> None:
    engine = SimEngine(SMALL, clock=VirtualClock())
    request = engine.add_request(list(range(100, 150)), SamplingParams(max_tokens=6), n=3)
    deltas = drain(engine)[request]
    tokens: dict[int, list[int]] = {}
    for d in deltas:
        tokens.setdefault(d.index, []).extend(d.new_token_ids)
    assert sorted(tokens) == [0, 1, 2] and all(len(t) == 6 for t in tokens.values())
    assert len({tuple(t) for t in tokens.values()}) == 3
    assert [d.index for d in deltas if d.finished] == [0, 1, 2]
    assert engine.block_manager.num_used_blocks == 0


def tiny_loaded(name: str) -> LoadedModel:
    """A random one-layer Llama: the real runner at negligible cost, for the scheduler-level comparison."""
    config = ModelConfig.from_hf(
        {
            "model_type": "llama",
            "vocab_size": 1000,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 1024,
            "eos_token_id": 2,
        }
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()

    class NoText:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            return ""

    return LoadedModel(model, NoText(), name, config, Path("."))  # type: ignore[arg-type]


def test_prefix_reuse_and_kv_events_match_the_real_engine() -> None:
    """The same arrivals through Engine (a real model) and SimEngine give the same cache hits, the same
    KV events and the same cached blocks: the sim shares prefixes exactly as a real replica does.
    max_tokens=1 keeps generated tokens, which differ, out of the KV cache."""
    loaded = tiny_loaded("tiny-sim")
    profile = dataclasses.replace(
        SMALL, model_name=loaded.name, vocab_size=1000, eos_token_ids=(2,), kv_capacity_tokens=24 * 16
    )
    events: dict[str, list[tuple[object, ...]]] = {"real": [], "sim": []}

    def recorder(log: list[tuple[object, ...]]) -> dict[str, object]:
        return {
            "on_stored": lambda hashes, parent: log.append(("stored", tuple(hashes), parent)),
            "on_removed": lambda hashes: log.append(("removed", tuple(hashes))),
        }

    config = EngineConfig(
        block_size=profile.block_size,
        num_blocks=profile.num_blocks,
        max_num_batched_tokens=profile.max_num_batched_tokens,
        max_num_seqs=profile.max_num_seqs,
        backend="torch_sdpa",
    )
    real = Engine(loaded, config, **recorder(events["real"]))  # type: ignore[arg-type]
    sim = SimEngine(profile, clock=VirtualClock(), **recorder(events["sim"]))  # type: ignore[arg-type]

    rng = random.Random(3)
    systems = [[rng.randrange(3, 1000) for _ in range(n)] for n in (35, 70, 120)]
    cached: dict[str, list[int]] = {"real": [], "sim": []}
    for _ in range(6):
        prompts = [
            rng.choice(systems) + [rng.randrange(3, 1000) for _ in range(rng.randrange(1, 60))]
            for _ in range(4)
        ]
        for key, engine in (("real", real), ("sim", sim)):
            ids = [engine.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
            outputs = drain(engine)
            cached[key] += [outputs[i][-1].cached_tokens for i in ids]
    assert cached["sim"] == cached["real"]
    assert sum(cached["sim"]) > 0
    assert events["sim"] == events["real"]
    assert any(e[0] == "removed" for e in events["sim"])  # the pool is small enough to evict
    assert sim.block_manager.cached_hashes() == real.block_manager.cached_hashes()


def test_async_llm_drives_it_unchanged() -> None:
    engine = SimEngine(SMALL, clock=VirtualClock())
    llm = AsyncLLM(engine)  # type: ignore[arg-type]

    async def generate(prompt: list[int], max_tokens: int) -> Completion:
        done = Completion()
        async for out in llm.generate(prompt, SamplingParams(max_tokens=max_tokens)):
            done.add(out)
        return done

    async def main() -> list[Completion]:
        return await asyncio.gather(*(generate(list(range(10 * i, 10 * i + 30)), 5 + i) for i in range(6)))

    try:
        completions = asyncio.run(main())
        stats = asyncio.run(llm.stats())
    finally:
        llm.shutdown()
    assert [len(c.token_ids) for c in completions] == [5 + i for i in range(6)]
    assert all(c.finish_reason == "length" and c.text for c in completions)
    assert stats.running == stats.waiting == stats.kv_blocks_used == 0


def test_real_time_takes_the_modelled_time() -> None:
    step = CostModel(step_s=0.02, sample_s=0.0, token_s=0.0, weights_s=0.0, attn_pair_s=0.0, kv_token_s=0.0)
    engine = SimEngine(dataclasses.replace(SMALL, cost=step), clock=RealClock())
    start = time.monotonic()
    engine.add_request(list(range(40)), SamplingParams(max_tokens=4))
    drain(engine)
    assert 0.08 <= time.monotonic() - start < 1.0


def test_limits_and_abort() -> None:
    engine = SimEngine(SMALL, clock=VirtualClock())
    with pytest.raises(PromptTooLong):
        engine.add_request([5] * 1000, SamplingParams(max_tokens=100))
    request_id = engine.add_request(list(range(200)), SamplingParams(max_tokens=50))
    engine.step()
    assert engine.block_manager.num_used_blocks > 0
    [aborted] = engine.abort(request_id)
    assert aborted.finish_reason == "abort" and aborted.new_token_ids == []
    assert engine.block_manager.num_used_blocks == 0
    assert engine.abort(request_id) == []
    assert not engine.has_work()
    assert (
        engine.tokenizer is None and engine.max_context_len == 1024 and engine.model_name == SMALL.model_name
    )


def test_profile_overrides_flow_into_the_pool() -> None:
    profile: Profile = dataclasses.replace(H100_8B, block_size=512)
    engine = SimEngine(profile, clock=VirtualClock())
    assert engine.block_manager.block_size == 512
    assert engine.block_manager.num_blocks == H100_8B.kv_capacity_tokens // 512
