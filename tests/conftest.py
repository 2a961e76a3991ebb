"""Shared fixtures (a real redis-server on a free loopback port, started and stopped by the tests) and
the test tiers: unit tests by default, and markers for the slower kinds, which `make test-fast` leaves
out and `make test` runs (CONTRIBUTING.md)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.redis import private_redis

TIERS = {
    "fleet": "starts servers or processes and talks to them over loopback (HTTP, Redis, ZMQ)",
    "real": "runs the real SmolLM2 model or a real vLLM server",
    "deploy": "Docker images, Kubernetes manifests, Envoy or Prometheus",
    "fuzz": "generated inputs by the hundred: schema and property fuzzing",
}
# Fixtures that start a server or a process: a test that asks for one is in the fleet tier whatever
# its module says, so that a new test cannot land in the fast loop by forgetting a marker.
SERVER_FIXTURES = frozenset(
    {"redis_url", "start_sim_worker", "start_gateway", "recording_backend", "fleet", "serve", "make_worker",
     "tiny_worker"}
)  # fmt: skip
# Fixtures that load the real model: the real tier.
MODEL_FIXTURES = frozenset({"smollm2_worker"})


def pytest_configure(config: pytest.Config) -> None:
    for name, what in TIERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


# Folders whose every test is of one tier: faults are provoked in running fleets, deployments built.
FOLDER_TIERS = {"faults": "fleet", "deploy": "deploy"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(Path(__file__).parent).parts[0]
        if folder in FOLDER_TIERS:
            item.add_marker(FOLDER_TIERS[folder])
        fixtures = getattr(item, "fixturenames", ())
        if MODEL_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.real)
        elif SERVER_FIXTURES.intersection(fixtures):
            item.add_marker(pytest.mark.fleet)


def interpret_triton_without_a_gpu() -> None:
    """Triton chooses between its interpreter and its compiler when triton.language is first imported,
    and importing transformers' model classes imports it (torch registers Triton ops), so the session's
    choice is made here, before any test module loads: without a CUDA device, the Triton attention
    kernels run in the interpreter (tests/workers/engine/test_attention_triton.py)."""
    if importlib.util.find_spec("torch") is None:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


interpret_triton_without_a_gpu()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """redis://127.0.0.1:PORT/0 of a redis-server private to this test session, with no persistence."""
    with private_redis(tmp_path_factory.mktemp("redis")) as url:
        yield url
