"""The streaming chaos scenario: a grouped replay of streams over four workers, one killed and
restarted mid-replay, once with bundled workers and once with the same workers declared foreign; every
stream judged whole or not (bench.chaos runs it with the other scenarios)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from bench.chaos_fleet import MODEL, POLL_S, START_TIMEOUT_S, WORKER, fast_gateway_config, sim_profile
from bench.chaos_scenarios import ScenarioResult
from bench.chaos_traffic import completion, family_prompt
from bench.local_fleet import Fleet, start_gateway, start_worker, wait_healthy
from protocol.loopback_ports import free_port


@dataclass(frozen=True, slots=True)
class Streamed:
    """One streaming request of a replay: its status, and whether the client got a whole answer."""

    start: float
    status: int
    # Ended with [DONE], one finish_reason, no error event, as many words as asked for, one id.
    whole: bool
    error: str | None = None
    # From sending the request to the stream's end.
    seconds: float = 0.0


async def stream_replay(url: str, bodies: Sequence[dict[str, Any]], spacing_s: float) -> list[Streamed]:
    """Each body sent as a streaming completion `spacing_s` after the one before (all of them in flight
    together as they overlap), its stream read to the end and judged: a simulated worker writes a word
    per token, so a whole answer has `max_tokens` words."""

    async def one(session: aiohttp.ClientSession, body: dict[str, Any], delay_s: float) -> Streamed:
        await asyncio.sleep(delay_s)
        start = time.monotonic()
        try:
            async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
                payload = await response.read()
        except (aiohttp.ClientError, TimeoutError) as error:
            return Streamed(start, 0, False, repr(error), time.monotonic() - start)
        seconds = time.monotonic() - start
        if response.status != 200:
            return Streamed(start, response.status, False, payload[:80].decode(errors="replace"), seconds)
        events = [line[6:] for line in payload.decode().splitlines() if line.startswith("data: ")]
        chunks = [json.loads(e) for e in events[:-1]]
        words = sum(len(c["text"].split()) for chunk in chunks for c in chunk.get("choices", []))
        finishes = [
            c["finish_reason"] for chunk in chunks for c in chunk.get("choices", []) if c["finish_reason"]
        ]
        whole = (
            events[-1:] == ["[DONE]"]
            and not any("error" in chunk for chunk in chunks)
            and len(finishes) == 1
            and words == body["max_tokens"]
            and len({chunk.get("id") for chunk in chunks}) == 1
        )
        error = None if whole else f"truncated: {words} words, {events[-2:]}"
        return Streamed(start, 200, whole, error, seconds)

    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=120)
    ) as session:
        return list(await asyncio.gather(*(one(session, b, i * spacing_s) for i, b in enumerate(bodies))))


def streams_replica_killed(
    workdir: Path, requests: int = 300, kill_at_s: float = 15.0, restart_at_s: float = 30.0
) -> ScenarioResult:
    """A streaming grouped replay over four slow workers, one SIGKILLed at `kill_at_s` and restarted
    at `restart_at_s`: every stream is whole, its answer continued on another worker where its own
    died mid-answer (gateway.forward.migration). Once with bundled workers (continued from token
    ids), once with
    the same workers declared foreign (`kind: openai`, text prompts, `foreign_continuation: completions`:
    continued from the text so far)."""
    result = ScenarioResult("streams_replica_killed")
    for variant in ("bundled", "foreign"):
        outcomes, migrated = _streams_with_a_kill(
            workdir / variant, variant, requests, kill_at_s, restart_at_s
        )
        truncated = [o for o in outcomes if o.status == 200 and not o.whole]
        failed = [o for o in outcomes if o.status != 200]
        result.requests += len(outcomes)
        result.succeeded += len(outcomes) - len(truncated) - len(failed)
        result.failed += len(truncated) + len(failed)
        result.max_latency_s = max([result.max_latency_s, *(o.seconds for o in outcomes)])
        result.checks[f"{variant}: no stream truncated"] = not truncated
        result.checks[f"{variant}: no request failed"] = not failed
        result.details[variant] = {
            "truncated": len(truncated),
            "failed": len(failed),
            "migrations": migrated,
            "first_errors": [o.error for o in [*truncated, *failed][:3]],
        }
    return result


def _streams_with_a_kill(
    workdir: Path, variant: str, requests: int, kill_at_s: float, restart_at_s: float
) -> tuple[list[Streamed], float]:
    """One variant of streams_replica_killed: the replay's outcomes, and the streams continued."""
    foreign = variant == "foreign"
    with Fleet(workdir) as fleet:
        worker = dataclasses.replace(WORKER, profile=sim_profile(workdir, "slow", step_s=0.05))
        flags = ("--sim-tokenizer", "words") if foreign else ()
        ports = {f"w{n}": free_port() for n in range(4)}
        workers = {
            rid: fleet.add(start_worker(workdir, worker, rid, *flags, port=p)) for rid, p in ports.items()
        }
        config = fast_gateway_config([w.url for w in workers.values()])
        if foreign:
            config["replicas"] = [{"url": w.url, "kind": "openai"} for w in workers.values()]
            config["models"] = {MODEL: {"tokenizer": "none", "foreign_continuation": "completions"}}
        gateway = fleet.add(start_gateway(workdir, "gateway", config))
        wait_healthy(fleet.children, START_TIMEOUT_S, poll_s=POLL_S)
        before = _migrations(gateway.url)
        bodies = []
        for i in range(requests):
            body = completion(family_prompt(i), max_tokens=40)
            if foreign:  # text, which the workers' word tokenizer reads
                body["prompt"] = " ".join(f"w{t}" for t in body["prompt"])
            bodies.append(body)

        def fault() -> None:
            time.sleep(kill_at_s)
            workers["w0"].proc.kill()
            time.sleep(restart_at_s - kill_at_s)
            fleet.add(start_worker(workdir, worker, "w0", *flags, port=ports["w0"]))

        faulting = threading.Thread(target=fault, daemon=True)
        faulting.start()
        spacing_s = (restart_at_s + kill_at_s / 2) / requests
        outcomes = asyncio.run(stream_replay(gateway.url, bodies, spacing_s))
        faulting.join()
        return outcomes, _migrations(gateway.url) - before


def _migrations(url: str) -> float:
    """Streams continued on another replica, as the gateway counted them."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=2.0).text
    except httpx.HTTPError:
        return 0.0
    name = "prefixgate_gateway_stream_migrations_total{"
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith(name) and 'outcome="continued"' in line
    )
