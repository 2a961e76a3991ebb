"""A fleet comparison's row as processes: simulated workers counting in their own unit (words, blocks
of 64) behind a gateway that reads tokens, each reporting its cache in its own unit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.loadgen import replay_sessions
from bench.replay_result import moved_turns
from bench.replay_rows import APPROX, BLOCKS64, fleet_workers
from bench.row_fleets import row_fleet
from bench.token_text import text_of
from bench.workloads import AgentParams, agent_sessions
from protocol.models import default_tokenizer

pytestmark = pytest.mark.fleet


# Two short agent sessions of a few turns on a tenant's system prompt, and a gateway that learns.
SHORT_AGENT = AgentParams(
    tenants=1,
    system_tokens=256,
    sessions=2,
    min_turns=3,
    max_turns=3,
    tool_tokens=96,
    min_output_tokens=4,
    max_output_tokens=8,
    think_base_s=0.1,
    think_mean_s=0.01,
    start_window_s=0.1,
)


def test_workers_counting_words_report_their_own_counts_behind_a_gateway_reading_tokens(
    tmp_path: Path,
) -> None:
    sessions = agent_sessions(SHORT_AGENT)
    workers = fleet_workers(2, "h100-8b", (16, 256), "words")
    with row_fleet(tmp_path, workers, "prefix_aware", APPROX, (16, 256), text=True) as url:
        result = asyncio.run(
            replay_sessions(url, sessions, model=workers.spec.model, text=True, progress=False)
        )
    assert result.summary()["errors"] == {} and result.completed == 6
    prompts = {(i, k): turn.prompt for i, s in enumerate(sessions) for k, turn in enumerate(s.turns)}
    tokenizer = default_tokenizer()
    for r in result.records:
        assert r.session is not None and r.replica in {"w0", "w1"}
        # One word per id: the workers count the ids' number, the gateway's tokenizer ~2.8 times it.
        words = len(prompts[r.session, r.turn])
        assert r.prompt_tokens == words
        assert len(tokenizer.encode(text_of(prompts[r.session, r.turn]))) > 2 * words
        # Cached in the workers' blocks of 16 words.
        assert r.cached_tokens % 16 == 0 and r.cached_tokens < words
    assert sum(r.cached_tokens > 0 for r in result.records) >= 3  # later turns, and the shared system prompt
    assert moved_turns(result.records) is not None


def test_blocks64_workers_cache_in_their_own_blocks(tmp_path: Path) -> None:
    workers = fleet_workers(2, "h100-8b", (16, 256), "blocks64")
    with row_fleet(tmp_path, workers, "cache_threshold", APPROX, (16, 256)) as url:
        result = asyncio.run(replay_sessions(url, agent_sessions(SHORT_AGENT), progress=False))
    assert result.completed == 6
    cached = [r.cached_tokens for r in result.records]
    assert all(c % BLOCKS64 == 0 for c in cached) and max(cached) >= BLOCKS64
