"""Measure the cpu-smollm2 profile: time the real ModelRunner on a grid of batch shapes, fit the cost model.

    python -m workers.sim.calibrate --json OUT [--repeats 3] [--threads 1]

The grid varies one thing at a time: prefill chunks of several sizes at several start positions
(dense cost per token, attention cost per causal pair), and decode batches of several sizes at
several context lengths (per-sequence cost, KV read per token). A few mixed steps, shaped like
what the scheduler really produces, are kept out of the fit and reported as the holdout error.

What is timed is `ModelRunner.execute`, the whole forward pass with input preparation and sampling;
the scheduler's own per-step work is left out (well under a millisecond here). The machine's cores
are shared, so each shape's time is the median over repeats after a warm-up, and with the default of
one torch thread it is the CPU time of the thread running the step: the step's time on a core of its
own, whatever else runs. One thread is deliberate: with other processes on the cores, OpenMP threads
that outnumber the free ones spin and make every step several times slower and erratic; a simulated
laptop fleet also gives each replica a core at most.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from protocol.cpuinfo import cpuinfo_field
from workers.engine.batch import ScheduledChunk
from workers.engine.sampling_params import SamplingParams
from workers.sim.cost_model import StepShape, step_shape
from workers.sim.fit import Fit, fit_cost_model, relative_errors
from workers.sim.profiles import CPU_SMOLLM2, profile_to_json

if TYPE_CHECKING:
    from workers.engine.loader import LoadedModel
    from workers.engine.model_runner import ModelRunner

CALIBRATION_THREADS = 1

# A composition is one step: its chunks as (start_pos, num_tokens), every chunk sampling. Decode
# batches stay within what the profile's pool holds (5.8k KV tokens), the range the fit is for: KV
# reads far beyond the CPU caches cost more per token than the form's single coefficient says.
Composition = tuple[tuple[int, int], ...]

PREFILL_GRID: list[Composition] = [((p, q),) for q in (16, 64, 192) for p in (0, 512, 1536)] + [((0, 512),)]
DECODE_GRID: list[Composition] = [
    ((ctx, 1),) * n
    for n, contexts in (
        (1, (32, 1024, 4096)),
        (4, (32, 512, 1400)),
        (16, (32, 128, 350)),
        (32, (32, 90, 180)),
    )
    for ctx in contexts
]
HOLDOUT: list[Composition] = [
    ((256, 96), *((600, 1),) * 8),
    ((0, 40), (200, 80)),
    ((200, 1),) * 24,
]
GREEDY = SamplingParams(temperature=0.0)


def build_chunks(composition: Composition, block_size: int, vocab_size: int) -> list[ScheduledChunk]:
    """The chunks of one step, each over its own blocks (numbered from 0, so steps reuse the pool)."""
    chunks, next_block = [], 0
    for seq_id, (start, n) in enumerate(composition):
        blocks = -(-(start + n) // block_size)
        tokens = [(seq_id * 7919 + i * 104729) % vocab_size for i in range(start, start + n)]
        table = list(range(next_block, next_block + blocks))
        chunks.append(ScheduledChunk(seq_id, tokens, start, table, True, GREEDY, num_generated=1))
        next_block += blocks
    return chunks


def shapes_of(compositions: Sequence[Composition], block_size: int, vocab_size: int) -> list[StepShape]:
    """What the cost model sees of each step: the fit's samples."""
    return [step_shape(build_chunks(c, block_size, vocab_size)) for c in compositions]


