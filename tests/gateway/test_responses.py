"""The Responses API through the gateway: routed by instructions + input, and a request continuing a
stored response (`previous_response_id`) sent to the one replica holding it, through any gateway of
the fleet (the owner shared through Redis)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateways import RecordingBackend, RunningGateway

MODEL = "foreign-m"


def client(gateway: RunningGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="none", max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_continued_response_lands_on_its_replica_across_gateways(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
    redis_url: str,
    stream: bool,
) -> None:
    backends = [recording_backend(f"b{i}") for i in range(3)]
    urls = [url for _, url in backends]
    # Round robin: without the owner's record, each follow-up would go to the next replica, which
    # does not hold the response (and answers 404, as a real server does).
    config = {"redis": {"url": redis_url}, "routing": {"policy": "round_robin"}, "models": {MODEL: {}}}
    gateways = [start_gateway(urls, **config) for _ in range(2)]
    previous = None
    owners = []
    for turn in range(6):
        gateway = gateways[turn % 2]  # every follow-up through the other gateway
        args = {"model": MODEL, "input": f"turn {turn}", "instructions": "Be brief."}
        if previous is not None:
            args["previous_response_id"] = previous
        if stream:
            with client(gateway).responses.create(stream=True, **args) as events:
                done = [e for e in events if e.type == "response.completed"]
            response = done[0].response
        else:
            response = client(gateway).responses.create(**args)
        owners.append(response.id.split("_")[1])
        previous = response.id
    assert len(set(owners)) == 1, f"every turn must be served where the conversation lives: {owners}"
    # The owner's record is shared: each gateway knows the responses the other produced.
    assert all(gw.state.response_owners.redis_errors == 0 for gw in gateways)


def test_a_stored_response_is_read_where_it_lives(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    backends = [recording_backend(f"b{i}") for i in range(3)]
    gateway = start_gateway(
        [url for _, url in backends], routing={"policy": "round_robin"}, models={MODEL: {}}
    )
    created = client(gateway).responses.create(model=MODEL, input="hello")
    owner = created.id.split("_")[1]
    for _ in range(4):
        got = httpx.get(f"{gateway.url}/v1/responses/{created.id}")
        assert got.json()["backend"] == owner
        owner_url = next(url for backend, url in backends if backend.name == owner)
        assert got.headers["x-prefixgate-replica"] == gateway.state.replicas.by_url(owner_url).id
    deleted = httpx.delete(f"{gateway.url}/v1/responses/{created.id}")
    assert deleted.json() == {"backend": owner, "path": f"/v1/responses/{created.id}", "method": "DELETE"}


def test_an_unknown_previous_response_is_the_backends_to_refuse(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    _, url = recording_backend("b0")
    gateway = start_gateway([url], models={MODEL: {}})
    with pytest.raises(openai.NotFoundError, match="resp_nowhere"):
        client(gateway).responses.create(model=MODEL, input="x", previous_response_id="resp_nowhere")


def test_responses_are_routed_by_their_prefix(
    recording_backend: Callable[..., tuple[RecordingBackend, str]],
    start_gateway: Callable[..., RunningGateway],
) -> None:
    backends = [recording_backend(f"b{i}") for i in range(4)]
    gateway = start_gateway([url for _, url in backends], models={MODEL: {}})
    instructions = "You are the archivist of a large library. " * 30
    served = set()
    for question in ("Where are the maps?", "When do you open?", "Who wrote this?"):
        response = client(gateway).responses.with_raw_response.create(
            model=MODEL, instructions=instructions, input=[{"role": "user", "content": question}]
        )
        served.add(response.headers["x-prefixgate-replica"])
        predicted = int(response.headers["x-prefixgate-predicted-cached-tokens"])
    assert len(served) == 1, "requests sharing their instructions go where that prefix is"
    assert predicted >= 16 * 10
