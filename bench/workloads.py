"""Generated workloads of the shapes docs/design.md §7 names, as sessions both load drivers replay.

A workload is a list of sessions. A session's first turn is due at its start; each later turn is
sent its think time after the previous turn's answer has ended: closed loop within a session (an
agent waits for its answer before it acts), open across sessions (new users arrive whether or not
the fleet keeps up). A request that stands alone (a trace record, a grouped prompt) is a session of
one turn. `bench replay` drives sessions over HTTP in real time, `bench fleet` in virtual time.

Prompts are token ids, so no tokenizer runs anywhere. Every turn's whole prompt is fixed in
advance: the assistant's answer that a later turn's history repeats is the workload's own ids of
the answer's length, since a load generator never gets the served ids back (and simulated workers
make up their own). A served answer's KV blocks therefore never match the next turn's history;
the history before it does, which is the reuse that routing decides.

Each generator is a pure function of its parameters: one seed, one workload, and random streams
keyed by (seed, purpose, index) so that more tenants, sessions or groups leave the existing ones
as they were.

The named workloads (`--workload` of both benches) are split in two: TUNED, the shapes a policy is
designed and tuned against, and HELD_OUT, shapes it is only checked on (docs/design.md §7: tune for the
shape, not for one workload). `longmix` is in neither: it is disaggregation's workload, not routing's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

# Generated token ids stay clear of the low ids where tokenizers keep their special tokens (BOS, EOS,
# chat markers) and below every vocabulary the simulated profiles use.
TOKEN_LOW, TOKEN_HIGH = 1000, 30000

# Keys of the random streams: one purpose each, so that drawing more of one never shifts another.
_TENANT, _SESSION, _GROUP, _ORDER, _TIMES, _TENANT_PICK = range(6)


@dataclass(frozen=True, slots=True)
class Turn:
    """One request: its whole prompt, its answer's length, and the think time before it is sent."""

    prompt: Sequence[int]
    max_tokens: int
    # Seconds after the previous turn's answer ended; a session's first turn is due at its start.
    think_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Session:
    start_s: float
    turns: tuple[Turn, ...]
    # Sent as the OpenAI `user` field (session affinity's key); empty: the requests name no session.
    key: str = ""


def total_turns(sessions: Sequence[Session]) -> int:
    return sum(len(s.turns) for s in sessions)


def nominal_order(sessions: Sequence[Session]) -> list[Turn]:
    """Every turn in the order it would arrive if every answer were instant: the arrival order of a
    fleet with no latency, which bounds such as the pooled cache are computed over."""
    due = []
    for s in sessions:
        t = s.start_s
        for k, turn in enumerate(s.turns):
            t += turn.think_s
            due.append((t, s.start_s, k, turn))
    due.sort(key=lambda row: row[:3])
    return [row[3] for row in due]


def scaled(sessions: Sequence[Session], speed: float) -> list[Session]:
    """The same sessions `speed` times as fast (2 = twice): start and think times divided by it. The
    prompts are unchanged; what changes is the load, as a trace's speed changes it."""
    if speed <= 0:
        raise ValueError(f"speed must be positive, got {speed}")
    return [
        replace(
            s, start_s=s.start_s / speed, turns=tuple(replace(t, think_s=t.think_s / speed) for t in s.turns)
        )
        for s in sessions
    ]


def _ids(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(TOKEN_LOW, TOKEN_HIGH, n).tolist()


# -- multi-tenant agent sessions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentParams:
    """Agents of several tenants, each tenant with its own system prompt, working in tool loops.

    Sizes are tokens (~400 words is ~530 tokens). A turn's prompt is the session's history: the
    tenant's system prompt, then per earlier turn the user's message, the assistant's answer and,
    in about `tool_share` of the turns, a tool result. Sessions go to the tenants in turn, or with
    `tenant_zipf` S > 0 each to a tenant drawn with weight (rank)^-S: a few hot tenants and a long
    tail, as a shared service's tenants are."""

    tenants: int = 12
    tenant_zipf: float = 0.0
    system_tokens: int = 530
    sessions: int = 53
    min_turns: int = 4
    max_turns: int = 8
    tool_tokens: int = 530
    tool_share: float = 0.5
    min_user_tokens: int = 16
    max_user_tokens: int = 64
    min_output_tokens: int = 32
    max_output_tokens: int = 160
    # Think time between an answer and the next turn: think_base_s + Exp(mean think_mean_s).
    think_base_s: float = 1.5
    think_mean_s: float = 2.0
    # Sessions start uniformly at random within this many seconds: about 20 sessions at once, whose
    # histories (~2k tokens each) overflow a small fleet's caches.
    start_window_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.tenants, self.sessions, self.min_turns, self.min_output_tokens, self.min_user_tokens) < 1:
            raise ValueError("tenants, sessions, turns, output and user tokens must be at least 1")
        if self.max_turns < self.min_turns or self.max_user_tokens < self.min_user_tokens:
            raise ValueError("each max_* must be at least its min_*")
        if self.max_output_tokens < self.min_output_tokens:
            raise ValueError("max_output_tokens must be at least min_output_tokens")
        if min(self.system_tokens, self.tool_tokens, self.think_base_s, self.think_mean_s) < 0:
            raise ValueError("token counts and think times must not be negative")
        if self.tenant_zipf < 0:
            raise ValueError(f"tenant_zipf must not be negative, got {self.tenant_zipf}")
        if not 0.0 <= self.tool_share <= 1.0 or self.start_window_s < 0:
            raise ValueError("tool_share must be within [0, 1] and start_window_s not negative")


