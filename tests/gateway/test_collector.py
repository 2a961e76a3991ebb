"""The garbage collector under the gateway (gateway.collector): pauses counted per generation, what is
alive frozen out of full collections and thawed again, young collections spaced out; a started
gateway does all of it, a replica joining later is frozen with the rest, and /metrics shows the pauses."""

from __future__ import annotations

import gc
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from gateway.collector import YOUNG_THRESHOLD, Pauses, freeze_long_lived, space_young_collections, thaw
from gateway.gateway_config import parse_config
from gateway.http.keys import STATE
from policies import ConfigError
from protocol.loopback_ports import free_port
from tests.support.gateways import RunningGateway, SimWorker


@pytest.fixture
def collector_restored() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_pauses_are_counted_per_generation_while_installed() -> None:
    pauses = Pauses()
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.collections[0] >= 1 and pauses.collections[2] >= 1
    assert pauses.seconds[2] >= pauses.longest[2] > 0
    counted = list(pauses.collections)
    gc.collect(2)  # uninstalled: no longer counted
    assert pauses.collections == counted


@pytest.mark.usefixtures("collector_restored")
def test_a_frozen_index_is_walked_by_no_full_collection() -> None:
    """The index's blocks live in OrderedDicts, which the collector tracks whatever they hold, so a
    full collection walks every entry; frozen, they are in none of the generations it walks, and they
    still work (and are still freed) as before."""
    blocks = OrderedDict((h, 1.0) for h in range(10_000))
    gc.collect()
    assert gc.is_tracked(blocks) and not frozen(blocks)
    freeze_long_lived()
    assert frozen(blocks) and gc.get_freeze_count() > 0
    blocks.move_to_end(0)
    blocks[10_000] = 2.0
    assert next(iter(blocks)) == 1 and len(blocks) == 10_001
    thaw()
    assert gc.get_freeze_count() == 0 and not frozen(blocks)


@pytest.mark.usefixtures("collector_restored")
def test_young_collections_are_spaced_out_or_left_alone() -> None:
    before = gc.get_threshold()
    space_young_collections(None)
    assert gc.get_threshold() == before
    space_young_collections(YOUNG_THRESHOLD)
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *before[1:])


def test_the_collector_section_defaults_and_its_off_switches() -> None:
    default = parse_config({}).collector
    assert default.young_threshold == YOUNG_THRESHOLD and default.freeze
    off = parse_config({"collector": {"young_threshold": None, "freeze": False}}).collector
    assert off.young_threshold is None and not off.freeze
    with pytest.raises(ConfigError, match="young_threshold"):
        parse_config({"collector": {"young_threshold": 0}})


def frozen(obj: object) -> bool:
    """Tracked, yet in no generation a collection walks: in the permanent one gc.freeze made."""
    return gc.is_tracked(obj) and not any(o is obj for o in gc.get_objects())


def _gc_samples(url: str) -> dict[tuple[str, str], float]:
    page = requests.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, s.labels.get("generation", "")): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
        if s.name.startswith("prefixgate_gateway_gc_")
    }


@pytest.mark.usefixtures("collector_restored")
def test_a_started_gateway_freezes_what_is_alive_and_counts_its_pauses(
    start_gateway: Callable[..., RunningGateway], start_sim_worker: Callable[..., SimWorker]
) -> None:
    gc.unfreeze()
    first = start_sim_worker("w0")
    late_port = free_port()
    gw = start_gateway([first.url, f"http://127.0.0.1:{late_port}"], wait_for=1, collector={})
    index = gw.app[STATE].index
    assert index.replicas == ["w0"]
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD
    assert frozen(gw.app[STATE])
    # A replica that comes up later: what is alive then (its index with it) is frozen too.
    before_join = OrderedDict((n, 0.0) for n in range(1000))
    assert not frozen(before_join)
    start_sim_worker("w1", port=late_port)
    deadline = time.monotonic() + 30
    while len(index.replicas) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(index.replicas) == ["w0", "w1"]
    assert frozen(before_join)
    assert not frozen(OrderedDict())
    gc.collect(0)
    gc.collect(2)
    page = _gc_samples(gw.url)
    for generation in ("0", "1", "2"):
        assert ("prefixgate_gateway_gc_collections_total", generation) in page
    assert page["prefixgate_gateway_gc_collections_total", "2"] >= 1
    assert page["prefixgate_gateway_gc_pause_seconds_total", "2"] > 0
    assert page["prefixgate_gateway_gc_longest_pause_seconds", "2"] > 0
