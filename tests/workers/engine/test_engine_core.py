"""The whole engine (scheduler, block manager, runner, detokenizer) against HF `generate`, and its
offline and async faces: prefix hits, chunked prefill, preemption, stop strings, aborts, no leaks."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from unittest import mock

import pytest

from tests.support.engines import GREEDY, MAX_NEW, prompts, run
from tests.support.hf_models import hf_greedy
from workers.engine.batch import ScheduledChunk, StepOutput
from workers.engine.engine_core import Engine, EngineConfig, PromptTooLong
from workers.engine.llm import LLM, AsyncLLM
from workers.engine.loader import LoadedModel
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import UnschedulableSequence

CASES = {
    "default": EngineConfig(block_size=4, num_blocks=512),
    "chunked": EngineConfig(block_size=4, num_blocks=512, max_prefill_chunk=7, max_num_batched_tokens=24),
    "preempting": EngineConfig(block_size=4, num_blocks=40, max_num_batched_tokens=64),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("batch_size", [1, 8])
def test_greedy_matches_hf_generate(tiny, case: str, batch_size: int) -> None:
    hf, loaded = tiny
    batch = prompts(len(loaded.tokenizer))
    expected = hf_greedy(hf, batch, MAX_NEW, ignore_eos=True)
    engine = Engine(loaded, CASES[case])
    with mock.patch.object(engine.scheduler, "_preempt", wraps=engine.scheduler._preempt) as preempt:
        got = []
        for start in range(0, len(batch), batch_size):
            got += list(run(engine, batch[start : start + batch_size]).values())
    assert got == expected
    if case == "preempting" and batch_size == 8:
        assert preempt.call_count > 0, "the small pool was meant to force preemption"
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hits_keep_outputs_and_report_cached_tokens(tiny) -> None:
    hf, loaded = tiny
    rng = random.Random(5)
    system = [rng.randrange(len(loaded.tokenizer)) for _ in range(40)]
    batch = [system + [rng.randrange(len(loaded.tokenizer)) for _ in range(n)] for n in (1, 5, 13, 30)]
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=256))
    cold = run(engine, batch[:1])
    ids = [engine.add_request(p, GREEDY) for p in batch]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    cached: dict[int, int] = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.cached_tokens
    assert [tokens[i] for i in ids] == hf_greedy(hf, batch, MAX_NEW, ignore_eos=True)
    assert tokens[ids[0]] == cold[0]
    # The 40-token system prompt is 10 full blocks; the repeat of prompt 0 holds all but its last token.
    assert cached[ids[0]] == 40
    assert all(cached[i] >= 40 for i in ids[1:])


def test_shared_prefix_blocks_are_shared_while_running(tiny) -> None:
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=64))
    shared = list(range(100, 132))
    run(engine, [[*shared, 1]])
    a = engine.add_request([*shared, 2, 3], GREEDY)
    b = engine.add_request([*shared, 4, 5], GREEDY)
    engine.step()
    seq_a, seq_b = engine._requests[a][0], engine._requests[b][0]
    common = seq_a.block_table[:8]
    assert common == seq_b.block_table[:8]
    assert all(engine.block_manager.ref_count(block) == 2 for block in common)
    while engine.has_work():
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def test_abort_mid_generation_frees_blocks(tiny) -> None:
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=64))
    request = engine.add_request(
        list(range(50)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0
    [out] = engine.abort(request)
    assert out.finished and out.finish_reason == "abort" and (out.request_id, out.index) == (request, 0)
    assert engine.block_manager.num_used_blocks == 0
    assert not engine.has_work()
    assert engine.abort(request) == []


def test_stop_string_truncates_and_finishes(tiny) -> None:
    _, loaded = tiny
    llm = LLM(loaded, EngineConfig(block_size=4, num_blocks=128))
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert len(free.text) > 4
    stop = free.text[2:4]
    stopped = llm.generate(
        [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=24, stop=(stop,), ignore_eos=True)
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free.text[: free.text.index(stop)]
    assert llm.engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_is_reproducible_across_batches(tiny) -> None:
    _, loaded = tiny
    llm = LLM(loaded, EngineConfig(block_size=4, num_blocks=256))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=10, ignore_eos=True)
    alone = llm.generate([[1, 2, 3]], seeded)[0].token_ids
    crowd = llm.generate([[9, 9], [1, 2, 3], [4]], [GREEDY, seeded, GREEDY])[1].token_ids
    assert alone == crowd
    other = llm.generate(
        [[1, 2, 3]], SamplingParams(temperature=1.0, seed=43, max_tokens=10, ignore_eos=True)
    )
    assert other[0].token_ids != alone


def test_requests_that_can_never_run_fail_clearly(tiny) -> None:
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=8))
    with pytest.raises(PromptTooLong, match="context window is 512 tokens"):
        engine.add_request([1] * 600, GREEDY)
    with pytest.raises(UnschedulableSequence, match="KV blocks"):
        engine.add_request([1] * 100, GREEDY)
    with pytest.raises(UnschedulableSequence, match="empty"):
        engine.add_request([], GREEDY)
    assert not engine.has_work()


def test_async_streams_match_offline_and_cancel_aborts(tiny) -> None:
    _, loaded = tiny
    batch = prompts(len(loaded.tokenizer), lengths=(5, 20, 33))
    offline = LLM(loaded, EngineConfig(block_size=4, num_blocks=256)).generate(batch, GREEDY)
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=256))
    front = AsyncLLM(engine)

    async def collect(p: list[int]) -> tuple[str, list[int]]:
        text, ids = "", []
        async for out in front.generate(p, GREEDY):
            text += out.new_text
            ids += out.new_token_ids
        return text, ids

    async def leave_early() -> int:
        got = 0
        stream = front.generate(
            list(range(60)), SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        )
        async for _ in stream:
            got += 1
            if got == 3:
                break
        await stream.aclose()
        return got

    async def main() -> list:
        results = await asyncio.gather(*(collect(p) for p in batch), leave_early())
        for _ in range(100):
            stats = await front.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
            await asyncio.sleep(0.01)
        return [*results, stats]

    try:
        *streams, left_after, stats = asyncio.run(main())
    finally:
        front.shutdown()
    assert [(c.text, c.token_ids) for c in offline] == streams
    assert left_after == 3
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


# -- n > 1: choices forked off one prefill ---------------------------------------------------------

SEEDED = SamplingParams(temperature=1.0, seed=42, max_tokens=10, ignore_eos=True)


def run_choices(engine: Engine, prompt: list[int], sampling: SamplingParams, n: int) -> list[list[int]]:
    """The tokens of each of a request's n choices, checking that each finishes exactly once."""
    request = engine.add_request(prompt, sampling, n=n)
    tokens: list[list[int]] = [[] for _ in range(n)]
    finished = [0] * n
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == request and out.prompt_tokens == len(prompt)
            assert out.completion_tokens == len(tokens[out.index]) + len(out.new_token_ids)
            tokens[out.index] += out.new_token_ids
            finished[out.index] += out.finished
    assert finished == [1] * n
    assert engine.block_manager.num_used_blocks == 0
    return tokens


