"""What `bench fleet` simulates: approximate mode for the index policies only, once per configured
capacity, every policy approximate when the replicas count in another unit; and `--capacity-priors`."""

from __future__ import annotations

import argparse

import pytest

from bench.fleet_jobs import Job, jobs_of, parse_capacity_prior


def test_jobs_run_approximate_mode_for_the_index_policies_only_once_per_capacity() -> None:
    jobs = jobs_of(
        ["round_robin", "prefix_aware", "cache_threshold"], ["precise", "approximate"], [1.0, None]
    )
    assert [(j.policy, j.mode, j.capacity_scale) for j in jobs] == [
        ("round_robin", "precise", None),
        ("prefix_aware", "precise", None),
        ("cache_threshold", "precise", None),
        ("prefix_aware", "approximate", 1.0),
        ("cache_threshold", "approximate", 1.0),
        ("prefix_aware", "approximate", None),
        ("cache_threshold", "approximate", None),
    ]
    assert [j.key for j in jobs[2:]] == [
        "cache_threshold",
        "prefix_aware_approximate",
        "cache_threshold_approximate",
        "prefix_aware_approximate_unset",
        "cache_threshold_approximate_unset",
    ]
    assert Job("prefix_aware", "approximate", 0.25).key == "prefix_aware_approximate_x0.25"


def test_replicas_of_another_unit_run_every_policy_approximate_at_the_first_capacity() -> None:
    jobs = jobs_of(["round_robin", "prefix_aware"], ["precise", "approximate"], [0.5, None], foreign=True)
    assert [(j.policy, j.mode, j.capacity_scale) for j in jobs] == [
        ("prefix_aware", "approximate", 0.5),
        ("prefix_aware", "approximate", None),
        ("round_robin", "approximate", 0.5),
    ]
    assert [j.key for j in jobs] == [
        "prefix_aware_approximate_x0.5",
        "prefix_aware_approximate_unset",
        "round_robin_approximate_x0.5",
    ]
    with pytest.raises(ValueError, match="only be routed in approximate mode"):
        jobs_of(["prefix_aware"], ["precise"], foreign=True)
    assert jobs_of(["round_robin"], ["approximate"]) == []  # approximate changes nothing it reads


def test_capacity_priors_are_positive_multiples_or_unset() -> None:
    assert parse_capacity_prior("unset") is None
    assert parse_capacity_prior("0.25") == 0.25 and parse_capacity_prior("16") == 16.0
    for text in ("0", "-1", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive multiple"):
            parse_capacity_prior(text)
    with pytest.raises(ValueError):
        parse_capacity_prior("lots")


def test_a_precise_job_is_named_by_its_policy_alone() -> None:
    assert Job("least_load", "precise", 4.0).key == "least_load"
    assert Job("cache_threshold", "approximate", 1.0).key == "cache_threshold_approximate"
