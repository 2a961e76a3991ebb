"""Routing configuration from YAML: validated, with errors that name the key and what is allowed."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from policies.cache_threshold import CacheThreshold, CacheThresholdConfig
from policies.least_load import LeastLoad, LeastLoadConfig
from policies.pd import PdConfig, PrefillDecode
from policies.power_of_two import PowerOfTwo, PowerOfTwoConfig
from policies.prefix_aware import PrefixAware, PrefixAwareConfig
from policies.random_choice import RandomChoice, RandomConfig
from policies.round_robin import RoundRobin, RoundRobinConfig
from policies.session_affinity import SessionAffinity, SessionAffinityConfig
from policies.view import Policy

PolicyName = Literal[
    "round_robin",
    "random",
    "least_load",
    "power_of_two",
    "session_affinity",
    "prefix_aware",
    "cache_threshold",
]


class RoutingConfig(BaseModel):
    """The `routing:` section: the policy by name, and a knob section per policy (all defaulted). `pd`
    routes the models served by prefill and decode replicas (policies.pd), whatever the policy."""

    model_config = ConfigDict(extra="forbid")
    policy: PolicyName = "prefix_aware"
    round_robin: RoundRobinConfig = RoundRobinConfig()
    random: RandomConfig = RandomConfig()
    least_load: LeastLoadConfig = LeastLoadConfig()
    power_of_two: PowerOfTwoConfig = PowerOfTwoConfig()
    session_affinity: SessionAffinityConfig = SessionAffinityConfig()
    prefix_aware: PrefixAwareConfig = PrefixAwareConfig()
    cache_threshold: CacheThresholdConfig = CacheThresholdConfig()
    pd: PdConfig = PdConfig()


class ConfigError(ValueError):
    """A configuration the user must fix; its message names each offending key."""


def format_validation_error(error: ValidationError, prefix: str) -> str:
    lines = []
    for item in error.errors():
        key = ".".join([prefix, *(str(part) for part in item["loc"])])
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            lines.append(f"{key}: {item['msg']} (got {item.get('input')!r})")
    return "invalid configuration:\n  " + "\n  ".join(lines)


def parse_routing(section: dict[str, Any] | None) -> RoutingConfig:
    try:
        return RoutingConfig.model_validate(section or {})
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, "routing")) from None


def build_policy(config: RoutingConfig) -> Policy:
    """A fresh policy instance for the configured name, built with its own knob section."""
    factories = {
        "round_robin": lambda: RoundRobin(config.round_robin),
        "random": lambda: RandomChoice(config.random),
        "least_load": lambda: LeastLoad(config.least_load),
        "power_of_two": lambda: PowerOfTwo(config.power_of_two),
        "session_affinity": lambda: SessionAffinity(config.session_affinity),
        "prefix_aware": lambda: PrefixAware(config.prefix_aware),
        "cache_threshold": lambda: CacheThreshold(config.cache_threshold),
    }
    return factories[config.policy]()


def build_pd(config: RoutingConfig) -> PrefillDecode:
    """A fresh pairing policy: prefill replicas ranked by prefix_aware with its configured knobs."""
    return PrefillDecode(config.pd, PrefixAware(config.prefix_aware))
