"""A prompt's text as the ids it is routed on, for a model the gateway routes without its tokenizer
(`tokenizer: text`): the prompt's UTF-8 bytes, four to an id.

A predicted replica (approximate mode) is never asked for token ids: the gateway records what it
sent where, and reads what the replica reports reusing as a share of the replica's own prompt
(radix.reports), so any unit in which a prompt's prefix stays its prefix routes it. These ids are
such a unit, and cost a JSON dump and a copy where tokenizing costs about 2 µs a token
(docs/benchmarks.md, "Where a request's gateway CPU goes"). Four bytes of English are about one
token, so a prompt's length in them stands for its tokens in the wait model, whose prefill rate is
learned in the same unit.

A chat is its tools, then its messages, as one compact JSON list with sorted keys: a conversation's
next turn begins, byte for byte, with all of the last one but its closing bracket. KV events name
token blocks, which these ids never match, so a text-routed model's replicas are predicted whatever
the mode (gateway.gateway).
"""

from __future__ import annotations

import sys
from array import array

import orjson

from gateway.forward.request_view import RequestView

BYTES_PER_ID = 4
_NEEDS_BYTESWAP = sys.byteorder != "little"


def text_ids(view: RequestView, max_ids: int) -> array | None:
    """The prompt's first `max_ids` ids (little-endian uint32 words of its bytes; a last partial word
    left out); None when the view holds no text (token ids are routed as given)."""
    if view.text is not None:
        data = view.text.encode()
    elif view.messages is not None:
        parts = [{"tools": view.tools}, *view.messages] if view.tools else view.messages
        # Encodes whatever the body held: protocol.openai_api.parse_json bounds a body's nesting and
        # numbers so that it can be encoded again, and this list adds two levels at most.
        data = orjson.dumps(parts, option=orjson.OPT_SORT_KEYS)
    else:
        return None
    words = min(len(data) // BYTES_PER_ID, max_ids)
    ids = array("I")
    ids.frombytes(memoryview(data)[: words * BYTES_PER_ID])
    if _NEEDS_BYTESWAP:
        ids.byteswap()
    return ids
