"""The gateway YAML: the shipped example parses, secrets come from the environment, and every
mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.gateway_config import load_config, parse_config
from policies import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_the_example_config_parses() -> None:
    config = load_config(CONFIGS / "gateway.example.yaml")
    assert config.routing.policy == "prefix_aware"
    assert config.routing.pd.min_transfer_tokens == 256 and config.routing.pd.decode_penalty_s == 0.01
    assert [r.url for r in config.replicas] == ["http://127.0.0.1:8101", "http://127.0.0.1:8102"]
    assert config.redis is not None and config.redis.url.startswith("redis://")


def test_secrets_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({"auth": {"api_keys_env": "PG_KEYS", "admin_token_env": "PG_ADMIN"}})
    monkeypatch.delenv("PG_KEYS", raising=False)
    assert config.api_keys() == frozenset() and config.admin_token() is None
    monkeypatch.setenv("PG_KEYS", " a , b,,")
    monkeypatch.setenv("PG_ADMIN", "t")
    assert config.api_keys() == {"a", "b"} and config.admin_token() == "t"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"replicas": [{"url": "localhost:8101"}]}, "gateway.replicas.0.url"),
        ({"replicas": [{"url": "http://x", "kind": "tgi"}]}, "gateway.replicas.0.kind"),
        ({"listen": {"port": -1}}, "gateway.listen.port"),
        ({"routing": {"policy": "fastest"}}, "gateway.routing.policy"),
        ({"limits": {"max_attempts": 0}}, "gateway.limits.max_attempts"),
        ({"rediss": {"url": "redis://x"}}, "gateway.rediss: unknown key"),
        ({"replicas": [{"url": "http://x", "role": "prefil"}]}, "gateway.replicas.0.role"),
        ({"replicas": [{"url": "http://x", "role": "decode", "kind": "openai"}]}, "needs pd_protocol"),
        ({"replicas": [{"url": "http://x", "pd_protocol": "vllm"}]}, "pd_protocol needs role"),
        (
            {"replicas": [{"url": "http://x", "role": "decode", "kind": "bundled", "pd_protocol": "vllm"}]},
            "pd_protocol is for foreign replicas",
        ),
        (
            {
                "replicas": [
                    {"url": "http://x", "role": "decode", "pd_protocol": "sglang", "bootstrap_port": 1}
                ]
            },
            "bootstrap_port is an SGLang prefill",
        ),
        (
            {"replicas": [{"url": "http://x", "pd_protocol": "nixl", "role": "decode"}]},
            "replicas.0.pd_protocol",
        ),
        ({"routing": {"pd": {"min_transfer_tokens": -1}}}, "gateway.routing.pd.min_transfer_tokens"),
        ({"routing": {"pd": {"decode_penalty": 0.1}}}, "gateway.routing.pd.decode_penalty: unknown key"),
        (
            {
                "models": {"m": {"tokenizer": "text"}},
                "replicas": [{"url": "http://x", "model": "m", "kv_events": "tcp://127.0.0.1:5557"}],
            },
            "is routed on its text",
        ),
    ],
)
def test_mistakes_name_their_key(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        parse_config(data)


def test_unreadable_or_non_mapping_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "bad.yaml").write_text("a: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_a_foreign_prefill_decode_fleet_parses() -> None:
    config = parse_config(
        {
            "replicas": [
                {"url": "http://p", "kind": "openai", "role": "prefill", "pd_protocol": "sglang"},
                {
                    "url": "http://q",
                    "kind": "openai",
                    "role": "prefill",
                    "pd_protocol": "sglang",
                    "bootstrap_port": 9,
                },
                {"url": "http://d", "kind": "openai", "role": "decode", "pd_protocol": "vllm"},
                {"url": "http://w", "role": "decode"},  # kind auto: a bundled worker is expected
            ]
        }
    )
    assert [(r.role, r.pd_protocol, r.bootstrap_port) for r in config.replicas] == [
        ("prefill", "sglang", 8998),
        ("prefill", "sglang", 9),
        ("decode", "vllm", 8998),
        ("decode", None, 8998),
    ]
