"""What the gateway reads of the server-sent events it relays (gateway.forward.sse_events), in-process.

A relayed stream reaches the client as the replica sent it; the gateway only looks at it: for its
first event that carries output (OutputWatch, carries_output), for the id a Responses stream announces
(ResponseIdScan, response_id_in), for the usage numbers in its tail (usage_numbers), and, when the
gateway asked for a usage chunk the client did not, for that one event, which it leaves out
(UsageStrip). Replicas write events in chunks cut anywhere, with LF, CRLF or CR line ends, comments
and `data: [DONE]`: each reader is checked at every split point of a stream, and under arbitrary
chunkings, to find the same events and to pass every byte it does not leave out as it came.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.forward.sse_events import (
    MAX_EVENT_BYTES,
    RESPONSE_ID_SCAN,
    EventTooLarge,
    OutputWatch,
    ResponseIdScan,
    UsageStrip,
    carries_output,
    response_id_in,
    usage_numbers,
)
from gateway.forward.upstream import UpstreamError

ENDINGS = {"lf": b"\n", "crlf": b"\r\n", "cr": b"\r"}
PROMPT_TOKENS, CACHED_TOKENS = 1234, 1024


def event(payload: Any, nl: bytes = b"\n") -> bytes:
    data = payload if isinstance(payload, bytes) else orjson.dumps(payload)
    return b"data: " + data + nl + nl


def comment(text: bytes, nl: bytes = b"\n") -> bytes:
    return b": " + text + nl + nl


def chunk(**fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "m", **fields}


def delta(finish_reason: str | None = None, **fields: Any) -> dict[str, Any]:
    return chunk(choices=[{"index": 0, "delta": fields, "finish_reason": finish_reason}])


USAGE = {
    "prompt_tokens": PROMPT_TOKENS,
    "completion_tokens": 2,
    "total_tokens": PROMPT_TOKENS + 2,
    "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
}
ROLE = delta(role="assistant", content="")
# The usage-only event a client gets when it asks for usage (stream_options.include_usage).
USAGE_ONLY = chunk(choices=[], usage=USAGE)


def chat_events(nl: bytes) -> list[bytes]:
    """A chat stream as a replica sends it when asked for usage, one event per item."""
    return [
        comment(b"ping", nl),
        event(ROLE, nl),
        event(delta(content="Hel"), nl),
        event(delta(content="lo"), nl),
        event(delta("stop"), nl),
        event(USAGE_ONLY, nl),
        b"data: [DONE]" + nl + nl,
    ]


def responses_events(nl: bytes, response_id: str = "resp_42") -> list[bytes]:
    response = {"id": response_id, "object": "response", "status": "in_progress", "output": []}
    return [
        event({"type": "response.created", "sequence_number": 0, "response": response}, nl),
        event({"type": "response.in_progress", "sequence_number": 1, "response": response}, nl),
        event({"type": "response.output_text.delta", "sequence_number": 2, "delta": "Hi"}, nl),
    ]


def ends_at(events: list[bytes], index: int, nl: bytes) -> int:
    """Where the reader may first see events[index] whole: after its blank line, or, in a CRLF stream,
    at its last CR (a CR that ends what has arrived ends its line at once, as a browser reads it)."""
    end = len(b"".join(events[: index + 1]))
    return end - 1 if nl == b"\r\n" else end


def split_inside_a_crlf(data: bytes, cuts: list[int]) -> bool:
    return any(data[k - 1 : k + 1] == b"\r\n" for k in cuts if 0 < k < len(data))


def as_read(data: bytes) -> bytes:
    """The stream as an SSE parser reads it: every line end one LF, and blank lines between events one."""
    return re.sub(rb"\n{3,}", b"\n\n", re.sub(rb"\r\n|\r", b"\n", data))


def pieces(data: bytes, cuts: list[int]) -> list[bytes]:
    bounds = [0, *sorted(cuts), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def stripped(data: bytes, cuts: list[int]) -> bytes:
    strip = UsageStrip()
    return b"".join(strip.feed(piece) for piece in pieces(data, cuts)) + strip.flush()


# -- the first output --------------------------------------------------------------------------------

PREAMBLES = {
    "a comment": comment(b"keep-alive"),
    "an empty event": b"\n\n",
    "an event without data": b"event: ping\nid: 3\n\n",
    "a role": event(delta(role="assistant")),
    "a role and empty content": event(ROLE),
    "empty reasoning": event(delta(reasoning_content="", tool_calls=[])),
    "an empty completion text": event(chunk(choices=[{"index": 0, "text": "", "finish_reason": None}])),
    "a response's creation": event({"type": "response.created", "response": {"id": "resp_1"}}),
    "a response in progress": event({"type": "response.in_progress", "response": {"id": "resp_1"}}),
    "an output item added": event({"type": "response.output_item.added", "item": {"type": "message"}}),
    "a content part added": event({"type": "response.content_part.added", "part": {"text": ""}}),
    "a role over two data lines": (
        b'data: {"choices": [{"index": 0,\ndata: "delta": {"role": "assistant"}}]}\n\n'
    ),
}
OUTPUTS = {
    "a token": event(delta(content="Hi")),
    "a tool call": event(delta(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": ""}}])),
    "a legacy function call": event(delta(function_call={"name": "f"})),
    "reasoning": event(delta(reasoning_content="hmm")),
    "reasoning by its other name": event(delta(reasoning="hmm")),
    "a refusal": event(delta(refusal="no")),
    "a finish": event(delta("length")),
    "a completion's text": event(chunk(choices=[{"index": 0, "text": "Once", "finish_reason": None}])),
    "a second choice's token": event(
        chunk(choices=[{"index": 0, "delta": {}}, {"index": 1, "delta": {"content": "x"}}])
    ),
    "a choice without a delta": event(chunk(choices=[{"index": 0}])),
    "a choice that is not an object": event(chunk(choices=["x"])),
    "a usage chunk": event(USAGE_ONLY),
    "usage beside a role": event({**ROLE, "usage": USAGE}),
    "an error": event({"error": {"message": "overloaded", "type": "server_error"}}),
    "a Responses delta": event({"type": "response.output_text.delta", "delta": "Hi"}),
    "a Responses failure": event({"type": "response.failed", "response": {"id": "resp_1"}}),
    "the end of the stream": b"data: [DONE]\n\n",
    "text that is not JSON": b"data: upstream exploded\n\n",
    "JSON that is not an object": b"data: 42\n\n",
    "a token over two data lines": b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "x"}}]}\n\n',
    "a token without the space after data:": b'data:{"choices": [{"delta": {"content": "x"}}]}\n\n',
}


@pytest.mark.parametrize("name", PREAMBLES)
def test_an_event_that_only_says_the_stream_started_is_not_output(name: str) -> None:
    data = PREAMBLES[name]
    assert not carries_output(data)
    assert not OutputWatch().feed(data)
    assert not OutputWatch().feed(data.replace(b"\n", b"\r\n"))


@pytest.mark.parametrize("name", OUTPUTS)
def test_an_event_that_carries_anything_more_is_output(name: str) -> None:
    data = OUTPUTS[name]
    assert carries_output(data)
    assert OutputWatch().feed(data)
    watch = OutputWatch()
    assert not watch.feed(PREAMBLES["a comment"] + PREAMBLES["a role"])
    assert watch.feed(data.replace(b"\n", b"\r"))


def test_only_whole_events_are_read_for_output() -> None:
    token = OUTPUTS["a token"]
    assert not carries_output(token[:-1])
    watch = OutputWatch()
    assert not watch.feed(token[:-1])
    assert watch.feed(token[-1:])


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_stream_may_go_to_the_client_once_its_first_output_has_arrived_at_any_split(ending: str) -> None:
    nl = ENDINGS[ending]
    events = chat_events(nl)
    data = b"".join(events)
    first_output = ends_at(events, 2, nl)
    for cut in range(len(data) + 1):
        watch = OutputWatch()
        head = watch.feed(data[:cut])
        assert head == (cut >= first_output), (ending, cut)
        if not head:
            assert watch.feed(data[cut:])


def test_a_stream_that_carries_no_output_for_max_event_bytes_is_relayed_as_it_is() -> None:
    keep_alive = comment(b"k" * (64 * 1024))
    watch = OutputWatch()
    fed = 0
    while fed + len(keep_alive) <= MAX_EVENT_BYTES:
        assert not watch.feed(keep_alive)
        fed += len(keep_alive)
    assert watch.feed(keep_alive)


@pytest.mark.parametrize("reader", [OutputWatch, UsageStrip])
def test_an_event_that_never_ends_is_the_replicas_failure(reader: type[OutputWatch | UsageStrip]) -> None:
    watch = reader()
    watch.feed(b"data: " + b"z" * (MAX_EVENT_BYTES - 6))  # the bound itself is held
    with pytest.raises(EventTooLarge) as too_large:
        watch.feed(b"z")
    assert isinstance(too_large.value, UpstreamError) and too_large.value.kind == "event_too_large"


@pytest.mark.parametrize("kind", [[], {"name": "response.created"}])
def test_an_event_whose_type_is_not_a_string_is_output_not_an_error(kind: Any) -> None:
    data = event({"type": kind, "delta": "x"})
    assert carries_output(data)
    assert OutputWatch().feed(data)


# -- the usage chunk the client did not ask for ------------------------------------------------------


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_usage_only_event_is_left_out_and_every_other_byte_passes_whatever_the_split(ending: str) -> None:
    nl = ENDINGS[ending]
    events = chat_events(nl)
    data = b"".join(events)
    kept = b"".join(e for e in events if b'"usage"' not in e)
    assert len(kept) == len(data) - len(events[5])
    for cut in range(len(data) + 1):
        out = stripped(data, [cut])
        if split_inside_a_crlf(data, [cut]):
            # A CR that ended an event may leave its LF to the next one: a blank line, the same events.
            assert as_read(out) == as_read(kept), cut
        else:
            assert out == kept, cut


def test_a_usage_event_that_comes_with_choices_or_is_no_usage_object_is_kept() -> None:
    events = [
        event({**delta(content="Hi"), "usage": USAGE}),  # vLLM's continuous usage stats
        event(chunk(choices=[], usage=None)),  # OpenAI's `usage: null` on every chunk but the last
        event(chunk(choices=[], prompt_filter_results=[{"prompt_index": 0}])),  # Azure's first chunk
        event(delta(content='"usage": {"prompt_tokens": 1}, "choices": []')),  # text that only reads so
        b"data: [DONE]\n\n",
    ]
    data = b"".join(events)
    for cut in range(len(data) + 1):
        assert stripped(data, [cut]) == data, cut


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_stream_without_a_usage_only_event_passes_byte_for_byte_at_every_split(ending: str) -> None:
    events = [e for e in chat_events(ENDINGS[ending]) if b'"usage"' not in e]
    data = b"".join(events)
    for cut in range(len(data) + 1):
        strip = UsageStrip()
        head = strip.feed(data[:cut])
        assert data.startswith(head)
        assert head + strip.feed(data[cut:]) + strip.flush() == data, cut


def test_what_is_held_of_an_unfinished_event_at_the_end_is_given_back_as_it_came() -> None:
    strip = UsageStrip()
    unfinished = event(USAGE_ONLY)[:-1]
    assert strip.feed(event(ROLE) + unfinished) == event(ROLE)
    assert strip.flush() == unfinished
    assert strip.flush() == b""


@settings(max_examples=150, deadline=None)
@given(
    ending=st.sampled_from(sorted(ENDINGS)),
    fractions=st.lists(st.floats(0, 1), max_size=8),
)
def test_any_chunking_leaves_out_the_usage_event_alone(ending: str, fractions: list[float]) -> None:
    nl = ENDINGS[ending]
    events = chat_events(nl)
    data = b"".join(events)
    cuts = [round(f * len(data)) for f in fractions]
    kept = b"".join(e for e in events if e != events[5])
    out = stripped(data, cuts)
    if split_inside_a_crlf(data, cuts):
        assert as_read(out) == as_read(kept)
    else:
        assert out == kept


# -- the id a Responses stream announces -------------------------------------------------------------


def test_the_response_id_is_read_from_the_response_an_event_carries() -> None:
    assert response_id_in(responses_events(b"\n")[0]) == "resp_42"
    assert response_id_in(responses_events(b"\r\n", "resp_x")[1]) == "resp_x"
    for data in (
        responses_events(b"\n")[2],
        event({"type": "response.created", "response": {"id": ""}}),
        event({"type": "response.created", "response": {"id": 42}}),
        event({"type": "response.created", "response": "resp_1"}),
        event({"type": "response.created", "id": "resp_1"}),
        event(["resp_1"]),
        b"data: [DONE]\n\n",
        comment(b'{"response": {"id": "resp_1"}}'),
        b"data: {broken\n\n",
    ):
        assert response_id_in(data) is None, data


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_response_id_is_found_once_whatever_the_split(ending: str) -> None:
    nl = ENDINGS[ending]
    events = responses_events(nl)
    data = b"".join(events)
    created = ends_at(events, 0, nl)
    for cut in range(len(data) + 1):
        scan = ResponseIdScan()
        found = [scan.feed(data[:cut]), scan.feed(data[cut:]), scan.feed(data)]
        assert found == (["resp_42", None, None] if cut >= created else [None, "resp_42", None]), cut
        assert scan.done


@settings(max_examples=100, deadline=None)
@given(fractions=st.lists(st.floats(0, 1), max_size=10))
def test_any_chunking_of_a_responses_stream_finds_its_id_once(fractions: list[float]) -> None:
    data = b"".join(responses_events(b"\r\n"))
    scan = ResponseIdScan()
    found = [scan.feed(piece) for piece in pieces(data, [round(f * len(data)) for f in fractions])]
    assert [f for f in found if f is not None] == ["resp_42"] and scan.done


def test_the_scan_reads_a_streams_first_response_id_scan_bytes_and_no_more() -> None:
    filler = comment(b"p" * (RESPONSE_ID_SCAN - 4))
    assert len(filler) == RESPONSE_ID_SCAN
    created = responses_events(b"\n")[0]
    within = ResponseIdScan()
    assert within.feed(filler) is None and not within.done
    assert within.feed(created) == "resp_42"
    past = ResponseIdScan()
    assert past.feed(filler + b":\n\n") is None and past.done
    assert past.feed(created) is None


def test_a_stream_that_names_no_response_is_scanned_without_a_result() -> None:
    scan = ResponseIdScan()
    for data in chat_events(b"\n"):
        assert scan.feed(data) is None
    assert not scan.done


# -- the usage numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_usage_numbers_are_read_from_a_streams_tail(ending: str) -> None:
    tail = b"".join(chat_events(ENDINGS[ending]))[-300:]
    assert usage_numbers(tail) == (PROMPT_TOKENS, CACHED_TOKENS)


def test_the_usage_numbers_of_a_whole_response_are_read_at_any_spacing() -> None:
    compact = orjson.dumps({"choices": [], "usage": USAGE})
    spaced = compact.replace(b":", b" :  ").replace(b",", b", ")
    assert usage_numbers(compact) == usage_numbers(spaced) == (PROMPT_TOKENS, CACHED_TOKENS)


def test_usage_without_details_has_no_cached_tokens_and_no_usage_has_no_numbers() -> None:
    assert usage_numbers(orjson.dumps({"usage": {"prompt_tokens": 7, "completion_tokens": 1}})) == (7, None)
    assert usage_numbers(b"".join(e for e in chat_events(b"\n") if b'"usage"' not in e)) == (None, None)
    assert usage_numbers(b"") == (None, None)


def test_the_last_usage_object_gives_the_numbers() -> None:
    first = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 3}}
    last = {"prompt_tokens": 11, "prompt_tokens_details": {"cached_tokens": 8}}
    tail = event(chunk(choices=[], usage=first)) + event(chunk(choices=[], usage=last))
    assert usage_numbers(tail) == (last["prompt_tokens"], last["prompt_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize("value", [-5, "12", None, [3], {"n": 3}, True])
def test_usage_numbers_that_are_not_counts_are_not_read(value: Any) -> None:
    usage = {"prompt_tokens": value, "prompt_tokens_details": {"cached_tokens": value}}
    tail = orjson.dumps({"usage": usage})
    assert usage_numbers(tail) == (None, None)


def test_an_absurd_count_is_read_as_the_number_it_is_for_the_caller_to_bound() -> None:
    huge = "9" * 600
    tail = b'{"usage": {"prompt_tokens": %s, "prompt_tokens_details": {"cached_tokens": %s}}}' % (
        huge.encode(),
        huge.encode(),
    )
    assert usage_numbers(tail) == (int(huge), int(huge))


def test_usage_quoted_in_the_output_text_is_not_read() -> None:
    quoted = event(delta(content='{"prompt_tokens": 99, "cached_tokens": 98}'))
    assert usage_numbers(quoted) == (None, None)
    assert usage_numbers(event(USAGE_ONLY) + quoted) == (PROMPT_TOKENS, CACHED_TOKENS)


def test_the_cached_tokens_are_those_of_the_last_usage_object() -> None:
    earlier = {"prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 3}}
    last = {"prompt_tokens": 11}
    tail = event(chunk(choices=[], usage=earlier)) + event(chunk(choices=[], usage=last))
    assert usage_numbers(tail) == (last["prompt_tokens"], None)