def tenant_weights(tenants: int, zipf: float) -> np.ndarray:
    """Each tenant's share of the sessions: (rank)^-zipf, normalised (zipf 0: all equal)."""
    weights = np.arange(1, tenants + 1, dtype=float) ** -zipf
    return weights / weights.sum()


def agent_sessions(params: AgentParams | None = None) -> list[Session]:
    """`params.sessions` agent sessions by start time, assigned to the tenants in turn or, with
    `tenant_zipf`, drawn by Zipf weight (from a stream of their own, so that the sessions' contents
    are those of the same sessions assigned in turn)."""
    p = params or AgentParams()
    systems = [_ids(np.random.default_rng([p.seed, _TENANT, t]), p.system_tokens) for t in range(p.tenants)]
    weights = tenant_weights(p.tenants, p.tenant_zipf)
    sessions = []
    for i in range(p.sessions):
        if p.tenant_zipf:
            tenant = int(np.random.default_rng([p.seed, _TENANT_PICK, i]).choice(p.tenants, p=weights))
        else:
            tenant = i % p.tenants
        rng = np.random.default_rng([p.seed, _SESSION, i])
        start = float(rng.uniform(0.0, p.start_window_s))
        history = systems[tenant] + _ids(rng, int(rng.integers(p.min_user_tokens, p.max_user_tokens + 1)))
        turns = []
        for k in range(int(rng.integers(p.min_turns, p.max_turns + 1))):
            think = p.think_base_s + float(rng.exponential(p.think_mean_s)) if k else 0.0
            output = int(rng.integers(p.min_output_tokens, p.max_output_tokens + 1))
            turns.append(Turn(tuple(history), output, think))
            history += _ids(rng, output)
            if rng.random() < p.tool_share:
                history += _ids(rng, p.tool_tokens)
            history += _ids(rng, int(rng.integers(p.min_user_tokens, p.max_user_tokens + 1)))
        sessions.append(Session(start, tuple(turns), key=f"tenant{tenant}-session{i}"))
    return sorted(sessions, key=lambda s: s.start_s)


# The agent workloads by name. Each keeps the default agent's arrival rate of sessions (53 in 20 s).
AGENT_WORKLOADS: Mapping[str, AgentParams] = {
    "agent": AgentParams(),
    # 24 tenants by Zipf weight 1.1: the hottest has 30% of the sessions, the next three 30% between
    # them, the coldest twelve 1-2% each: a few system prompts are worth a replica's cache, most not.
    "agent-zipf": AgentParams(tenants=24, tenant_zipf=1.1, sessions=106, start_window_s=40.0),
    # Tool results of 3000 tokens (a file read, a search page, a test log) in half the turns: each
    # such turn adds more to the history than the system prompt and the messages together.
    "agent-tools": AgentParams(tool_tokens=3000),
    # Thinking 15 s + Exp(30 s) between turns, where the default agent thinks 3.5 s on average: the
    # caches of a pressured fleet turn over in seconds, so between two turns of a session the
    # replica that served it has had the time to evict its history for the other sessions' traffic.
    "agent-think": AgentParams(think_base_s=15.0, think_mean_s=30.0, sessions=159, start_window_s=60.0),
}

TUNED: tuple[str, ...] = ("agent", "grouped", "agent-zipf")
"""The named workloads a routing policy may be designed, tuned and compared on."""

HELD_OUT: tuple[str, ...] = ("agent-tools", "agent-think")
"""Held out: workloads of the same family that no policy or default may be tuned on. They are only
run to check that what was tuned on TUNED generalises; a change made because of their numbers makes
them tuned, and then nothing checks generalisation any more."""


