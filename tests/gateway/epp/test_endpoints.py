"""Replicas as Envoy names them."""

from __future__ import annotations

from gateway.epp.endpoints import destination, endpoint_of


def test_a_replica_is_an_address_and_a_port() -> None:
    assert endpoint_of("http://10.0.0.5:8000") == "10.0.0.5:8000"
    assert endpoint_of("http://10.0.0.5:8000/v1") == "10.0.0.5:8000"
    assert endpoint_of("http://10.0.0.5") == "10.0.0.5:80"
    assert endpoint_of("https://10.0.0.5") == "10.0.0.5:443"
    assert endpoint_of("http://[2600:4040::1]:80") == "[2600:4040::1]:80"


def test_a_replica_named_by_host_name_or_with_a_bad_port_is_no_endpoint() -> None:
    for url in ("http://worker-0:8000", "http://localhost:8000", "http://10.0.0.5:99999", "not a url", ""):
        assert endpoint_of(url) is None, url


def test_the_destination_lists_the_first_choice_first() -> None:
    assert destination(["10.0.0.2:80", "10.0.0.1:80"]) == "10.0.0.2:80,10.0.0.1:80"
