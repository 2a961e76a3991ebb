"""What the worker's HTTP tests ask of every answer, shared by the test files that split the app's
routes between them: greedy sampling that never stops early, the shape of an OpenAI error, and the
first event of a stream."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

LONG = {"ignore_eos": True}


def greedy(**extra: object) -> dict:
    return {"temperature": 0, "extra_body": {"ignore_eos": True, **extra}}


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) >= {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def first_event(lines: Iterator[str]) -> str:
    """The first SSE data line. The caller keeps `lines` alive: a dropped httpx line iterator
    closes its connection, which is a disconnect."""
    return next(line for line in lines if line.startswith("data: "))
