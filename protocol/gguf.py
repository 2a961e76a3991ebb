"""The tokenizer a GGUF file describes, read from its metadata alone: no torch, no transformers.

A GGUF carries no tokenizer.json; llama.cpp stores the vocabulary, the merges, each token's type and
the special token ids as metadata key/value pairs at the front of the file, before the tensor table.
The gateway needs exactly that and nothing of the hundreds of MB of weights behind it, so this module
parses the header with `struct` over a memory map (pages past the metadata are never touched) and
builds the HF `tokenizers` object that transformers 5 builds from the same file. Building the same
one matters: the workers tokenize with the folder that transformers converted, and a prompt must
become the same ids, hence the same block hashes, on both sides.

Only byte-level BPE (`tokenizer.ggml.model == "gpt2"`, SmolLM2's kind) is rebuilt, and only for the
pre-tokenizer types whose splitting is verified against transformers; anything else is refused by
name rather than tokenized almost right, because "almost" means silently wrong cache routing.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

GGUF_MAGIC = b"GGUF"
# v1 counted in 32 bits; llama.cpp has written v2/v3 (64-bit counts) since 2023.
SUPPORTED_VERSIONS = (2, 3)

# Metadata value types (the GGUF spec's numbering) that have a fixed width.
_SCALAR_FORMATS = {
    0: "B",  # uint8
    1: "b",  # int8
    2: "H",  # uint16
    3: "h",  # int16
    4: "I",  # uint32
    5: "i",  # int32
    6: "f",  # float32
    7: "?",  # bool
    10: "Q",  # uint64
    11: "q",  # int64
    12: "d",  # float64
}
_STRING, _ARRAY = 8, 9

# llama.cpp's token types (tokenizer.ggml.token_type).
CONTROL, USER_DEFINED = 3, 4

SPECIAL_TOKEN_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class GgufError(ValueError):
    """The file is not a GGUF this module can read, or describes a tokenizer it cannot rebuild."""


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The file's metadata key/value pairs (arrays as lists), stopping before the tensor infos."""
    path = Path(path)
    with path.open("rb") as file:
        if path.stat().st_size < len(GGUF_MAGIC):  # too short to map, and to be a GGUF
            raise GgufError(f"{path} is not a GGUF file (no GGUF magic bytes)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return _Reader(view, path).metadata()


class _Reader:
    """A little-endian cursor over the mapped file."""

    def __init__(self, buffer: mmap.mmap, path: Path) -> None:
        self.buffer, self.path, self.pos = buffer, path, 0

    def metadata(self) -> dict[str, Any]:
        if self.buffer[:4] != GGUF_MAGIC:
            raise GgufError(f"{self.path} is not a GGUF file (no GGUF magic bytes)")
        self.pos = 4
        version = self.scalar("I")
        if version not in SUPPORTED_VERSIONS:
            raise GgufError(f"{self.path} is GGUF version {version}; this reader reads {SUPPORTED_VERSIONS}")
        self.scalar("Q")  # the tensor count: the tensor infos after the metadata are not read
        count = self.scalar("Q")
        pairs = {}
        for _ in range(count):
            key = self.string()
            pairs[key] = self.value(self.scalar("I"))
        return pairs

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        except struct.error:
            raise GgufError(f"{self.path} ends inside its metadata (offset {self.pos})") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise GgufError(f"{self.path} ends inside a string of its metadata (offset {self.pos})")
        try:
            text = self.buffer[self.pos : end].decode("utf-8")
        except UnicodeDecodeError:
            raise GgufError(f"{self.path} holds a string that is not UTF-8 (offset {self.pos})") from None
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            if item_kind in _SCALAR_FORMATS:  # one unpack for a whole numeric array (token types)
                fmt = _SCALAR_FORMATS[item_kind]
                end = self.pos + count * struct.calcsize(fmt)
                if end > len(self.buffer):
                    raise GgufError(f"{self.path} ends inside an array of its metadata (offset {self.pos})")
                items = struct.unpack_from(f"<{count}{fmt}", self.buffer, self.pos)
                self.pos = end
                return list(items)
            return [self.value(item_kind) for _ in range(count)]
        raise GgufError(f"{self.path} holds a metadata value of unknown type {kind} (offset {self.pos})")


def tokenizer_from_gguf(path: str | Path) -> tuple[tokenizers.Tokenizer, str | None, dict[str, str]]:
    """`(tokenizer, chat template or None, {"bos_token": "<s>", ...})` as the file describes them."""
    meta = read_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise GgufError(
            f"{path} describes a {model!r} tokenizer; only byte-level BPE ('gpt2') is rebuilt from a GGUF "
            "file: give the model's HF tokenizer folder (with tokenizer.json) instead"
        )
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    specials = {
        name: tokens[meta[key]]
        for name, key in SPECIAL_TOKEN_IDS.items()
        if isinstance(meta.get(key), int) and 0 <= meta[key] < len(tokens)
    }
    backend = _byte_level_bpe(meta, path)
    _add_marked_tokens(backend, tokens, meta.get("tokenizer.ggml.token_type") or [], specials)
    backend.post_processor = _post_processor(backend, meta, specials)
    return backend, meta.get("tokenizer.chat_template"), specials


def byte_alphabet() -> list[str]:
    """The character that stands for each byte in a byte-level vocabulary (GPT-2's convention).

    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, NBSP, soft hyphen)
    take the code points from 256 up, in byte order, so that no token contains whitespace.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)}
    alphabet, spare = {}, 256
    for byte in range(256):
        if byte in printable:
            alphabet[byte] = chr(byte)
        else:
            alphabet[byte], spare = chr(spare), spare + 1
    return [alphabet[byte] for byte in range(256)]


def _byte_level_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """GPT-2's split (contractions, letters, digits, other runs, whitespace) then the byte respelling.

    llama.cpp's "smollm" adds a split into single digits on top; transformers does not (its GGUF path
    gives it the GPT-2 default), and the digits come out single anyway: no SmolLM2 merge joins two
    ASCII digits.
    """
    return pre_tokenizers.ByteLevel(add_prefix_space=False)


# `tokenizer.ggml.pre` -> the pre-tokenizer its vocabulary was trained with; only those verified
# token for token against transformers (tests/protocol/test_gguf.py).
PRE_TOKENIZERS: dict[str, Callable[[], pre_tokenizers.PreTokenizer]] = {
    "gpt-2": _byte_level_pre_tokenizer,
    "smollm": _byte_level_pre_tokenizer,
}


def _byte_level_bpe(meta: dict[str, Any], path: str | Path) -> tokenizers.Tokenizer:
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(
            f"{path}: the byte-level pre-tokenizer {pre!r} is not supported (supported: "
            f"{sorted(PRE_TOKENIZERS)}); give the model's HF tokenizer folder instead"
        )
    if "tokenizer.ggml.merges" not in meta:
        raise GgufError(f"{path}: a byte-level BPE vocabulary without tokenizer.ggml.merges")
    alphabet = byte_alphabet()
    letters = set(alphabet)
    # The BPE model looks tokens up spelled in the byte alphabet; a token the file stores as plain
    # text (with a space, or characters past Latin-1) is respelled into it, byte by byte.
    vocab = {
        token if set(token) <= letters else "".join(alphabet[b] for b in token.encode()): index
        for index, token in enumerate(meta["tokenizer.ggml.tokens"])
    }
    merges = [tuple(merge.split(" ", 1)) for merge in meta["tokenizer.ggml.merges"]]
    backend = tokenizers.Tokenizer(
        BPE(
            vocab,
            merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    return backend


def _add_marked_tokens(
    backend: tokenizers.Tokenizer, tokens: list[str], types: list[int], specials: dict[str, str]
) -> None:
    """Keep whole, in text, the tokens llama.cpp matches whole: control tokens as special ones,
    user-defined ones as plain added tokens, then any named special token not yet among them.

    A control token spelled outside the byte alphabet is a mislabel (real byte-level tokens are all
    spelled in it); adding it would grow the vocabulary past the model's embedding, so it is skipped,
    as transformers skips it.
    """
    letters = set(byte_alphabet())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and set(token) <= letters
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab(with_added_tokens=False)
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED and token in vocab
        ]
    )
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = dict.fromkeys(text for text in specials.values() if text not in added)
    backend.add_special_tokens([AddedToken(text, special=True) for text in missing])


def _post_processor(
    backend: tokenizers.Tokenizer, meta: dict[str, Any], specials: dict[str, str]
) -> processors.TemplateProcessing:
    """BOS/EOS around an encoding (with add_special_tokens=True) when the file's flags ask for them."""
    bos, eos = (
        [specials[name]] if meta.get(f"tokenizer.ggml.add_{name}") and name in specials else []
        for name in ("bos_token", "eos_token")
    )

    def template(sequence: str, type_id: int) -> list[str]:
        return [f"{piece}:{type_id}" for piece in (*bos, sequence, *eos)]

    return processors.TemplateProcessing(
        single=template("$A", 0),
        pair=template("$A", 0) + template("$B", 1),
        special_tokens=[(token, backend.token_to_id(token)) for token in dict.fromkeys(bos + eos)],
    )
