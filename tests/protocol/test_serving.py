"""Which event loop the servers run on: uvloop where asked for or installed, asyncio's otherwise, and
a clear refusal where uvloop is asked for and missing."""

from __future__ import annotations

import asyncio
import builtins
import importlib.util
from typing import Any

import pytest

from protocol.serving import new_event_loop

HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None


def kind(loop: asyncio.AbstractEventLoop) -> str:
    try:
        return type(loop).__module__.split(".")[0]
    finally:
        loop.close()


def test_asyncio_is_asyncios_loop() -> None:
    assert kind(new_event_loop("asyncio")) == "asyncio"


def test_auto_takes_uvloop_exactly_when_it_is_installed() -> None:
    assert kind(new_event_loop("auto")) == ("uvloop" if HAS_UVLOOP else "asyncio")


@pytest.mark.skipif(not HAS_UVLOOP, reason="uvloop is not installed (the fast extra)")
def test_a_uvloop_loop_runs_a_coroutine() -> None:
    loop = new_event_loop("uvloop")
    try:
        assert loop.run_until_complete(asyncio.sleep(0, result=7)) == 7
    finally:
        loop.close()


def test_uvloop_asked_for_but_missing_is_refused_with_the_extra_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_import = builtins.__import__

    def without_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("No module named 'uvloop'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_uvloop)
    with pytest.raises(SystemExit, match=r"prefixgate\[fast\]"):
        new_event_loop("uvloop")
