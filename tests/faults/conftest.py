"""Fault tests run real fleets: the gateway tests' fixtures, shared, and `fleet` for tests whose
workers or gateway must be processes of their own (to be stopped, killed, or measured)."""

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.chaos import Fleet
from tests.gateway.conftest import start_gateway, start_sim_worker

__all__ = ["fleet", "start_gateway", "start_sim_worker"]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """Child processes started by bench.chaos helpers (`fleet.add(...)`), all stopped after the test
    (SIGCONT first, for one left stopped)."""
    with Fleet(tmp_path / "fleet") as running:
        yield running
