"""Routing YAML: every preset builds, and every mistake names its key and the allowed values."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from policies import POLICY_NAMES, ConfigError, build_policy, parse_routing

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_build_prefix_aware() -> None:
    policy = build_policy(parse_routing(None))
    assert policy.name == "prefix_aware"


def test_every_preset_parses_and_builds() -> None:
    presets = yaml.safe_load((CONFIGS / "routing-presets.yaml").read_text())
    built = {build_policy(parse_routing(section)).name for section in presets.values()}
    assert built == set(POLICY_NAMES)


def test_example_gateway_config_routing_section() -> None:
    config = yaml.safe_load((CONFIGS / "gateway.example.yaml").read_text())
    routing = parse_routing(config["routing"])
    assert routing.policy == "prefix_aware"
    assert routing.prefix_aware.recompute_penalty == 1.0


def test_unknown_policy_lists_the_allowed_names() -> None:
    with pytest.raises(ConfigError) as error:
        parse_routing({"policy": "fastest"})
    message = str(error.value)
    assert "routing.policy" in message and "'fastest'" in message
    assert all(name in message for name in POLICY_NAMES)


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ({"prefix_aware": {"temperature": -0.1}}, "routing.prefix_aware.temperature"),
        ({"prefix_aware": {"recompute_penalty": 101}}, "routing.prefix_aware.recompute_penalty"),
        ({"prefix_aware": {"mode": "psychic"}}, "routing.prefix_aware.mode"),
        ({"session_affinity": {"virtual_nodes": 0}}, "routing.session_affinity.virtual_nodes"),
        ({"random": {"seed": "abc"}}, "routing.random.seed"),
        ({"pd": {"decode_penalty_s": 11}}, "routing.pd.decode_penalty_s"),
        ({"pd": {"min_transfer_tokens": "many"}}, "routing.pd.min_transfer_tokens"),
    ],
)
def test_out_of_range_knob_names_the_key(section: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_routing(section)


def test_unknown_key_is_rejected_by_name() -> None:
    with pytest.raises(ConfigError, match=r"routing\.prefix_aware\.temprature: unknown key"):
        parse_routing({"prefix_aware": {"temprature": 0.5}})
