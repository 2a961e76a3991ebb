"""Who may call what: every protected route against every kind of wrong credential.

With API keys and an admin token configured, each /v1/* route takes only an API key and each
/admin/* and /debug/* route only the admin token; anything else is a 401 in OpenAI's error shape,
checked before the body is read. /health, /metrics and /openapi.json are open. Without an admin
token, the admin routes answer only on a loopback listener: 403 on any other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from gateway.gateway_config import Listen
from tests.support.gateways import SIM_MODEL, RunningGateway, SimWorker

KEYS_ENV, ADMIN_ENV = "PREFIXGATE_TEST_API_KEYS", "PREFIXGATE_TEST_ADMIN_TOKEN"
API_KEYS = ("key-alpha", "key-beta")
ADMIN_TOKEN = "admin-secret-token"


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    # A request that succeeds with the right credential.
    json: Any = None
    params: dict[str, str] | None = None
    ok: int = 200

    def __str__(self) -> str:
        return f"{self.method} {self.path}"


V1_ROUTES = [
    Route("POST", "/v1/completions", {"model": SIM_MODEL, "prompt": [1, 2, 3], "max_tokens": 1}),
    Route("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    Route("GET", "/v1/models"),
]
ADMIN_ROUTES = [
    Route("GET", "/admin/replicas"),
    Route("POST", "/admin/replicas", {"url": "WORKER_URL"}, ok=201),
    Route("POST", "/admin/replicas/w0/drain"),
    Route("POST", "/admin/replicas/w0/undrain"),
    Route("DELETE", "/admin/replicas/no-such-replica", ok=404),
    Route("GET", "/debug/route", params={"prompt": "hello"}),
    Route("POST", "/debug/route", {"prompt": [1, 2, 3]}),
]
OPEN_ROUTES = [Route("GET", "/health"), Route("GET", "/metrics"), Route("GET", "/openapi.json")]
# Authorization headers that are never a credential here, whatever is configured.
WRONG = {
    "missing": None,
    "wrong key": f"Bearer {API_KEYS[0]}x",
    "empty bearer": "Bearer",
    "other scheme": f"Basic {API_KEYS[0]}",
    "no scheme": API_KEYS[0],
    "a prefix of the key": f"Bearer {API_KEYS[0][:-1]}",
}


@pytest.fixture
def workers(start_sim_worker: Callable[..., SimWorker]) -> list[SimWorker]:
    return [start_sim_worker(f"w{i}") for i in range(2)]


@pytest.fixture
def secured(
    workers: list[SimWorker], start_gateway: Callable[..., RunningGateway], monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningGateway]:
    monkeypatch.setenv(KEYS_ENV, ",".join(API_KEYS))
    monkeypatch.setenv(ADMIN_ENV, ADMIN_TOKEN)
    yield start_gateway(
        [w.url for w in workers], auth={"api_keys_env": KEYS_ENV, "admin_token_env": ADMIN_ENV}
    )


def call(
    gateway: RunningGateway, route: Route, authorization: str | None, workers: list[SimWorker]
) -> httpx.Response:
    headers = {"Authorization": authorization} if authorization is not None else {}
    body = route.json
    if body == {"url": "WORKER_URL"}:
        body = {"url": workers[0].url}
    return httpx.request(
        route.method,
        gateway.url + route.path,
        headers=headers,
        json=body,
        params=route.params,
        timeout=10,
    )


def assert_refused(response: httpx.Response, status: int, code: str, where: str) -> None:
    assert response.status_code == status, f"{where}: {response.status_code} {response.text[:300]}"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, where
    assert error["code"] == code, f"{where}: {error}"
    assert error["type"] == ("authentication_error" if status == 401 else "permission_error"), where
    assert isinstance(error["message"], str) and error["message"], where


def test_every_protected_route_refuses_every_wrong_credential(
    secured: RunningGateway, workers: list[SimWorker]
) -> None:
    for route in V1_ROUTES:
        # An admin token is not an API key.
        for name, header in [*WRONG.items(), ("the admin token", f"Bearer {ADMIN_TOKEN}")]:
            assert_refused(call(secured, route, header, workers), 401, "invalid_api_key", f"{route} {name}")
    for route in ADMIN_ROUTES:
        # Nor is an API key an admin token.
        wrong = [*WRONG.items(), *((f"API key {k}", f"Bearer {k}") for k in API_KEYS)]
        for name, header in wrong:
            assert_refused(
                call(secured, route, header, workers), 401, "invalid_admin_token", f"{route} {name}"
            )
    # Nothing was done on the way: no replica drained, removed or added.
    assert [(r.id, r.draining) for r in secured.state.replicas.all()] == [("w0", False), ("w1", False)]


def test_the_right_credential_passes_everywhere(secured: RunningGateway, workers: list[SimWorker]) -> None:
    for route in V1_ROUTES:
        for key in API_KEYS:
            response = call(secured, route, f"Bearer {key}", workers)
            assert response.status_code == route.ok, f"{route}: {response.status_code} {response.text[:300]}"
    # The scheme is case-insensitive, as HTTP's auth schemes are.
    assert call(secured, V1_ROUTES[2], f"bearer {API_KEYS[0]}", workers).status_code == 200
    for route in ADMIN_ROUTES:
        response = call(secured, route, f"Bearer {ADMIN_TOKEN}", workers)
        assert response.status_code == route.ok, f"{route}: {response.status_code} {response.text[:300]}"


def test_open_routes_need_nothing(secured: RunningGateway, workers: list[SimWorker]) -> None:
    for route in OPEN_ROUTES:
        for header in (None, "Bearer nonsense", f"Bearer {ADMIN_TOKEN}"):
            response = call(secured, route, header, workers)
            assert response.status_code == 200, f"{route} with {header}: {response.status_code}"


def test_credentials_are_checked_before_the_body_or_the_route(
    secured: RunningGateway, workers: list[SimWorker]
) -> None:
    url = secured.url
    # A body that is not even JSON, or far too large, still gets the 401 first: nothing is read.
    not_json = httpx.post(f"{url}/v1/completions", content=b"{nope", timeout=10)
    assert_refused(not_json, 401, "invalid_api_key", "bad body")
    with_key = httpx.post(
        f"{url}/v1/completions", content=b"{nope", headers={"Authorization": f"Bearer {API_KEYS[0]}"}
    )
    assert with_key.status_code == 400 and with_key.json()["error"]["code"] == "invalid_json"
    # Routes that do not exist under a protected prefix do not reveal that without a credential.
    for path, code in (("/v1/embeddings", "invalid_api_key"), ("/admin/nothing", "invalid_admin_token")):
        assert_refused(httpx.get(url + path, timeout=10), 401, code, path)
    missing = httpx.get(f"{url}/v1/embeddings", headers={"Authorization": f"Bearer {API_KEYS[1]}"})
    assert missing.status_code == 404 and set(missing.json()["error"]) == {"message", "type", "param", "code"}


def test_keys_rotate_with_the_environment(
    secured: RunningGateway, workers: list[SimWorker], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keys are read from the environment the config names, so a rotated key takes effect at once
    (the YAML reload path re-reads them the same way)."""
    models = V1_ROUTES[2]
    monkeypatch.setenv(KEYS_ENV, "key-gamma")
    assert_refused(call(secured, models, f"Bearer {API_KEYS[0]}", workers), 401, "invalid_api_key", "old")
    assert call(secured, models, "Bearer key-gamma", workers).status_code == 200
    monkeypatch.setenv(ADMIN_ENV, "admin-2")
    admin = ADMIN_ROUTES[0]
    assert_refused(call(secured, admin, f"Bearer {ADMIN_TOKEN}", workers), 401, "invalid_admin_token", "old")
    assert call(secured, admin, "Bearer admin-2", workers).status_code == 200


