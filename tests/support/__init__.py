"""Helpers shared by more than one test module: servers, fleets, workers, engines (polling is
bench.probes' wait_for, which the benchmarks use too)."""
