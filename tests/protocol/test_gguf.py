"""protocol.gguf: the metadata reader, and tokenizers built from a GGUF equal to the ones transformers
builds from the same file, token for token (and, for SmolLM2, file for file)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from protocol.gguf import GgufError, read_metadata, tokenizer_from_gguf
from protocol.models import default_gguf_path
from protocol.tokenizer import Tokenizer
from workers.engine.loader import convert_gguf

pytestmark = pytest.mark.real

# GGUF value types, by the spec's numbering.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?"}
_FORMATS |= {U64: "Q", I64: "q", F64: "d"}

CORPUS = [
    "",
    "Hello world",
    " Hello  world ",
    "   leading and trailing spaces   ",
    "Ünïcödé àccents: café, naïve, Straße, Ærøskøbing",
    "中文分词测试，日本語のテキスト、한국어 문장",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flag 🇫🇷 and ☃",
    'def f(x):\n    return {"k": x ** 2}  # square\n\n\tindented\twith tabs\n',
    "numbers 1234567890 3.14159 1e-9 -42 2024-06-01",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more<repo_name>x <filename>y",
    "\n\n\n   \n\r\n\t \n",
    "no\u00a0break\u200bzero width\u2028line sep",
    "contractions: I'm, we'll, they've, it's, you're, he'd",
    "bytes \x00\x01\x1b\x7f end",
]


def gguf_bytes(pairs: list[tuple[str, int, Any]], version: int = 3) -> bytes:
    """A GGUF holding these (key, type, value) metadata pairs and no tensors; an array's value is
    (item type, items)."""

    def string(text: str) -> bytes:
        raw = text.encode()
        return struct.pack("<Q", len(raw)) + raw

    def value(kind: int, item: Any) -> bytes:
        if kind == STRING:
            return string(item)
        if kind == ARRAY:
            item_kind, items = item
            return struct.pack("<IQ", item_kind, len(items)) + b"".join(value(item_kind, i) for i in items)
        return struct.pack("<" + _FORMATS[kind], item)

    body = b"".join(string(key) + struct.pack("<I", kind) + value(kind, item) for key, kind, item in pairs)
    return b"GGUF" + struct.pack("<IQQ", version, 0, len(pairs)) + body


@pytest.fixture(scope="module")
def smol_meta() -> dict[str, Any]:
    return read_metadata(default_gguf_path())


@pytest.fixture(scope="module")
def converted() -> Path:
    """The worker's conversion of the default GGUF (transformers wrote its tokenizer files)."""
    return convert_gguf(default_gguf_path())


def test_every_value_type_reads_back(tmp_path: Path) -> None:
    pairs = [
        ("u8", U8, 255),
        ("i8", I8, -128),
        ("u16", U16, 65535),
        ("i16", I16, -32768),
        ("u32", U32, 2**32 - 1),
        ("i32", I32, -(2**31)),
        ("f32", F32, 0.5),
        ("bool", BOOL, True),
        ("string", STRING, "héllo ☃"),
        ("empty", STRING, ""),
        ("u64", U64, 2**64 - 1),
        ("i64", I64, -(2**63)),
        ("f64", F64, 1e-300),
        ("ints", ARRAY, (I32, [3, -4, 5])),
        ("floats", ARRAY, (F64, [0.25, -1.5])),
        ("strings", ARRAY, (STRING, ["a", "", "Ġb c", "<|x|>"])),
        ("nested", ARRAY, (ARRAY, [(U8, [1, 2]), (STRING, ["z"])])),
        ("none", ARRAY, (U32, [])),
    ]
    file = tmp_path / "all.gguf"
    # What follows the metadata (tensor infos, weights) is never read: garbage there changes nothing.
    file.write_bytes(gguf_bytes(pairs) + b"\xff" * 64)
    meta = read_metadata(file)
    assert list(meta) == [key for key, _, _ in pairs]
    assert meta["nested"] == [[1, 2], ["z"]]
    assert meta["strings"] == ["a", "", "Ġb c", "<|x|>"]
    assert {k: v for k, v in meta.items() if k not in ("nested", "ints", "floats", "strings", "none")} == {
        key: item for key, kind, item in pairs if kind != ARRAY
    }
    assert (meta["ints"], meta["floats"], meta["none"]) == ([3, -4, 5], [0.25, -1.5], [])


def test_files_it_cannot_read_are_refused_by_name(tmp_path: Path) -> None:
    cases = {
        "empty.gguf": b"",
        "magic.gguf": b"GGML" + bytes(20),
        "v1.gguf": gguf_bytes([], version=1),
        "cut.gguf": gguf_bytes([("s", STRING, "long enough")])[:-3],
        "cut-array.gguf": gguf_bytes([("a", ARRAY, (U64, [1, 2, 3]))])[:-5],
        "huge-array.gguf": b"GGUF"
        + struct.pack("<IQQQ", 3, 0, 1, 1)
        + b"a"
        + struct.pack("<IIQ", 9, 4, 2**62),
        "not-utf8.gguf": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 2) + b"\xff\xfe",
        "kind.gguf": b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<I", 99),
    }
    messages = {}
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(GgufError) as info:
            read_metadata(tmp_path / name)
        assert name in str(info.value)
        messages[name] = str(info.value)
    assert "version 1" in messages["v1.gguf"] and "unknown type 99" in messages["kind.gguf"]
    assert "not UTF-8" in messages["not-utf8.gguf"]


