"""The bounded waiting queue (workers.admission): over HTTP, one request too many is a 429 with
Retry-After; alone, its count of places claimed and given back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from bench.probes import wait_for
from protocol.errors import RETRY_AFTER_S, ApiError
from tests.support.workers import StartWorker, load, random_ids, slow_down
from tests.workers.worker_http import LONG, error_of, first_event
from workers.admission import Admission
from workers.engine.engine_core import EngineConfig


def test_an_over_full_queue_answers_429_with_retry_after(make_worker: StartWorker) -> None:
    worker = make_worker(EngineConfig(block_size=4, num_blocks=256, max_num_seqs=1), max_waiting=1)
    slow_down(worker, 0.02)
    hog = {"prompt": random_ids(20, seed=5), "max_tokens": 400, "stream": True, **LONG}
    with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=worker.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=hog) as stream:
            lines = stream.iter_lines()
            first_event(lines)
            queued = pool.submit(
                httpx.post,
                f"{worker.url}/v1/completions",
                json={"prompt": "queued", "max_tokens": 2},
                timeout=20,
            )
            wait_for(lambda: load(worker)["waiting"] == 1, "one request waiting")
            refused = httpx.post(
                f"{worker.url}/v1/completions", json={"prompt": "one too many", "max_tokens": 2}
            )
            assert error_of(refused, 429)["code"] == "queue_full"
            assert int(refused.headers["Retry-After"]) >= 1
            with pytest.raises(openai.RateLimitError):
                worker.client().completions.create(model=worker.model, prompt="x", max_tokens=1)
        # The hog's client left: the queued request runs now.
        assert queued.result().status_code == 200
    assert worker.client().completions.create(model=worker.model, prompt="x", max_tokens=1).usage


# -- the queue's count, without a server ------------------------------------------------------------


def test_a_queue_of_fewer_than_one_place_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Admission(0)


def test_the_place_past_the_limit_is_a_429_naming_the_limit_with_retry_after() -> None:
    admission = Admission(2)
    with admission.slot(), admission.slot():
        assert admission.waiting == 2
        with pytest.raises(ApiError) as refused, admission.slot():
            pass
        assert refused.value.status == 429 and refused.value.code == "queue_full"
        assert "2 requests" in refused.value.message
        assert refused.value.headers == {"Retry-After": str(RETRY_AFTER_S)}
        assert admission.waiting == 2, "a refused request holds no place"
    assert admission.waiting == 0


def test_a_place_released_once_generation_starts_is_not_released_again_on_exit() -> None:
    admission = Admission(1)
    with admission.slot() as release:
        release()
        release()
        assert admission.waiting == 0
        with admission.slot():
            assert admission.waiting == 1
    assert admission.waiting == 0


def test_a_failed_request_gives_its_place_back() -> None:
    admission = Admission(1)
    with pytest.raises(RuntimeError), admission.slot():
        raise RuntimeError("tokenizer failed")
    assert admission.waiting == 0
