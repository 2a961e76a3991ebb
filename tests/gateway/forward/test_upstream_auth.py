"""What Authorization a replica sees: none by default (client keys stay at the gateway), the client's
when `forward_client_key` is set, or the gateway's own upstream key; and never another client's
cookies.

The replica here is a minimal OpenAI-compatible server written for this test, standing in for a
foreign backend that checks keys; it answers with the Authorization header it received."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest
from aiohttp import web

from tests.support.gateways import RunningGateway, foreign_backend


async def _complete(request: web.Request) -> web.Response:
    """Echoes the Authorization it received (the Cookie, for the user `cookie`), and sets a cookie."""
    body = await request.json()
    header = "Cookie" if body.get("user") == "cookie" else "Authorization"
    seen = request.headers.get(header, "<none>")
    return web.json_response(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "created": 0,
            "model": "echo",
            "choices": [{"index": 0, "text": seen, "finish_reason": "stop", "logprobs": None}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        },
        headers={"Set-Cookie": "session=of-the-first-client; Path=/"},
    )


@pytest.fixture
def echo_backend() -> Iterator[str]:
    with foreign_backend("echo", _complete) as url:
        yield url


@pytest.mark.parametrize(
    ("auth", "expected"),
    [
        ({}, "<none>"),
        ({"forward_client_key": True}, "Bearer client-key"),
        ({"upstream_key_env": "TEST_PG_UPSTREAM"}, "Bearer upstream-secret"),
    ],
)
def test_the_replica_sees_only_the_key_it_is_configured_to_see(
    echo_backend: str,
    start_gateway: Callable[..., RunningGateway],
    monkeypatch: pytest.MonkeyPatch,
    auth: dict[str, object],
    expected: str,
) -> None:
    monkeypatch.setenv("TEST_PG_KEYS", "client-key")
    monkeypatch.setenv("TEST_PG_UPSTREAM", "upstream-secret")
    gateway = start_gateway(
        [],
        wait_for=1,
        replicas=[{"url": echo_backend, "kind": "openai"}],
        models={"echo": {"tokenizer": "none"}},
        auth={"api_keys_env": "TEST_PG_KEYS", **auth},
    )
    reply = gateway.client("client-key").completions.create(model="echo", prompt="hi", max_tokens=1)
    assert reply.choices[0].text == expected


def test_a_replica_cookie_never_reaches_the_replica_again(
    echo_backend: str, start_gateway: Callable[..., RunningGateway]
) -> None:
    """Each answer sets a cookie; the gateway keeps none, so no request carries one upstream. The
    replica is named by host name, as in a cluster: cookies from a bare IP address no jar keeps."""
    by_name = echo_backend.replace("127.0.0.1", "localhost")
    gateway = start_gateway(
        [],
        wait_for=1,
        replicas=[{"url": by_name, "kind": "openai"}],
        models={"echo": {"tokenizer": "none"}},
    )
    seen = [
        httpx.post(
            f"{gateway.url}/v1/completions",
            json={"model": "echo", "prompt": "hi", "user": "cookie"},
            timeout=10,
        )
        for _ in range(2)
    ]
    assert [r.status_code for r in seen] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in seen] == ["<none>", "<none>"]
