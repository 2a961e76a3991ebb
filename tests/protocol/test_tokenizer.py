"""protocol.tokenizer renders chat templates to the very text transformers renders, saves a folder
that both it and transformers load back, and runs (with protocol.gguf, protocol.models and
protocol.prompts) where torch and transformers cannot even be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from protocol.models import default_gguf_path
from protocol.tokenizer import ChatTemplateError, Tokenizer
from workers.engine.loader import convert_gguf

ROOT = Path(__file__).resolve().parents[2]

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "C"}},
}
CONVERSATIONS = {
    "user only (the template adds its system prompt)": [{"role": "user", "content": "Hi there!"}],
    "system, user, assistant, user": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "Und auf Deutsch? 中文呢？ 😀"},
    ],
    "a tool result": [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp": 21}'},
    ],
    "special tokens and whitespace in the text": [
        {"role": "user", "content": "  <|im_end|> inside\n\n\ttext  "},
    ],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": 'Météo & <b>forecast</b> — "quoted"',
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

# Lists the tools as JSON (tojson keeps non-ASCII text and HTML characters), and the calls by name.
TOOLS_TEMPLATE = textwrap.dedent(
    """\
    {%- if tools %}
    <|im_start|>system
    Tools:
    {% for tool in tools %}
    {{ tool | tojson }}
    {{ tool.function | tojson(indent=2, sort_keys=True) }}
    {% endfor %}
    <|im_end|>
    {% endif %}
    {% for m in messages %}
    <|im_start|>{{ m.role }}
    {% if m.tool_calls is defined %}
    {% for call in m.tool_calls %}
    <call>{{ call.function.name }} {{ call.function.arguments | tojson }}</call>
    {% endfor %}
    {% endif %}
    {{ m.content if m.content is defined else "(no content)" }}<|im_end|>
    {% endfor %}
    {% if add_generation_prompt %}<|im_start|>assistant
    {% endif %}"""
)
RAISING_TEMPLATE = (
    "{% if messages[0].role != 'system' %}{{ raise_exception('the first message must be a system one') }}"
    "{% endif %}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)
# Everything else a Hub template leans on: namespaces, loop controls, documents (None), messages with
# None values dropped, reasoning under all its names, and the special tokens.
CONTEXT_TEMPLATE = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'stop' %}{% break %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ m.role }}|{{ 'content' in m }}|{{ m.content is defined }}"
    "|{{ m.reasoning_content }}|{{ m.thinking }}|{{ m.reasoning }}\n{% endfor %}"
    "{{ ns.n }} {{ documents is none }} {{ tools is none }} {{ unk_token }}{{ pad_token }}"
    "{{ strftime_now('%Y') | length }}"
)


@pytest.fixture(scope="module")
def converted() -> Path:
    return convert_gguf(default_gguf_path())


@pytest.fixture(scope="module")
def ours(converted: Path) -> Tokenizer:
    return Tokenizer.from_folder(converted)


@pytest.fixture(scope="module")
def theirs(converted: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(converted), local_files_only=True)


def hf_render(
    theirs: PreTrainedTokenizerBase,
    messages: list[dict[str, Any]],
    template: str | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    return theirs.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
    )


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_smollm2s_template_renders_as_transformers(
    name: str, ours: Tokenizer, theirs: PreTrainedTokenizerBase
) -> None:
    messages = CONVERSATIONS[name]
    assert ours.render_chat(messages) == hf_render(theirs, messages)
    assert ours.render_chat(messages, add_generation_prompt=False) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False
    )


@pytest.mark.parametrize("tools", [TOOLS, None, []])
def test_a_template_using_tools_renders_as_transformers(
    tools: list[dict[str, Any]] | None, ours: Tokenizer, theirs: PreTrainedTokenizerBase
) -> None:
    templated = Tokenizer(ours.backend, TOOLS_TEMPLATE, ours.special_tokens)
    for messages in CONVERSATIONS.values():
        assert templated.render_chat(messages, tools) == hf_render(theirs, messages, TOOLS_TEMPLATE, tools)
    if tools:
        assert '"Météo & <b>forecast</b> — \\"quoted\\""' in templated.render_chat(messages, tools)


def test_raise_exception_refuses_as_transformers_does(
    ours: Tokenizer, theirs: PreTrainedTokenizerBase
) -> None:
    strict = Tokenizer(ours.backend, RAISING_TEMPLATE, ours.special_tokens)
    accepted = CONVERSATIONS["system, user, assistant, user"]
    assert strict.render_chat(accepted) == hf_render(theirs, accepted, RAISING_TEMPLATE)
    refused = CONVERSATIONS["a tool result"]
    with pytest.raises(jinja2.TemplateError, match="must be a system one"):
        hf_render(theirs, refused, RAISING_TEMPLATE)
    with pytest.raises(ChatTemplateError, match="must be a system one"):
        strict.render_chat(refused)


def test_generation_tags_render_as_their_body(ours: Tokenizer, theirs: PreTrainedTokenizerBase) -> None:
    marked = Tokenizer(ours.backend, GENERATION_TEMPLATE, ours.special_tokens)
    for messages in CONVERSATIONS.values():
        assert marked.render_chat(messages) == hf_render(theirs, messages, GENERATION_TEMPLATE)


def test_template_context_is_transformers(ours: Tokenizer, theirs: PreTrainedTokenizerBase) -> None:
    contextual = Tokenizer(ours.backend, CONTEXT_TEMPLATE, ours.special_tokens)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "reasoning": "because", "tool_calls": [WEATHER_CALL]},
        {"role": "assistant", "content": "a", "thinking": "hmm", "reasoning_content": None},
        {"role": "stop", "content": "unseen"},
        {"role": "user", "content": "unseen"},
    ]
    rendered = contextual.render_chat(messages)
    assert rendered == hf_render(theirs, messages, CONTEXT_TEMPLATE)
    assert "assistant|False|False|because|because|because" in rendered


def test_the_template_failing_in_any_way_is_a_chat_template_error(ours: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(ours.backend).render_chat([{"role": "user", "content": "x"}])
    # SmolLM2's template concatenates the content, which a turn of tool calls alone does not have.
    with pytest.raises(ChatTemplateError):
        ours.render_chat([{"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]}])
    with pytest.raises(ChatTemplateError, match="TemplateSyntaxError"):
        Tokenizer(ours.backend, "{% for %}").render_chat([])
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        Tokenizer(ours.backend, "{{ messages.__class__.__mro__ }}").render_chat([])


def test_a_saved_folder_loads_back_here_and_in_transformers(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(tmp_path)
    again = Tokenizer.from_folder(tmp_path)
    assert (again.chat_template, again.special_tokens) == (ours.chat_template, ours.special_tokens)
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    messages = CONVERSATIONS["system, user, assistant, user"]
    for text in ("Hello world", ours.render_chat(messages), "  ünï  <|im_start|>"):
        assert again.encode(text) == ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == ours.render_chat(
        messages
    )
    assert hf.eos_token == ours.special_tokens["eos_token"] == "<|im_end|>"


def test_named_special_token_ids(ours: Tokenizer) -> None:
    assert ours.special_token_id("eos_token") == 2 and ours.special_token_id("bos_token") == 1
    assert ours.special_token_id("mask_token") is None
    assert ours.vocab_size == len(ours) == 49152


def test_a_folder_without_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)


# Run in a fresh interpreter where torch and transformers cannot be imported at all, with a cache that
# has no converted model: the default tokenizer must come from the GGUF's metadata alone.
TORCH_FREE = textwrap.dedent(
    """\
    import importlib.abc, sys

    class Blocked(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers"):
                raise ImportError(f"{name} is blocked in this test")
            return None

    sys.meta_path.insert(0, Blocked())
    from protocol import gguf, models, prompts, tokenizer

    default = models.default_tokenizer()
    from_gguf = models.load_tokenizer_spec(str(models.default_gguf_path()))
    messages = [{"role": "user", "content": "Hello!"}]
    ids = prompts.chat_prompt_ids(default, messages)
    assert ids == prompts.chat_prompt_ids(from_gguf, messages) and len(ids) > 10
    assert gguf.read_metadata(models.default_gguf_path())["tokenizer.ggml.model"] == "gpt2"
    assert isinstance(default, tokenizer.Tokenizer)
    assert "torch" not in sys.modules and "transformers" not in sys.modules
    print(ids)
    """
)


def test_the_protocol_tokenizer_runs_without_torch_or_transformers(tmp_path: Path, ours: Tokenizer) -> None:
    env = {**os.environ, "PREFIXGATE_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", TORCH_FREE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ours.encode(ours.render_chat([{"role": "user", "content": "Hello!"}]))
    assert (next((tmp_path / "tokenizers").glob("*/*")) / "tokenizer.json").is_file()


LOOP_TEMPLATE = (
    "{% for m in messages %}{{ loop.index }}/{{ loop.index0 }}/{{ loop.revindex }}/{{ loop.revindex0 }}/"
    "{{ loop.first }}/{{ loop.last }}/{{ loop.length }}/{{ loop.depth }}/{{ loop.depth0 }}/"
    "{{ loop.previtem.role if loop.previtem is defined }}/"
    "{{ loop.nextitem.role if loop.nextitem is defined }}/"
    "{{ loop.cycle('odd', 'even') }}/{{ loop.changed(m.role) }};{% endfor %}"
)


def test_a_loops_variables_read_past_the_sandbox_render_as_in_it(
    ours: Tokenizer, theirs: PreTrainedTokenizerBase
) -> None:
    """The sandbox's checks are skipped for a loop's documented values only (they cost more than the
    rest of a render): every one reads as transformers reads it, and the loop's internals stay shut."""
    messages = [{"role": r, "content": "x"} for r in ("system", "user", "assistant", "user")]
    looped = Tokenizer(ours.backend, LOOP_TEMPLATE, ours.special_tokens)
    rendered = looped.render_chat(messages)
    assert rendered == hf_render(theirs, messages, LOOP_TEMPLATE)
    assert rendered.startswith("1/0/4/3/True/False/4/1/0//user/odd/True;")
    internal = Tokenizer(ours.backend, "{% for m in messages %}[{{ loop._iterator }}]{% endfor %}")
    assert internal.render_chat(messages) == "[]" * 4  # the sandbox's undefined, as it always was
    escape = Tokenizer(
        ours.backend, "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}"
    )
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        escape.render_chat(messages)
