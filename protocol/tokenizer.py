"""The tokenizer both sides run: HF `tokenizers` (Rust) for text <-> ids, jinja2 for the chat template.

No torch and no transformers: the gateway tokenizes every prompt to route it, and a router that
imported the model stack to do so would carry hundreds of MB and seconds of start-up for nothing. The
workers use the same class, so a prompt becomes the same ids on both sides by construction.

The chat template renders as transformers 5 renders it (a sandboxed environment with `trim_blocks` and
`lstrip_blocks`, the loop-control extension, a `tojson` that keeps non-ASCII text, `raise_exception`,
`strftime_now`, the tokenizer's special tokens in the context, and messages stripped of None values
with their reasoning aliased), so a template from the Hub means the same prompt here as in vLLM or
transformers.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import Extension, loopcontrols
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol.gguf import tokenizer_from_gguf

# The named special tokens transformers passes to a template (the ones a tokenizer_config may name).
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
# A message's reasoning, under the names templates read it by; the first is the standard one.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Characters before a cut whose tokens a cut may have changed (gateway routing of a long prompt by its
# head): one word's worth, measured on SmolLM2's tokenizer with random cuts of prose, code, CJK and
# runs of one letter (none changed farther back than 8 characters, outside special tokens).
CUT_MARGIN_CHARS = 32


class ChatTemplateError(ValueError):
    """The model's chat template cannot render these messages (or the model has none)."""