def fresh(loaded: LoadedModel) -> Engine:
    return Engine(loaded, EngineConfig(block_size=4, num_blocks=256))


def test_greedy_choices_are_all_the_single_choice_output(tiny) -> None:
    _, loaded = tiny
    prompt = prompts(len(loaded.tokenizer), lengths=(18,))[0]
    [single] = run_choices(fresh(loaded), prompt, GREEDY, n=1)
    assert run_choices(fresh(loaded), prompt, GREEDY, n=3) == [single] * 3


def test_seeded_choices_differ_and_repeat_with_choice_0_as_the_single_choice(tiny) -> None:
    _, loaded = tiny
    prompt = prompts(len(loaded.tokenizer), lengths=(18,))[0]
    [single] = run_choices(fresh(loaded), prompt, SEEDED, n=1)
    choices = run_choices(fresh(loaded), prompt, SEEDED, n=3)
    assert choices[0] == single
    assert len({tuple(c) for c in choices}) == 3
    # Beside other work, on an engine whose generator has moved on: the same choices.
    engine = fresh(loaded)
    run(engine, prompts(len(loaded.tokenizer), lengths=(5, 9)), SamplingParams(max_tokens=4))
    assert run_choices(engine, prompt, SEEDED, n=3) == choices
    unseeded = run_choices(fresh(loaded), prompt, SamplingParams(max_tokens=10, ignore_eos=True), n=3)
    assert len({tuple(c) for c in unseeded}) == 3


