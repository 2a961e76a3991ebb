"""Deployment tests run a real fleet for Prometheus to scrape: the gateway tests' fixtures, shared
(tests/support/fixtures.py)."""

from tests.support.fixtures import start_gateway, start_sim_worker

__all__ = ["start_gateway", "start_sim_worker"]
