"""Helpers shared by more than one test module: servers, fleets, workers, engines, polling."""