@pytest.mark.parametrize("prompt_len", [28, 30])
def test_the_prompt_is_prefilled_once_for_all_choices(tiny, prompt_len: int) -> None:
    _, loaded = tiny
    engine = fresh(loaded)
    execute = engine.runner.execute
    prompt_positions = 0

    def counting(chunks: Sequence[ScheduledChunk]) -> list[StepOutput]:
        nonlocal prompt_positions
        for c in chunks:
            prompt_positions += max(0, min(prompt_len, c.start_pos + len(c.token_ids)) - c.start_pos)
        return execute(chunks)

    engine.runner.execute = counting  # type: ignore[method-assign]
    n = 4
    run_choices(engine, prompts(len(loaded.tokenizer), lengths=(prompt_len,))[0], GREEDY, n=n)
    # Once, plus each fork's recomputed tail of the prompt's partial last block (none when it is full).
    assert prompt_positions == prompt_len + (n - 1) * (prompt_len % 4)


def test_abort_ends_every_choice_before_and_after_the_fork(tiny) -> None:
    _, loaded = tiny
    engine = Engine(loaded, EngineConfig(block_size=4, num_blocks=64, max_prefill_chunk=8))
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = engine.add_request(list(range(30)), long, n=3)
    engine.step()
    assert engine.block_manager.num_used_blocks == 2
    outs = engine.abort(before)
    assert [(o.request_id, o.index, o.finish_reason, o.new_token_ids) for o in outs] == [
        (before, i, "abort", []) for i in range(3)
    ]
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_work()
    after = engine.add_request(list(range(30)), long, n=3)
    while not engine.step():  # until the step that samples the first tokens and forks
        pass
    assert len(engine.scheduler.running) == 3
    assert {o.index for o in engine.abort(after)} == {0, 1, 2}
    assert engine.block_manager.num_used_blocks == 0 and not engine.has_work()
    assert engine.abort(after) == []


def test_async_streams_every_choice_and_leaving_early_aborts_them_all(tiny) -> None:
    _, loaded = tiny
    prompt = prompts(len(loaded.tokenizer), lengths=(18,))[0]
    expected = run_choices(fresh(loaded), prompt, SEEDED, n=3)
    engine = fresh(loaded)
    front = AsyncLLM(engine)

    async def collect() -> list[list[int]]:
        tokens: list[list[int]] = [[], [], []]
        async for out in front.generate(prompt, SEEDED, n=3):
            tokens[out.index] += out.new_token_ids
        return tokens

    async def leave_early() -> None:
        stream = front.generate(list(range(60)), SamplingParams(max_tokens=200, ignore_eos=True), n=3)
        async for out in stream:
            if out.index == 2:
                break
        await stream.aclose()

    async def main() -> tuple[list[list[int]], object]:
        tokens, _ = await asyncio.gather(collect(), leave_early())
        for _ in range(100):
            stats = await front.stats()
            if stats.running == 0 and stats.waiting == 0:
                break
            await asyncio.sleep(0.01)
        return tokens, stats

    try:
        tokens, stats = asyncio.run(main())
    finally:
        front.shutdown()
    assert tokens == expected
    assert stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0
