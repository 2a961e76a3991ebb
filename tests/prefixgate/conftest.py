"""The CLI's tests run `prefixgate serve` in front of simulated workers (tests/support/fixtures.py)."""

from tests.support.fixtures import start_sim_worker

__all__ = ["start_sim_worker"]
