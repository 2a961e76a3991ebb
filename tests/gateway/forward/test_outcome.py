"""What a replica reported of a request: its usage object, in its own unit, or a bundled worker's header."""

from __future__ import annotations

from gateway.forward.outcome import reported_usage
from protocol.openai_responses import CACHED_TOKENS_HEADER
from tests.support.replicas import replica

TAIL = b'data: {"usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}}\n\n'


def test_the_usage_object_is_read_before_the_header() -> None:
    assert reported_usage({CACHED_TOKENS_HEADER: "8"}, TAIL, replica("a")) == (40, 32)
    assert reported_usage({CACHED_TOKENS_HEADER: "8"}, b"{}", replica("a")) == (None, 8)


def test_only_a_bundled_workers_header_counts() -> None:
    assert reported_usage({CACHED_TOKENS_HEADER: "8"}, b"{}", replica("a", kind="openai")) == (None, None)


def test_a_count_too_large_to_be_one_is_no_count() -> None:
    huge = (
        b'{"usage": {"prompt_tokens": 99999999999999999999, "prompt_tokens_details": {"cached_tokens": 3}}}'
    )
    assert reported_usage({}, huge, replica("a", kind="openai")) == (None, 3)
