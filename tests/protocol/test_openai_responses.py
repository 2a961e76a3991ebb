"""Response shaping, without a server: OpenAI's bodies and SSE chunks for one choice and for n."""

from __future__ import annotations

import json

from protocol.openai_responses import Choice, ResponseShaper, sse, usage_json


def shaper(chat: bool, include_usage: bool = False) -> ResponseShaper:
    return ResponseShaper(chat=chat, model="m", created=123, decode_token=chr, include_usage=include_usage)


def test_completion_shapes() -> None:
    s = shaper(chat=False)
    usage = usage_json(5, 2, 4)
    assert usage == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    logprobs = [(104, -0.5, [(104, -0.5), (120, -1.0)]), (105, -0.25, [])]
    body = s.response([Choice("hi", "length", logprobs)], usage)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert (body["created"], body["model"], body["usage"]) == (123, "m", usage)
    assert body["choices"] == [
        {
            "index": 0,
            "text": "hi",
            "logprobs": {
                "tokens": ["h", "i"],
                "token_logprobs": [-0.5, -0.25],
                "top_logprobs": [{"h": -0.5, "x": -1.0}, {}],
                "text_offset": [0, 1],
            },
            "finish_reason": "length",
        }
    ]
    chunk = s.chunk("j", None, [(106, -0.1, None)])
    assert chunk["id"] == body["id"] and chunk["choices"][0]["logprobs"]["text_offset"] == [2]
    assert "usage" not in chunk


def test_chat_shapes() -> None:
    s = shaper(chat=True, include_usage=True)
    body = s.response([Choice("ok", "stop")], usage_json(1, 1, 0))
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "ok"}
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["finish_reason"] == "stop"
    opening = s.chunk("", None, role=True)
    assert opening["object"] == "chat.completion.chunk" and opening["usage"] is None
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert s.chunk("x", None)["choices"][0]["delta"] == {"content": "x"}
    assert s.chunk("", "stop")["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    lp = s.chunk("é", None, [(233, -0.3, [(233, -0.3)])])["choices"][0]["logprobs"]
    assert lp == {
        "content": [
            {
                "token": "é",
                "logprob": -0.3,
                "bytes": [195, 169],
                "top_logprobs": [{"token": "é", "logprob": -0.3, "bytes": [195, 169]}],
            }
        ]
    }
    last = s.usage_chunk(usage_json(3, 4, 2))
    assert last["choices"] == [] and last["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_sse_framing() -> None:
    frame = sse({"a": 1})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert json.loads(frame[6:]) == {"a": 1}


# -- n > 1 choices --------------------------------------------------------------------------------


def test_several_choices_in_index_order_with_their_own_text_offsets() -> None:
    s = shaper(chat=False)
    usage = usage_json(5, 6, 4)
    body = s.response(
        [
            Choice("ab", "length", [(97, -0.1, []), (98, -0.2, [])]),
            Choice("xyz", "stop", [(120, -0.3, []), (121, -0.4, []), (122, -0.5, [])]),
            Choice("", "stop", []),
        ],
        usage,
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["text"] for c in body["choices"]] == ["ab", "xyz", ""]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop", "stop"]
    assert [c["logprobs"]["text_offset"] for c in body["choices"]] == [[0, 1], [0, 1, 2], []]
    assert body["usage"] == usage


def test_streamed_choices_carry_their_index_and_offsets_run_per_choice() -> None:
    s = shaper(chat=False)
    offsets = [
        (index, s.chunk(text, None, [(ord(text), -0.1, None)], index=index)["choices"][0])
        for index, text in [(0, "a"), (1, "b"), (1, "c"), (0, "d"), (2, "e")]
    ]
    assert [(i, c["index"], c["logprobs"]["text_offset"]) for i, c in offsets] == [
        (0, 0, [0]),
        (1, 1, [0]),
        (1, 1, [1]),
        (0, 0, [1]),
        (2, 2, [0]),
    ]


def test_streamed_chat_choices_open_and_finish_each_with_their_index() -> None:
    s = shaper(chat=True)
    openings = [s.chunk("", None, role=True, index=i)["choices"][0] for i in range(3)]
    assert [(c["index"], c["delta"]) for c in openings] == [
        (i, {"role": "assistant", "content": ""}) for i in range(3)
    ]
    finish = s.chunk("", "length", index=2)["choices"][0]
    assert finish == {"index": 2, "delta": {}, "logprobs": None, "finish_reason": "length"}
