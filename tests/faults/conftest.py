"""Fault tests run real fleets: the gateway tests' fixtures, shared, and `fleet` for tests whose
workers or gateway must be processes of their own (to be stopped, killed, or measured); all defined in
tests/support/fixtures.py."""

from tests.support.fixtures import fleet, start_gateway, start_sim_worker

__all__ = ["fleet", "start_gateway", "start_sim_worker"]
