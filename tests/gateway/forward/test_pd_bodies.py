"""What a paired attempt adds to the bodies it sends: vLLM's prefill request and the parameters its answer
hands on, SGLang's bootstrap fields, our own prefill field; every other field as the client sent it."""

from __future__ import annotations

import copy
import random

import pytest

from gateway.forward.pd_bodies import (
    VLLM_PREFILL_PARAMS,
    bundled_fields,
    sglang_fields,
    vllm_prefill_body,
    vllm_transfer_params,
)
from protocol.transfer_auth import check_grant
from tests.support.pd import REMOTE_DECODE

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 200,
    "max_completion_tokens": 200,
    "stream": True,
    "stream_options": {"include_usage": True},
    "min_tokens": 5,
    "temperature": 0.3,
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
    "vendor_field": {"x": [1, 2]},
}


def test_a_vllm_prefill_instance_gets_one_unstreamed_token_and_the_remote_decode_ask() -> None:
    sent = copy.deepcopy(CHAT)
    assert vllm_prefill_body(sent) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "stream": False,
        "temperature": 0.3,
        "tools": CHAT["tools"],
        "vendor_field": {"x": [1, 2]},
        "kv_transfer_params": REMOTE_DECODE,
    }
    assert sent == CHAT, "the client's body is left as it was, for the decode instance"


def test_max_completion_tokens_is_set_only_when_the_client_gave_it() -> None:
    body = vllm_prefill_body({"model": "m", "prompt": "hi"})
    assert "max_completion_tokens" not in body and body["max_tokens"] == 1 and body["stream"] is False
    body["kv_transfer_params"]["remote_host"] = "changed"
    assert VLLM_PREFILL_PARAMS["remote_host"] is None, "each request gets its own copy"


@pytest.mark.parametrize(
    ("answer", "params"),
    [
        (b'{"id": "c", "kv_transfer_params": {"remote_block_ids": [1, 2], "remote_engine_id": "e"}}',
         {"remote_block_ids": [1, 2], "remote_engine_id": "e"}),
        (b'{"id": "c"}', None),
        (b'{"id": "c", "kv_transfer_params": null}', None),
        (b'{"id": "c", "kv_transfer_params": {}}', None),
        (b'{"id": "c", "kv_transfer_params": [1]}', None),
        (b"[1]", None),
        (b"not json", None),
    ],
)  # fmt: skip
def test_the_kv_transfer_params_of_a_vllm_prefill_answer(answer: bytes, params: dict | None) -> None:
    assert vllm_transfer_params(answer) == params


def test_sglang_bootstrap_fields_name_the_prefill_host_and_port_and_a_room() -> None:
    fields = sglang_fields({"model": "m"}, "http://10.0.0.7:30000", 8998, random.Random(0))
    assert fields["bootstrap_host"] == "10.0.0.7" and fields["bootstrap_port"] == 8998
    assert isinstance(fields["bootstrap_room"], int) and 0 <= fields["bootstrap_room"] < 2**63
    ipv6 = sglang_fields({"model": "m"}, "http://[fd00::7]:30000", 9000, random.Random(0))
    assert ipv6["bootstrap_host"] == "[fd00::7]"


class Highest(random.Random):
    """Draws the highest room allowed: the edge of what SGLang can number."""

    def randrange(self, stop: int) -> int:  # type: ignore[override]
        return stop - 1


@pytest.mark.parametrize(
    ("body", "sequences"),
    [
        ({"prompt": "one"}, 1),
        ({"prompt": [1, 2, 3]}, 1),  # token ids: one prompt
        ({"messages": [], "n": 4}, 4),
        ({"prompt": ["a", "b", "c"], "n": 2}, 6),
        ({"prompt": [[1, 2], [3]]}, 2),
    ],
)
def test_a_room_leaves_room_for_every_sequence_sglang_numbers_from_it(body: dict, sequences: int) -> None:
    room = sglang_fields(body, "http://h:1", 1, Highest())["bootstrap_room"]
    assert room + sequences - 1 == 2**63 - 1


def test_our_decode_worker_is_named_its_prefill_worker_in_a_signed_grant() -> None:
    secret = b"a-test-kv-transfer-secret"
    (field,) = bundled_fields("http://10.0.0.5:8101", secret).values()
    url, transfer_id, _ = check_grant(secret, field) or ("", "", 0)
    assert url == "http://10.0.0.5:8101" and len(transfer_id) == 32
    assert check_grant(b"another-fleet's-secret", field) is None
    assert bundled_fields("http://10.0.0.5:8101", secret)["prefixgate_prefill"]["transfer"] != transfer_id
