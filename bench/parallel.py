"""Single-threaded simulations side by side, one per core, under the one progress bar the parent draws.

Each job is a picklable callable taking `on_request_done`, which it calls once per request finished;
the children add to one shared counter that the parent's bar follows.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.sharedctypes import Synchronized
from typing import Any

from tqdm import tqdm

Job = Callable[..., Any]

# Requests finished across every job of a run.
_finished: Synchronized | None = None


def _init_job(counter: Synchronized) -> None:
    global _finished
    _finished = counter


def _count_one() -> None:
    assert _finished is not None
    with _finished.get_lock():
        _finished.value += 1


def _run_counted(job: Job) -> Any:
    return job(on_request_done=_count_one)


def run_jobs(jobs: Sequence[Job], total: int, processes: int | None = None) -> list[Any]:
    """Each job's result, in order; `total` is the requests of all jobs together (the bar's end)."""
    workers = max(1, min(len(jobs), processes or os.cpu_count() or 1))
    context = multiprocessing.get_context("fork")
    counter = context.Value("q", 0)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_job, initargs=(counter,)) as pool:
        futures = [pool.submit(_run_counted, job) for job in jobs]
        with tqdm(total=total, desc=f"{len(jobs)} simulations on {workers} processes") as bar:
            while not all(f.done() for f in futures):
                time.sleep(0.5)
                bar.update(counter.value - bar.n)
            bar.update(counter.value - bar.n)
        return [f.result() for f in futures]