def blocks_needed(compositions: Sequence[Composition], block_size: int) -> int:
    return max(sum(-(-(s + n) // block_size) for s, n in c) for c in compositions)


def make_runner(
    loaded: LoadedModel, compositions: Sequence[Composition], threads: int, block_size: int
) -> ModelRunner:
    from workers.engine.model_runner import ModelRunner

    return ModelRunner(
        loaded.model,
        num_blocks=blocks_needed(compositions, block_size),
        block_size=block_size,
        backend="torch_sdpa",
        num_threads=threads,
    )


def step_timer(threads: int) -> Callable[[], float]:
    """The clock steps are timed on. With one torch thread the forward pass runs on the calling
    thread, so that thread's CPU time is the step's time on a core of its own, however many other
    processes share the machine; with more threads their CPU times add up, so it has to be wall time."""
    return time.thread_time if threads == 1 else time.perf_counter


def measure(
    runner: ModelRunner, chunks: list[ScheduledChunk], repeats: int, timer: Callable[[], float]
) -> float:
    """Median seconds of `runner.execute(chunks)` on `timer`, after one untimed warm-up."""
    runner.execute(chunks)
    times = []
    for _ in range(repeats):
        start = timer()
        runner.execute(chunks)
        times.append(timer() - start)
    return statistics.median(times)


@dataclasses.dataclass(frozen=True, slots=True)
class Calibration:
    fit: Fit
    grid: list[Composition]
    times: list[float]
    holdout_times: list[float]
    holdout_errors: tuple[float, ...]


def calibrate(loaded: LoadedModel, *, repeats: int, threads: int, block_size: int) -> Calibration:
    grid = PREFILL_GRID + DECODE_GRID
    runner = make_runner(loaded, grid + HOLDOUT, threads, block_size)
    vocab = loaded.config.vocab_size
    timer = step_timer(threads)

    def timed(compositions: list[Composition]) -> list[float]:
        times = []
        for comp in compositions:
            times.append(measure(runner, build_chunks(comp, block_size, vocab), repeats, timer))
            print(f"  {describe(comp):<32} {times[-1] * 1e3:9.1f} ms", file=sys.stderr, flush=True)
        return times

    times = timed(grid)
    fit = fit_cost_model(shapes_of(grid, block_size, vocab), times)
    holdout_times = timed(HOLDOUT)
    holdout_shapes = shapes_of(HOLDOUT, block_size, vocab)
    return Calibration(
        fit, grid, times, holdout_times, relative_errors(fit.model, holdout_shapes, holdout_times)
    )


def describe(composition: Composition) -> str:
    """'3 x 1 @ 512 + 64 @ 0': counts of identical (num_tokens @ start_pos) chunks."""
    parts = []
    for chunk in dict.fromkeys(composition):
        count = composition.count(chunk)
        parts.append(f"{count} x {chunk[1]} @ {chunk[0]}" if count > 1 else f"{chunk[1]} @ {chunk[0]}")
    return " + ".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m workers.sim.calibrate", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--json", type=Path, required=True, help="where to write the calibrated profile")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per shape (median taken)")
    parser.add_argument("--threads", type=int, default=CALIBRATION_THREADS, help="torch CPU threads")
    args = parser.parse_args(argv)

    from workers.engine.llm import load

    loaded = load()
    block_size = CPU_SMOLLM2.block_size
    clock = "thread CPU time" if step_timer(args.threads) is time.thread_time else "wall time"
    print(
        f"timing {loaded.name}, {args.threads} thread(s), median {clock} of {args.repeats}", file=sys.stderr
    )
    cal = calibrate(loaded, repeats=args.repeats, threads=args.threads, block_size=block_size)
    model = cal.fit.model
    print("\nshape                              measured ms  predicted ms  error")
    for comp, t, err in zip(
        cal.grid + HOLDOUT,
        cal.times + cal.holdout_times,
        cal.fit.relative_errors + cal.holdout_errors,
        strict=True,
    ):
        print(f"{describe(comp):<34} {t * 1e3:11.1f} {t * (1 + err) * 1e3:13.1f} {err:+7.1%}")
    holdout_max = max(abs(e) for e in cal.holdout_errors)
    print(f"\n{model}\nridge: {model.ridge_tokens:.1f} tokens")
    print(f"fit error: RMS {cal.fit.rms_error:.1%}, max {cal.fit.max_error:.1%} over {len(cal.grid)} shapes")
    print(f"holdout error: max {holdout_max:.1%} over {len(HOLDOUT)} mixed shapes")
    cpu = cpuinfo_field("model name") or "unknown CPU"
    source = (
        f"calibrated {datetime.date.today().isoformat()} on {cpu} with {args.threads} torch "
        f"thread(s), fp32, SDPA; median {clock} of {args.repeats} runs per shape; fit RMS error "
        f"{cal.fit.rms_error:.1%} (max {cal.fit.max_error:.1%}), holdout max {holdout_max:.1%}"
    )
    profile = dataclasses.replace(CPU_SMOLLM2, cost=model, source=source)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(profile_to_json(profile), indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
