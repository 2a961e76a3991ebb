"""A simulated worker that counts words (`prefixgate worker --sim --sim-tokenizer words`): the word
tokenizer's ids are stable hashes, prefix-stable, in range; through a real worker process a text
prompt's usage counts its words, a repeat reuses its full blocks (of 16 or of 64 words), and every
answer names its worker."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.local_fleet import Child, LocalFleet, cli, spawn, stop, wait_ready
from bench.token_text import text_of
from prefixgate.cli import build_parser
from protocol.loopback_ports import free_port
from protocol.openai_api import ServedModel, parse_chat
from protocol.prompts import prompt_token_ids
from workers.completion_replies import WORKER_HEADER
from workers.sim.word_tokenizer import WordTokenizer
from workers.worker_cli import build_worker

VOCAB = 128256


def test_each_word_is_one_stable_id_in_range_and_whitespace_only_separates() -> None:
    tokenizer = WordTokenizer(VOCAB)
    ids = tokenizer.encode("kaba  dizo\tkaba\nmurela")
    assert len(ids) == 4 and ids[0] == ids[2] and len(set(ids)) == 3
    assert all(0 <= i < VOCAB for i in ids)
    assert tokenizer.encode("") == [] and tokenizer.encode(" \n ") == []
    # The same in another process: the hash is not Python's salted one.
    script = (
        "from workers.sim.word_tokenizer import WordTokenizer; "
        "print(WordTokenizer(128256).encode('kaba dizo'))"
    )
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == str(ids[:2])
    # bench.token_text' text of n ids is n words, and a prefix of ids gives a prefix of the word ids.
    workload = list(range(1000, 1400))
    assert len(tokenizer.encode(text_of(workload))) == 400
    assert tokenizer.encode(text_of(workload[:150])) == tokenizer.encode(text_of(workload))[:150]
    assert WordTokenizer(7).encode(text_of(workload)) and max(WordTokenizer(7).encode(text_of(workload))) < 7
    with pytest.raises(ValueError):
        WordTokenizer(0)


def test_chats_render_one_line_per_message_and_grow_by_prefix() -> None:
    tokenizer = WordTokenizer(VOCAB)
    served = ServedModel("m", VOCAB, 4096, 4096)
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "kaba dizo"}]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    later = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "x"},
    ]
    text = tokenizer.render_chat(first)
    assert text == "system: be brief\nuser: kaba dizo\nassistant:"
    longer = tokenizer.render_chat(later, add_generation_prompt=False)
    assert longer.startswith(tokenizer.render_chat(first, add_generation_prompt=False))
    ids = prompt_token_ids(parse_chat({"model": "m", "messages": later}, served), tokenizer)
    assert ids[:6] == tokenizer.encode(text)[:6] and len(ids) == len(tokenizer.encode(longer)) + 1


def test_the_flag_is_for_simulated_workers_only() -> None:
    with pytest.raises(SystemExit, match="--sim-tokenizer"):
        build_worker(build_parser().parse_args(["worker", "--sim-tokenizer", "words"]))
    args = build_parser().parse_args(["worker", "--sim", "--sim-tokenizer", "words", "--num-blocks", "8"])
    assert isinstance(build_worker(args).tokenizer, WordTokenizer)
    assert build_worker(build_parser().parse_args(["worker", "--sim", "--num-blocks", "8"])).tokenizer is None


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Child]]:
    """Two word-counting workers as processes, with KV blocks of 16 and of 64 words."""
    workdir: Path = tmp_path_factory.mktemp("words")
    children = {}
    for block in (16, 64):
        port = free_port()
        command = cli("worker", "--sim", "--sim-profile", "h100-8b", "--sim-tokenizer", "words")
        command += [
            "--block-size",
            str(block),
            "--num-blocks",
            "64",
            "--port",
            str(port),
            "--id",
            f"b{block}",
        ]
        children[block] = spawn(f"worker-b{block}", command, f"http://127.0.0.1:{port}", workdir)
    try:
        wait_ready(LocalFleet(list(children.values()), None))
        yield children
    finally:
        stop(list(children.values()))


@pytest.mark.parametrize("block", [16, 64])
def test_a_text_prompt_counts_its_words_and_a_repeat_reuses_its_full_blocks(
    workers: dict[int, Child], block: int
) -> None:
    url = workers[block].url
    assert httpx.get(f"{url}/health").json()["block_size"] == block
    prompt = text_of(range(5000, 5300))  # 300 words, which SmolLM2 reads as about 850 tokens
    body = {"model": "Llama-3.1-8B-Instruct", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    first = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    again = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert first.status_code == again.status_code == 200
    usage, repeat = first.json()["usage"], again.json()["usage"]
    assert usage["prompt_tokens"] == repeat["prompt_tokens"] == 300
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    # Every full block of the prompt but the one holding its last word, which is always computed.
    assert repeat["prompt_tokens_details"]["cached_tokens"] == (299 // block) * block > 0
    assert first.headers[WORKER_HEADER] == again.headers[WORKER_HEADER] == f"b{block}"
    stream = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=30)
    assert stream.headers[WORKER_HEADER] == f"b{block}" and stream.text.rstrip().endswith("[DONE]")