@dataclass(frozen=True, slots=True)
class Tokenizer:
    backend: tokenizers.Tokenizer
    chat_template: str | None = None
    # bos_token, eos_token, ...: the strings a template may use.
    special_tokens: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """A HF tokenizer folder: `tokenizer.json`, with `tokenizer_config.json` and, as transformers 5
        saves it, `chat_template.jinja` beside it."""
        folder = Path(folder).expanduser()
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{folder} holds no tokenizer.json")
        config_file = folder / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template_file = folder / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        specials = {name: _token_text(config.get(name)) for name in SPECIAL_TOKEN_NAMES}
        return cls(
            tokenizers.Tokenizer.from_file(str(file)),
            template,
            {name: text for name, text in specials.items() if text is not None},
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer a GGUF file describes in its metadata (protocol.gguf), without the weights."""
        backend, template, specials = tokenizer_from_gguf(Path(path))
        return cls(backend, template, specials)

    def save(self, folder: str | Path) -> None:
        """Write the folder `from_folder` reads back (and transformers loads as a fast tokenizer)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", **self.special_tokens}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
        if self.chat_template is not None:
            (folder / "chat_template.jinja").write_text(self.chat_template)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def special_token_id(self, name: str) -> int | None:
        """The id of a named special token ("eos_token", "pad_token", ...), None when it has none."""
        text = self.special_tokens.get(name)
        return None if text is None else self.token_id(text)

    def encode(self, text: str) -> list[int]:
        """The ids of `text` as it stands: no BOS or other special token is added."""
        return encode_ids(self.backend, text)

    def head_ids(self, text: str, max_chars: int) -> list[int]:
        """The ids of `text`'s first `max_chars` characters that are also the whole text's first ids.

        Tokenizing a text's head gives the whole text's ids except near the cut: the word (or special
        token) the cut splits tokenizes otherwise. So the ids kept are those before the token holding
        the character a margin before the cut (the longest special token, CUT_MARGIN_CHARS at least);
        none where no token holds a character near there."""
        if len(text) <= max_chars:
            return encode_ids(self.backend, text)
        encoding = _encode(self.backend, text[:max_chars])
        last = max_chars - max(CUT_MARGIN_CHARS, _longest_added_token(self.backend))
        for position in range(last, max(last - CUT_MARGIN_CHARS, -1), -1):
            token = encoding.char_to_token(position)
            if token is not None:
                return encoding.ids[:token]
        return []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of a conversation; ChatTemplateError when the template refuses it."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            template = _compile(self.chat_template)
            return template.render(
                messages=[_template_message(message) for message in messages],
                tools=list(tools) if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except Exception as error:  # a template is code: whatever it raises means "cannot render this"
            raise ChatTemplateError(f"{type(error).__name__}: {error}") from None


@dataclass(slots=True)
class CharBudget:
    """The characters one prompt may still have tokenized, shared by all its encodes."""

    left: int
    # Whether some of the prompt was left out: its ids are then only a head of the whole prompt's.
    cut: bool = False


@dataclass(frozen=True, slots=True)
class HeadTokenizer(Tokenizer):
    """The tokenizer of one prompt that may be too long to tokenize whole (the gateway routes such a
    prompt by its head): its encodes together take at most `budget.left` characters, the text that
    crosses it is cut (Tokenizer.head_ids), and what is encoded after a cut comes out empty, so the
    ids it gives, however a prompt's pieces are encoded and joined, are a head of the whole prompt's.
    Rendering the chat template stays whole: that is string work, not tokenizing."""

    budget: CharBudget = field(default_factory=lambda: CharBudget(0))
    # What encodes a text that fits the budget, when not the backend itself: one that gives the same
    # ids faster (the gateway's cache of known prefixes, gateway.forward.prefix_cache).
    whole: Callable[[str], Sequence[int]] | None = None

    @classmethod
    def of(
        cls, tokenizer: Tokenizer, max_chars: int, whole: Callable[[str], Sequence[int]] | None = None
    ) -> HeadTokenizer:
        return cls(
            tokenizer.backend,
            tokenizer.chat_template,
            tokenizer.special_tokens,
            CharBudget(max_chars),
            whole,
        )

    def encode(self, text: str) -> Sequence[int]:  # type: ignore[override]
        budget = self.budget
        if budget.cut:
            return []
        if len(text) <= budget.left:
            budget.left -= len(text)
            return self.whole(text) if self.whole is not None else encode_ids(self.backend, text)
        head, budget.left, budget.cut = budget.left, 0, True
        return self.head_ids(text, head)


def _encode(backend: tokenizers.Tokenizer, text: str) -> tokenizers.Encoding:
    """`text` encoded as a batch of one, which the binding runs without the GIL: a plain encode holds
    it throughout (about a second per MB of text), stalling every other thread, event loop included."""
    return backend.encode_batch([text], add_special_tokens=False)[0]


def encode_ids(backend: tokenizers.Tokenizer, text: str) -> list[int]:
    """The ids of `text`, no special token added, without the GIL (_encode). Where the binding has
    it (tokenizers >= 0.21), the batch is encoded without character offsets, which only a cut needs
    (head_ids): a quarter less time for the same ids."""
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None:
        return _encode(backend, text).ids
    return fast([text], add_special_tokens=False)[0].ids


@lru_cache(maxsize=16)
def _longest_added_token(backend: tokenizers.Tokenizer) -> int:
    """The length of the tokenizer's longest added (special) token, in characters."""
    return max((len(t.content) for t in backend.get_added_tokens_decoder().values()), default=0)


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to a template: keys whose value is None dropped (templates
    test for a missing key, and would print "None"), and its reasoning under each name templates use.
    A message with neither is passed as it is (the sandbox is immutable: the template cannot change it)."""
    if None not in message.values() and message.keys().isdisjoint(REASONING_FIELDS):
        return message
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_FIELDS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask markers): rendered as
    their body, since nothing here needs the mask."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


# A for loop's documented variables: plain values, or the loop's own items. The methods (cycle, changed)
# and everything else take the sandbox's checks.
_LOOP_VALUES = frozenset(
    {
        "index",
        "index0",
        "revindex",
        "revindex0",
        "first",
        "last",
        "length",
        "depth",
        "depth0",
        "previtem",
        "nextitem",
    }
)


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox, less its checks on a loop's variables: templates read `loop.first` or `loop.last`
    once a message, and each read through the checks cost more than the rest of the render (a
    122-message conversation: 376 µs with them, docs/benchmarks.md)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if attribute in _LOOP_VALUES and type(obj) is LoopContext:
            return getattr(obj, attribute)
        return super().getattr(obj, attribute)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)
