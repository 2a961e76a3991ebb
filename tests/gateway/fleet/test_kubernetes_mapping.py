"""What a pod, an EndpointSlice or an InferencePool means for the replica set (gateway.fleet.kube_mapping):
only ready pods are replicas, annotations override the section, and what fails validation is skipped and
counted, never raised."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.resources.core_v1 import Pod
from lightkube.resources.discovery_v1 import EndpointSlice
from pydantic import ValidationError

from gateway.fleet.kube_mapping import Pool, pod_entries, pool_of, slice_entries
from gateway.gateway_config import KubernetesSection
from gateway.rejections import Rejections

SECTION = KubernetesSection(inference_pool="llm", model="m")


def pod(ip: str | None = "10.0.0.7", ready: str = "True", phase: str = "Running", **meta: Any) -> Pod:
    status = {"phase": phase, "podIP": ip, "conditions": [{"type": "Ready", "status": ready}]}
    return Pod.from_dict({"metadata": {"name": "p", **meta}, "status": status})


def test_a_ready_pod_is_one_replica_per_port() -> None:
    rejections = Rejections()
    (entry,) = pod_entries(pod(), (8000,), SECTION, rejections).values()
    assert (entry.id, entry.url, entry.kind, entry.model) == ("p", "http://10.0.0.7:8000", "openai", "m")
    two = pod_entries(pod(), (8000, 8001), SECTION, rejections)
    assert sorted(two) == ["p:8000", "p:8001"]
    assert two["p:8001"].url == "http://10.0.0.7:8001"
    assert sorted(
        pod_entries(pod(), (8000, 8001), SECTION.model_copy(update={"port": 9000}), rejections)
    ) == ["p"]
    assert not rejections.counts


@pytest.mark.parametrize(
    "unready",
    [
        pod(ready="False"),
        pod(phase="Pending"),
        pod(ip=None),
        pod(deletionTimestamp="2025-01-01T00:00:00Z"),
    ],
    ids=["not-ready", "pending", "no-ip", "deleting"],
)
def test_a_pod_that_is_not_ready_is_no_replica(unready: Pod) -> None:
    assert pod_entries(unready, (8000,), SECTION, Rejections()) == {}


def test_annotations_override_the_section() -> None:
    annotations = {
        "prefixgate.io/kind": "bundled",
        "prefixgate.io/model": "other",
        "prefixgate.io/block-size": "32",
        "prefixgate.io/kv-events": "tcp://{ip}:5557",
        "unrelated.io/x": "anything",
    }
    (entry,) = pod_entries(pod(annotations=annotations), (8000,), SECTION, Rejections()).values()
    assert (entry.kind, entry.model, entry.block_size) == ("bundled", "other", 32)
    assert (entry.kv_events, entry.kv_events_replay) == ("tcp://10.0.0.7:5557", "tcp://10.0.0.7:5558")
    (v6,) = pod_entries(pod(ip="fd00::7"), (8000,), SECTION, Rejections()).values()
    assert v6.url == "http://[fd00::7]:8000"


@pytest.mark.parametrize(
    "annotations",
    [
        {"prefixgate.io/block-size": "0"},
        {"prefixgate.io/block-size": "sixteen"},
        {"prefixgate.io/block-size": str(1 << 20)},
        {"prefixgate.io/kind": "auto"},
        {"prefixgate.io/model": ""},
        {"prefixgate.io/kv-events": "http://{ip}:5557"},
        {"prefixgate.io/kv-events-replay": "tcp://{ip}:5558"},
    ],
)
def test_a_bad_annotation_costs_its_pod_and_is_counted(annotations: dict[str, str]) -> None:
    rejections = Rejections()
    assert pod_entries(pod(annotations=annotations), (8000,), SECTION, rejections) == {}
    assert rejections.counts["kubernetes"] == 1


def test_a_bad_pod_ip_is_counted() -> None:
    rejections = Rejections()
    assert pod_entries(pod(ip="10.0.0.999"), (8000,), SECTION, rejections) == {}
    assert rejections.counts["kubernetes"] == 1


def test_a_pool_is_its_selector_and_ports() -> None:
    spec = {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}, {"number": 8000}]}
    assert pool_of({"metadata": {"name": "llm"}, "spec": spec}, Rejections()) == Pool({"app": "llm"}, (8000,))


@pytest.mark.parametrize(
    "spec",
    [
        None,
        {"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]},
        {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": []},
        {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 70000}]},
        {"selector": {"matchLabels": {"app": 7}}, "targetPorts": [{"number": 8000}]},
    ],
)
def test_a_bad_pool_is_none_and_counted(spec: Any) -> None:
    rejections = Rejections()
    assert pool_of({"metadata": {"name": "llm"}, "spec": spec}, rejections) is None
    assert rejections.counts["kubernetes"] == 1


def test_an_endpointslice_is_its_ready_endpoints() -> None:
    endpoints = EndpointSlice.from_dict(
        {
            "addressType": "IPv4",
            "metadata": {"name": "s"},
            "endpoints": [
                {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "a"}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": False}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": True, "terminating": True}},
                {"addresses": ["10.0.0.4"], "conditions": {"ready": True}},
                {"addresses": ["not-an-ip"], "conditions": {"ready": True}},
            ],
            "ports": [{"port": 8000, "protocol": "TCP"}, {"port": 53, "protocol": "UDP"}],
        }
    )
    rejections = Rejections()
    section = KubernetesSection(service="llm")
    found = slice_entries(endpoints, section, rejections)
    assert {rid: e.url for rid, e in found.items()} == {
        "a": "http://10.0.0.1:8000",
        "10.0.0.4": "http://10.0.0.4:8000",
    }
    assert rejections.counts["kubernetes"] == 1


@pytest.mark.parametrize(
    "data", [{}, {"inference_pool": "a", "service": "b"}, {"service": "b", "api_server": "x"}]
)
def test_the_section_names_one_source(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        KubernetesSection.model_validate(data)