def test_the_default_files_metadata_is_what_the_gguf_package_reads(smol_meta: dict[str, Any]) -> None:
    gguf = pytest.importorskip("gguf")
    fields = gguf.GGUFReader(default_gguf_path()).fields
    # Less the reader's own entries for the header (GGUF.version, ...).
    reference = {name: field.contents() for name, field in fields.items() if not name.startswith("GGUF.")}
    assert smol_meta == reference
    assert smol_meta["tokenizer.ggml.model"] == "gpt2" and len(smol_meta["tokenizer.ggml.tokens"]) == 49152


def test_smollm2s_tokenizer_is_the_converted_one_file_for_file(converted: Path) -> None:
    backend, template, specials = tokenizer_from_gguf(default_gguf_path())
    assert json.loads(backend.to_str()) == json.loads((converted / "tokenizer.json").read_text())
    assert template == (converted / "chat_template.jinja").read_text()
    config = json.loads((converted / "tokenizer_config.json").read_text())
    assert specials == {name: config[name] for name in ("bos_token", "eos_token", "unk_token", "pad_token")}


def assert_same_tokenizer(ours: Tokenizer, theirs: PreTrainedTokenizerBase, corpus: list[str]) -> None:
    for text in corpus:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert ours.backend.encode(text).ids == theirs.encode(text), text  # the post-processor too
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)


def test_smollm2s_ids_and_text_equal_transformers_on_a_varied_corpus(converted: Path) -> None:
    ours = Tokenizer.from_gguf(default_gguf_path())
    theirs = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    assert_same_tokenizer(ours, theirs, CORPUS)
    assert ours.decode(ours.encode("".join(CORPUS)), skip_special_tokens=False) == "".join(CORPUS)


def variant_pairs(meta: dict[str, Any], tokenizer_model: str = "gpt2", pre: str = "gpt-2") -> list[tuple]:
    """SmolLM2's vocabulary with the cases it lacks: a user-defined token, a control token spelled
    outside the byte alphabet (llama.cpp's mislabel) that is also the unknown token, a user-defined
    token outside the alphabet, and BOS and EOS added to every encoding."""
    tokens = [*meta["tokenizer.ggml.tokens"], "<think>", "<|bad control|>", "naïve token"]
    types = [*meta["tokenizer.ggml.token_type"], 4, 3, 4]
    return [
        ("general.architecture", STRING, "llama"),
        ("llama.block_count", U32, 1),
        ("llama.context_length", U32, 64),
        ("llama.embedding_length", U32, 8),
        ("llama.feed_forward_length", U32, 16),
        ("llama.attention.head_count", U32, 2),
        ("llama.attention.head_count_kv", U32, 1),
        ("tokenizer.ggml.model", STRING, tokenizer_model),
        ("tokenizer.ggml.pre", STRING, pre),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, types)),
        ("tokenizer.ggml.merges", ARRAY, (STRING, meta["tokenizer.ggml.merges"])),
        ("tokenizer.ggml.bos_token_id", U32, 1),
        ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.ggml.unknown_token_id", U32, len(tokens) - 2),
        ("tokenizer.ggml.add_bos_token", BOOL, True),
        ("tokenizer.ggml.add_eos_token", BOOL, True),
    ]


def test_a_gpt2_vocabulary_with_added_tokens_equals_transformers(
    tmp_path: Path, smol_meta: dict[str, Any]
) -> None:
    (tmp_path / "variant.gguf").write_bytes(gguf_bytes(variant_pairs(smol_meta)))
    ours = Tokenizer.from_gguf(tmp_path / "variant.gguf")
    theirs = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="variant.gguf", local_files_only=True)
    assert json.loads(ours.backend.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    extra = ["I <think>hard</think> about <|bad control|> and a naïve token", "<think><think>"]
    assert_same_tokenizer(ours, theirs, CORPUS + extra)
    assert ours.chat_template is None and ours.special_tokens["unk_token"] == "<|bad control|>"
    assert ours.backend.encode("x").ids[0] == 1 and ours.backend.encode("x").ids[-1] == 2


@pytest.mark.parametrize(
    ("model", "pre", "message"),
    [
        ("llama", "default", "'llama' tokenizer.*HF tokenizer folder"),
        ("t5", "default", "'t5' tokenizer.*HF tokenizer folder"),
        ("gpt2", "llama-bpe", "pre-tokenizer 'llama-bpe' is not supported.*HF tokenizer folder"),
        ("gpt2", "qwen2", "pre-tokenizer 'qwen2' is not supported"),
    ],
)
def test_tokenizers_it_cannot_rebuild_are_refused_by_name(
    tmp_path: Path, smol_meta: dict[str, Any], model: str, pre: str, message: str
) -> None:
    (tmp_path / "other.gguf").write_bytes(gguf_bytes(variant_pairs(smol_meta, model, pre)))
    with pytest.raises(GgufError, match=message):
        tokenizer_from_gguf(tmp_path / "other.gguf")
