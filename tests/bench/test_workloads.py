"""Generated workloads: pure functions of their parameters, with the shapes they promise (sessions whose
prompts grow by answer, tool result and message; tenants' shared system prompts; think times; grouped
prefixes interleaved at Poisson times)."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.shared_flags import WORKLOADS, generated_sessions
from bench.trace import TracePrompt, load_trace, prompt_tokens, trace_sessions, write_conversation_trace
from bench.workloads import (
    AGENT_WORKLOADS,
    HELD_OUT,
    TOKEN_HIGH,
    TOKEN_LOW,
    TUNED,
    AgentParams,
    GroupedParams,
    LongMixParams,
    Session,
    Turn,
    agent_sessions,
    grouped_sessions,
    longmix_sessions,
    nominal_order,
    scaled,
    tenant_weights,
    total_turns,
)
from prefixgate.cli import build_parser

AGENT = AgentParams()


def test_agent_sessions_are_a_function_of_the_seed_and_keep_their_shape_as_more_are_added() -> None:
    sessions = agent_sessions(AGENT)
    assert sessions == agent_sessions(AgentParams())
    assert sessions != agent_sessions(AgentParams(seed=1))
    assert len(sessions) == 53 and len({s.key for s in sessions}) == 53
    assert all(AGENT.min_turns <= len(s.turns) <= AGENT.max_turns for s in sessions)
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] >= 0 and starts[-1] < AGENT.start_window_s
    assert all(min(t.prompt) >= TOKEN_LOW and max(t.prompt) < TOKEN_HIGH for s in sessions for t in s.turns)
    more = {s.key: s for s in agent_sessions(replace(AGENT, sessions=60))}
    assert all(more[s.key] == s for s in sessions)


def test_sessions_of_a_tenant_share_its_system_prompt_and_tenants_differ() -> None:
    sessions = agent_sessions(AGENT)
    systems: dict[str, set[tuple[int, ...]]] = {}
    for s in sessions:
        tenant = s.key.split("-")[0]
        systems.setdefault(tenant, set()).add(tuple(s.turns[0].prompt[: AGENT.system_tokens]))
    assert len(systems) == AGENT.tenants
    assert all(len(prompts) == 1 for prompts in systems.values())
    assert len(set.union(*systems.values())) == AGENT.tenants
    # 53 sessions over 12 tenants: 4 or 5 each.
    per_tenant = [sum(s.key.startswith(f"{t}-") for s in sessions) for t in systems]
    assert set(per_tenant) == {4, 5}


def test_each_turn_extends_the_previous_prompt_by_its_answer_a_tool_result_or_not_and_a_message() -> None:
    params = replace(AGENT, sessions=400)
    with_tool = transitions = 0
    for s in agent_sessions(params):
        first = s.turns[0]
        assert params.min_user_tokens <= len(first.prompt) - params.system_tokens <= params.max_user_tokens
        for before, after in zip(s.turns, s.turns[1:], strict=False):
            assert tuple(after.prompt[: len(before.prompt)]) == tuple(before.prompt)
            assert params.min_output_tokens <= before.max_tokens <= params.max_output_tokens
            added = len(after.prompt) - len(before.prompt) - before.max_tokens
            tool = added > params.max_user_tokens
            user = added - params.tool_tokens if tool else added
            assert params.min_user_tokens <= user <= params.max_user_tokens
            with_tool += tool
            transitions += 1
    assert transitions > 1500
    assert 0.45 < with_tool / transitions < 0.55


def test_think_times_are_the_base_plus_an_exponential() -> None:
    sessions = agent_sessions(replace(AGENT, sessions=400))
    assert all(s.turns[0].think_s == 0.0 for s in sessions)
    extra = [t.think_s - AGENT.think_base_s for s in sessions for t in s.turns[1:]]
    assert min(extra) >= 0
    # Exponential with mean 2: the mean and the standard deviation are both about 2 (n > 1500).
    assert statistics.fmean(extra) == pytest.approx(AGENT.think_mean_s, rel=0.1)
    assert statistics.stdev(extra) == pytest.approx(AGENT.think_mean_s, rel=0.15)
    assert statistics.median(extra) == pytest.approx(AGENT.think_mean_s * 0.693, rel=0.15)


def test_grouped_prompts_share_their_group_prefix_and_arrive_interleaved_at_poisson_times() -> None:
    params = GroupedParams()
    sessions = grouped_sessions(params)
    assert sessions == grouped_sessions(GroupedParams())
    assert sessions != grouped_sessions(GroupedParams(seed=1))
    assert len(sessions) == 300 and all(len(s.turns) == 1 and not s.key for s in sessions)
    prompts = [tuple(s.turns[0].prompt) for s in sessions]
    assert len(set(prompts)) == 300 and {len(p) for p in prompts} == {1200}
    assert {s.turns[0].max_tokens for s in sessions} == {64}
    groups = [p[:1000] for p in prompts]
    assert len(set(groups)) == 60 and all(groups.count(g) == 5 for g in set(groups))
    # Shuffled: a group's five prompts are not sent back to back (about 4 of 299 neighbours match).
    assert sum(a == b for a, b in itertools.pairwise(groups)) < 15
    times = [s.start_s for s in sessions]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert min(gaps) > 0
    assert statistics.fmean(gaps) == pytest.approx(1 / params.rate, rel=0.15)


def test_invalid_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="max_"):
        AgentParams(min_turns=5, max_turns=4)
    with pytest.raises(ValueError, match="tool_share"):
        AgentParams(tool_share=1.5)
    with pytest.raises(ValueError, match="rate"):
        GroupedParams(rate=0)
    with pytest.raises(ValueError, match="tenant_zipf"):
        AgentParams(tenant_zipf=-1.0)


def test_nominal_order_and_speed() -> None:
    sessions = [
        Session(0.0, (Turn((1,), 1), Turn((1, 2), 1, think_s=5.0))),
        Session(1.0, (Turn((3,), 1), Turn((3, 4), 1, think_s=1.0))),
    ]
    assert [t.prompt for t in nominal_order(sessions)] == [(1,), (3,), (3, 4), (1, 2)]
    fast = scaled(sessions, 2.0)
    assert [s.start_s for s in fast] == [0.0, 0.5]
    assert [t.think_s for s in fast for t in s.turns] == [0.0, 2.5, 0.0, 0.5]
    assert [t.prompt for s in fast for t in s.turns] == [t.prompt for s in sessions for t in s.turns]
    assert total_turns(fast) == 4
    with pytest.raises(ValueError):
        scaled(sessions, 0)


def test_trace_sessions_expand_their_prompts_only_when_read(tmp_path: Path) -> None:
    trace = load_trace(write_conversation_trace(tmp_path / "t.jsonl", conversations=3, turns=2))
    sessions = trace_sessions(trace, 32000)
    assert [s.start_s for s in sessions] == [r.arrival_s for r in trace]
    for s, r in zip(sessions, trace, strict=True):
        (turn,) = s.turns
        assert isinstance(turn.prompt, TracePrompt) and len(turn.prompt) == r.input_length
        assert list(turn.prompt) == prompt_tokens(r, 32000)
        assert turn.prompt[:3] == prompt_tokens(r, 32000)[:3] and turn.max_tokens == r.output_length
        assert s.key == str(r.hash_ids[1])


def test_longmix_is_long_prompts_and_answers_at_poisson_times_some_sharing_a_document() -> None:
    params = LongMixParams(requests=300)
    sessions = longmix_sessions(params)
    assert sessions == longmix_sessions(LongMixParams(requests=300))
    assert sessions != longmix_sessions(replace(params, seed=1))
    assert len(sessions) == 300 and all(len(s.turns) == 1 for s in sessions)
    turns = [s.turns[0] for s in sessions]
    assert all(params.min_prompt_tokens <= len(t.prompt) <= params.max_prompt_tokens for t in turns)
    assert all(params.min_output_tokens <= t.max_tokens <= params.max_output_tokens for t in turns)
    assert all(min(t.prompt) >= TOKEN_LOW and max(t.prompt) < TOKEN_HIGH for t in turns)
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts)
    assert statistics.mean(b - a for a, b in itertools.pairwise(starts)) == pytest.approx(
        1 / params.rate, rel=0.2
    )
    heads = [tuple(t.prompt[: params.document_tokens]) for t in turns]
    shared = [h for h in heads if heads.count(h) > 1]
    assert len(set(shared)) == params.documents
    assert len(shared) / len(heads) == pytest.approx(params.shared_share, abs=0.1)
    # Past the document, every prompt is its own.
    tails = {tuple(t.prompt[params.document_tokens : params.document_tokens + 64]) for t in turns}
    assert len(tails) == len(turns)


def test_longmix_keeps_its_requests_as_more_are_asked_for() -> None:
    fewer = longmix_sessions(LongMixParams(requests=20))
    assert longmix_sessions(LongMixParams(requests=40))[:20] == fewer


def test_longmix_parameters_are_checked() -> None:
    for bad in (
        {"requests": 0},
        {"max_prompt_tokens": 100},
        {"document_tokens": 4096},
        {"shared_share": 1.5},
        {"rate": 0.0},
    ):
        with pytest.raises(ValueError):
            LongMixParams(**bad)


def _tenant(session: Session) -> int:
    return int(session.key.split("-")[0].removeprefix("tenant"))


@pytest.mark.fuzz
def test_zipf_tenants_follow_the_law_and_keep_the_sessions_contents() -> None:
    params = replace(AGENT_WORKLOADS["agent-zipf"], sessions=4000)
    sessions = agent_sessions(params)
    assert sessions == agent_sessions(params) and sessions != agent_sessions(replace(params, seed=1))
    counts = np.bincount([_tenant(s) for s in sessions], minlength=params.tenants)
    # The hottest tenant has about 30% (sd 0.7%), and counts fall with rank as rank^-1.1: the slope
    # of log count on log rank over the ten hottest (the tail's counts are too small to fit).
    assert counts[0] / len(sessions) == pytest.approx(tenant_weights(24, 1.1)[0], abs=0.025)
    slope = np.polyfit(np.log(np.arange(1, 11)), np.log(counts[:10]), 1)[0]
    assert slope == pytest.approx(-1.1, abs=0.15)
    assert counts[12:].sum() / len(sessions) == pytest.approx(0.152, abs=0.03)  # a long, thin tail
    # A tenant's sessions share its system prompt, whoever they are.
    for tenant in range(5):
        heads = {tuple(s.turns[0].prompt[: params.system_tokens]) for s in sessions if _tenant(s) == tenant}
        assert len(heads) == 1
    # The draw comes from a stream of its own: past the system prompt, each session is the one the
    # same parameters give without Zipf, and more sessions leave the first ones' tenants as they were.
    plain = {s.key.split("-")[1]: s for s in agent_sessions(replace(params, tenant_zipf=0.0, sessions=300))}
    for s in sessions[:300]:
        other = plain.get(s.key.split("-")[1])
        if other is not None:
            assert other.start_s == s.start_s and len(other.turns) == len(s.turns)
            assert (
                other.turns[-1].prompt[params.system_tokens :] == s.turns[-1].prompt[params.system_tokens :]
            )
    fewer = {s.key for s in agent_sessions(replace(params, sessions=500))}
    assert fewer <= {s.key for s in sessions}


def test_agent_tools_results_are_thousands_of_tokens() -> None:
    params = AGENT_WORKLOADS["agent-tools"]
    sessions = agent_sessions(params)
    growth = [
        len(after.prompt) - len(before.prompt) - before.max_tokens
        for s in sessions
        for before, after in itertools.pairwise(s.turns)
    ]
    tools = [g for g in growth if g > params.max_user_tokens]
    assert 0.4 < len(tools) / len(growth) < 0.6
    assert all(3000 + params.min_user_tokens <= g <= 3000 + params.max_user_tokens for g in tools)
    # The default agent's sessions but for the tool results, which make their histories several
    # times as long.
    default = agent_sessions(AGENT)
    assert [len(s.turns) for s in sessions] == [len(s.turns) for s in default]
    longest, default_longest = (max(len(t.prompt) for s in w for t in s.turns) for w in (sessions, default))
    assert longest > 10_000 and longest > 3 * default_longest


def test_agent_think_times_are_long_against_the_default_agents() -> None:
    params = AGENT_WORKLOADS["agent-think"]
    thinks = [t.think_s for s in agent_sessions(params) for t in s.turns[1:]]
    default = [t.think_s for s in agent_sessions(AGENT) for t in s.turns[1:]]
    assert min(thinks) >= 15.0 > 4 * statistics.fmean(default)
    assert statistics.fmean(thinks) == pytest.approx(45.0, rel=0.1)
    # Sessions arrive at the default agent's rate, so the load per second is comparable.
    assert params.sessions / params.start_window_s == pytest.approx(
        AGENT.sessions / AGENT.start_window_s, rel=0.01
    )


def test_named_workloads_are_split_into_tuned_and_held_out_and_run_from_both_benches() -> None:
    assert set(TUNED).isdisjoint(HELD_OUT)
    assert {"agent", "grouped"} <= set(TUNED) and len(set(TUNED) & set(AGENT_WORKLOADS)) == 2
    assert set(TUNED) | set(HELD_OUT) == set(WORKLOADS) - {"longmix"}
    for bench in ("fleet", "replay"):
        target = ["--replicas", "2"] if bench == "fleet" else ["--url", "http://127.0.0.1:1"]
        for name in AGENT_WORKLOADS:
            args = build_parser().parse_args(["bench", bench, "--workload", name, "--seed", "2", *target])
            sessions, params = generated_sessions(args)
            assert sessions == agent_sessions(replace(AGENT_WORKLOADS[name], seed=2))
            assert params["seed"] == 2 and params["tenants"] == AGENT_WORKLOADS[name].tenants