# -- grouped shared prefixes ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupedParams:
    """Groups of prompts sharing a long prefix (shared:own 5:1), each prompt sent once, the groups'
    prompts shuffled together so that a group's requests are interleaved with the others'."""

    groups: int = 60
    prompts_per_group: int = 5
    shared_tokens: int = 1000
    own_tokens: int = 200
    output_tokens: int = 64
    # Poisson arrivals per second.
    rate: float = 10.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.groups, self.prompts_per_group, self.output_tokens) < 1:
            raise ValueError("groups, prompts_per_group and output_tokens must be at least 1")
        if min(self.shared_tokens, self.own_tokens) < 0 or self.shared_tokens + self.own_tokens < 1:
            raise ValueError("shared_tokens and own_tokens must not be negative, nor both zero")
        if self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")


def grouped_sessions(params: GroupedParams | None = None) -> list[Session]:
    """Every prompt of every group once, in a shuffled order, at Poisson times."""
    p = params or GroupedParams()
    prompts = []
    for g in range(p.groups):
        rng = np.random.default_rng([p.seed, _GROUP, g])
        shared = _ids(rng, p.shared_tokens)
        prompts += [tuple(shared + _ids(rng, p.own_tokens)) for _ in range(p.prompts_per_group)]
    order = np.random.default_rng([p.seed, _ORDER]).permutation(len(prompts))
    times = np.cumsum(np.random.default_rng([p.seed, _TIMES]).exponential(1.0 / p.rate, len(prompts)))
    return [
        Session(float(t), (Turn(prompts[i], p.output_tokens),)) for t, i in zip(times, order, strict=True)
    ]


# -- long prompts, long answers -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LongMixParams:
    """Long prompts with long answers (document Q&A, long-context summaries, code review): the traffic
    where one replica's prefills stall its own decodes, which prefill/decode disaggregation is for.

    Prompt lengths are uniform in [min_prompt_tokens, max_prompt_tokens]; a `shared_share` of them
    start with one of `documents` shared documents of `document_tokens` (several questions about one
    document), the rest of every prompt is its own. Answers are uniform in [min_output_tokens,
    max_output_tokens]. Arrivals are Poisson at `rate` per second."""

    requests: int = 400
    min_prompt_tokens: int = 4096
    max_prompt_tokens: int = 16384
    documents: int = 8
    document_tokens: int = 3072
    shared_share: float = 0.5
    min_output_tokens: int = 300
    max_output_tokens: int = 1000
    # Poisson arrivals per second. 4/s loads 4 h100-8b replicas meaningfully: about 40k prompt tokens/s
    # (two GPUs of prefill at ~85%) and ~35 long decodes per GPU of KV if two GPUs hold them all;
    # all mixed, four hold ~25% more before either stalls.
    rate: float = 4.0
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.requests, self.min_prompt_tokens, self.min_output_tokens, self.documents) < 1:
            raise ValueError("requests, documents, prompt and output tokens must be at least 1")
        if self.max_prompt_tokens < self.min_prompt_tokens or self.max_output_tokens < self.min_output_tokens:
            raise ValueError("each max_* must be at least its min_*")
        if not 0 <= self.document_tokens < self.min_prompt_tokens:
            raise ValueError("a shared document must leave every prompt a part of its own")
        if not 0.0 <= self.shared_share <= 1.0 or self.rate <= 0:
            raise ValueError("shared_share must be within [0, 1] and rate positive")


def longmix_sessions(params: LongMixParams | None = None) -> list[Session]:
    """`params.requests` single-turn sessions at Poisson times, in arrival order."""
    p = params or LongMixParams()
    docs = [_ids(np.random.default_rng([p.seed, _GROUP, d]), p.document_tokens) for d in range(p.documents)]
    times = np.cumsum(np.random.default_rng([p.seed, _TIMES]).exponential(1.0 / p.rate, p.requests))
    sessions = []
    for i, t in enumerate(times):
        rng = np.random.default_rng([p.seed, _SESSION, i])
        length = int(rng.integers(p.min_prompt_tokens, p.max_prompt_tokens + 1))
        head = docs[int(rng.integers(p.documents))] if rng.random() < p.shared_share else []
        prompt = head + _ids(rng, length - len(head))
        output = int(rng.integers(p.min_output_tokens, p.max_output_tokens + 1))
        sessions.append(Session(float(t), (Turn(tuple(prompt), output),)))
    return sessions
