"""Security tests send hostile input through real processes: the gateway tests' fleets, shared, and the
fault tests' `fleet` for gateways or workers that must be processes of their own
(tests/support/fixtures.py)."""

from tests.support.fixtures import fleet, recording_backend, start_gateway, start_sim_worker

__all__ = ["fleet", "recording_backend", "start_gateway", "start_sim_worker"]
