"""Replicas managed while the gateway runs: list, drain, remove, add; /debug/route explaining a
decision; a foreign OpenAI backend routed by approximate predictions; several models side by side."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from bench.probes import wait_for
from tests.support.gateways import PREFIX, SIM_MODEL, RunningGateway, SimWorker, complete


def test_drain_remove_and_add_back(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    workers = [start_sim_worker(f"w{i}") for i in range(2)]
    gateway = start_gateway([w.url for w in workers])
    listed = gateway.admin("GET", "/admin/replicas").json()
    assert [r["id"] for r in listed["replicas"]] == ["w0", "w1"]
    assert all(r["kind"] == "bundled" and r["kv_sync"]["synced"] for r in listed["replicas"])

    drained = gateway.admin("POST", "/admin/replicas/w0/drain").json()
    assert drained["draining"] is True
    assert {complete(gateway, [3000 + 64 * i + j for j in range(64)])[0] for i in range(6)} == {"w1"}
    gateway.admin("POST", "/admin/replicas/w0/undrain")
    assert "w0" in {complete(gateway, [9000 + 64 * i + j for j in range(64)])[0] for i in range(6)}

    removed = gateway.admin("DELETE", "/admin/replicas/w1")
    assert removed.status_code == 200 and "w1" not in gateway.state.replicas
    assert "w1" not in gateway.state.index.replicas
    assert gateway.admin("DELETE", "/admin/replicas/w1").status_code == 404
    assert complete(gateway, PREFIX)[0] == "w0"

    added = gateway.admin("POST", "/admin/replicas", json={"url": workers[1].url})
    assert added.status_code == 201 and added.json()["replica"]["id"] == "w1"
    bad = gateway.admin("POST", "/admin/replicas", json={"url": "ftp://nowhere"})
    assert bad.status_code == 400 and "http" in bad.json()["error"]["message"]
    assert gateway.admin("POST", "/admin/replicas/nope/drain").status_code == 404


def test_debug_route_explains_the_choice(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    gateway = start_gateway([start_sim_worker(f"w{i}").url for i in range(2)])
    served, _, _ = complete(gateway, PREFIX)
    wait_for(lambda: gateway.state.index.blocks_of(served) >= len(PREFIX) // 16, "the KV events", timeout=5)
    explained = gateway.admin(
        "POST", "/debug/route", json={"model": SIM_MODEL, "prompt": [*PREFIX, 1, 2, 3]}
    ).json()
    assert explained["order"][0] == served and explained["prompt_tokens"] == len(PREFIX) + 3
    rows = {row["replica"]: row for row in explained["replicas"]}
    assert rows[served]["matched_blocks"] == len(PREFIX) // 16 and rows[served]["rank"] == 0
    other = next(r for r in rows if r != served)
    assert rows[other]["matched_blocks"] == 0
    assert rows[served]["est_ttft_s"] < rows[other]["est_ttft_s"]
    # Text prompts are tokenized with the model's tokenizer, exactly as a real request would be.
    text = httpx.get(f"{gateway.url}/debug/route", params={"prompt": "hello there"}).json()
    assert text["tokenized"] and text["prompt_tokens"] > 0
    assert httpx.get(f"{gateway.url}/debug/route", params={"model": "nope"}).status_code == 404


def test_a_foreign_backend_is_routed_by_predictions(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    workers = [start_sim_worker(f"w{i}") for i in range(3)]
    # Declared as plain OpenAI servers: no KV events are followed and no token ids are attached.
    gateway = start_gateway(
        [], wait_for=3, replicas=[{"url": w.url, "kind": "openai", "block_size": 16} for w in workers]
    )
    assert {r.kind for r in gateway.state.replicas.all()} == {"openai"} and not gateway.gw.sync.states
    first, predicted, _ = complete(gateway, [*PREFIX, 1])
    assert predicted == 0
    again, predicted, cached = complete(gateway, [*PREFIX, 2, 3])
    assert again == first
    assert predicted == cached == 16 * (len(PREFIX) // 16)


def test_models_are_routed_to_the_replicas_serving_them(
    start_sim_worker: Callable[..., SimWorker], start_gateway: Callable[..., RunningGateway]
) -> None:
    llama = start_sim_worker("llama")
    smol = start_sim_worker("smol", "--sim-profile", "cpu-smollm2")
    gateway = start_gateway([llama.url, smol.url], model=SIM_MODEL)
    names = sorted(m.id for m in gateway.client().models.list().data)
    assert names == ["Llama-3.1-8B-Instruct", "SmolLM2-135M-Instruct"]
    assert complete(gateway, PREFIX)[0] == "llama"
    assert complete(gateway, PREFIX, model="SmolLM2-135M-Instruct")[0] == "smol"
    # With several models, one named nowhere is a 404, and no model at all takes the configured default.
    response = httpx.post(f"{gateway.url}/v1/completions", json={"prompt": PREFIX, "max_tokens": 1})
    assert response.status_code == 200 and response.headers["x-prefixgate-replica"] == "llama"
