"""SimRunner: a drop-in for ModelRunner.execute that returns synthetic tokens and takes modelled time.

Time passes through a clock object, so one runner serves both uses:
- RealClock sleeps each step's predicted time, so a server in front of the engine sees the TTFT and
  throughput of the profiled hardware;
- VirtualClock only adds the step time to its own reading, so a discrete-event simulator runs a
  fleet as fast as the scheduler code allows and reads each replica's time from its clock.

Tokens are a hash of (seed, seq_id, num_generated): the same request gets the same output every run,
whatever else shares its batch (the choices of an n > 1 request, sequences of their own, differ), and
a prompt never ends early unless an EOS rate is asked for, so a trace's max_tokens is its output
length.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from workers.engine.batch import SampleSlot, ScheduledChunk, StepOutput, sample_slots
from workers.sim.cost_model import StepCost

_MASK64 = (1 << 64) - 1


class SimClock(Protocol):
    def now(self) -> float: ...

    def wait(self, seconds: float) -> None:
        """Let `seconds` pass: sleep them, or just count them."""
        ...


class RealClock:
    def now(self) -> float:
        return time.monotonic()

    def wait(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


@dataclass(slots=True)
class VirtualClock:
    """Simulated seconds; only the runner's steps and the simulator's jumps move it."""

    time: float = 0.0

    def now(self) -> float:
        return self.time

    def wait(self, seconds: float) -> None:
        self.time += seconds

    def advance_to(self, t: float) -> None:
        """Jump an idle replica forward to an event's time (never backward: steps are not undone)."""
        self.time = max(self.time, t)


def _mix(*values: int) -> int:
    """splitmix64 over the values: cheap, well spread, the same on every platform and run."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (v & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        h = (h ^ (h >> 27)) * 0x94D049BB133111EB & _MASK64
        h ^= h >> 31
    return h


def synthetic_token(
    seed: int,
    seq_id: int,
    num_generated: int,
    vocab_size: int,
    excluded: Sequence[int] = (),
    eos_token_id: int | None = None,
    eos_probability: float = 0.0,
) -> int:
    """The sim's next token: `eos_token_id` with `eos_probability`, otherwise uniform over the vocabulary
    minus `excluded` (the ids that would stop the request)."""
    h = _mix(seed, seq_id, num_generated)
    if eos_token_id is not None and (h >> 11) / 2**53 < eos_probability:
        return eos_token_id
    skip = sorted({e for e in excluded if 0 <= e < vocab_size})
    token = _mix(h, 1) % (vocab_size - len(skip))
    # The k-th allowed id: step over every excluded id at or below it.
    for e in skip:
        if token >= e:
            token += 1
    return token


class SimRunner:
    """Executes steps by the cost model: one synthetic token per sample slot (a sampling chunk, then
    its forks), the step's time waited.

    eos_token_ids: ids that never come out except as an asked-for EOS (eos_probability per token,
    the first of them), so that outputs run to max_tokens by default.
    """

    def __init__(
        self,
        cost: StepCost,
        *,
        vocab_size: int,
        eos_token_ids: Sequence[int] = (),
        eos_probability: float = 0.0,
        clock: SimClock | None = None,
        seed: int = 0,
    ) -> None:
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError(f"eos_probability must be in [0, 1], got {eos_probability}")
        if eos_probability and not eos_token_ids:
            raise ValueError("an eos_probability needs an eos token id to emit")
        self.cost = cost
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_probability = eos_probability
        self.clock: SimClock = clock or RealClock()
        self.seed = seed
        # Predicted seconds of the latest step executed.
        self.last_step_time = 0.0

    def step_time(self, chunks: Sequence[ScheduledChunk]) -> float:
        return self.cost.step_time(chunks)

    def outputs(self, chunks: Sequence[ScheduledChunk]) -> list[StepOutput]:
        """One StepOutput per sample slot, in ModelRunner.execute's order, taking no time."""
        return [self._output(slot) for slot in sample_slots(chunks)]

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[StepOutput]:
        """ModelRunner.execute's contract; the step's predicted time passes on the clock."""
        outputs = self.outputs(chunks)
        self.last_step_time = self.step_time(chunks)
        self.clock.wait(self.last_step_time)
        return outputs

    def _output(self, slot: SampleSlot) -> StepOutput:
        sampling = slot.sampling
        token = synthetic_token(
            self.seed,
            slot.seq_id,
            slot.num_generated,
            self.vocab_size,
            excluded=(*self.eos_token_ids, *sampling.stop_token_ids),
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            eos_probability=self.eos_probability,
        )
        if sampling.logprobs is None:
            return StepOutput(slot.seq_id, token)
        # The sim is certain of its token; it has no alternatives to offer beyond it.
        return StepOutput(slot.seq_id, token, 0.0, [(token, 0.0)][: sampling.logprobs])
