"""Fleets for gateway tests: simulated workers and gateways served in-process over loopback HTTP, and
recording foreign backends (the fixtures live in tests/support/fixtures.py, shared with other folders;
the helpers they return in tests/support/gateways.py)."""

from tests.support.fixtures import fleet, recording_backend, start_gateway, start_sim_worker

__all__ = ["fleet", "recording_backend", "start_gateway", "start_sim_worker"]