@pytest.mark.parametrize(
    ("host", "admin_open"),
    [
        ("127.0.0.1", True),
        ("127.3.4.5", True),
        ("localhost", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.1.2.3", False),
        ("gateway.example.com", False),
    ],
)
def test_without_an_admin_token_admin_routes_open_only_on_loopback(
    workers: list[SimWorker],
    start_gateway: Callable[..., RunningGateway],
    monkeypatch: pytest.MonkeyPatch,
    host: str,
    admin_open: bool,
) -> None:
    monkeypatch.delenv(ADMIN_ENV, raising=False)
    monkeypatch.setenv(KEYS_ENV, API_KEYS[0])
    # The test server binds loopback whatever the config says; the check reads listen.host.
    gateway = start_gateway(
        [w.url for w in workers],
        auth={"api_keys_env": KEYS_ENV, "admin_token_env": ADMIN_ENV},
        listen={"host": host, "port": 8000},
    )
    assert gateway.state.config.listen == Listen(host=host, port=8000)
    for route in ADMIN_ROUTES:
        for header in (None, f"Bearer {API_KEYS[0]}", "Bearer anything"):
            response = call(gateway, route, header, workers)
            if admin_open:
                assert response.status_code == route.ok, f"{host} {route}: {response.text[:300]}"
            else:
                assert_refused(response, 403, "admin_disabled", f"{host} {route}")
    # The API keys still guard /v1/* there, and the open routes stay open.
    assert_refused(call(gateway, V1_ROUTES[2], None, workers), 401, "invalid_api_key", host)
    assert call(gateway, V1_ROUTES[2], f"Bearer {API_KEYS[0]}", workers).status_code == 200
    for route in OPEN_ROUTES:
        assert call(gateway, route, None, workers).status_code == 200


def test_without_api_keys_the_api_is_open_and_admin_still_needs_its_token(
    workers: list[SimWorker], start_gateway: Callable[..., RunningGateway], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(KEYS_ENV, raising=False)
    monkeypatch.setenv(ADMIN_ENV, ADMIN_TOKEN)
    gateway = start_gateway(
        [w.url for w in workers], auth={"api_keys_env": KEYS_ENV, "admin_token_env": ADMIN_ENV}
    )
    for route in V1_ROUTES:
        for header in (None, "Bearer whatever"):
            response = call(gateway, route, header, workers)
            assert response.status_code == route.ok, f"{route}: {response.text[:300]}"
    for route in ADMIN_ROUTES:
        assert_refused(call(gateway, route, None, workers), 401, "invalid_admin_token", str(route))
        assert call(gateway, route, f"Bearer {ADMIN_TOKEN}", workers).status_code == route.ok
