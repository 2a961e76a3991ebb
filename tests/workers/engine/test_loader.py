"""Loading HF folders, strict weight mapping, and the once-only, all-or-nothing GGUF conversion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, PreTrainedTokenizerFast
from transformers import LlamaForCausalLM as HFLlama

from protocol.models import default_gguf_path, gguf_fingerprint
from workers.engine import loader
from workers.engine.loader import convert_gguf, gguf_model_name, load_model, load_weights
from workers.engine.model import LlamaForCausalLM, ModelConfig, load_hf_weights

WORDS = ["<unk>", "<s>", "</s>", "hello", "world", "user", "assistant"]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with untied embeddings and a word-level tokenizer carrying a chat template."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    HFLlama(config).save_pretrained(folder)
    raw = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    raw.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder


def test_hf_folder_loads_model_tokenizer_and_config(hf_folder: Path) -> None:
    loaded = load_model(hf_folder)
    assert loaded.name == hf_folder.name
    assert loaded.path == hf_folder
    assert loaded.config.eos_token_ids == (2,)
    assert loaded.tokenizer.encode("hello world") == [3, 4]
    assert loaded.tokenizer.chat_template == CHAT_TEMPLATE
    assert not loaded.config.tie_word_embeddings
    assert loaded.model.lm_head.weight.data_ptr() != loaded.model.model.embed_tokens.weight.data_ptr()
    assert load_model(hf_folder, name="custom").name == "custom"


def test_weights_land_where_hf_keeps_them(hf_folder: Path) -> None:
    hf = HFLlama.from_pretrained(hf_folder)
    ours = load_weights(hf_folder)
    attn = hf.model.layers[0].self_attn
    fused = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(ours.model.layers[0].self_attn.qkv_proj.weight, fused)
    assert torch.equal(ours.lm_head.weight, hf.lm_head.weight)
    half = load_weights(hf_folder, dtype=torch.bfloat16)
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16


def test_strict_weight_loading(hf_folder: Path) -> None:
    hf_state = HFLlama.from_pretrained(hf_folder).state_dict()
    config = ModelConfig.from_hf(json.loads((hf_folder / "config.json").read_text()))

    def load(state: dict[str, torch.Tensor]) -> None:
        load_hf_weights(LlamaForCausalLM.empty(config, dtype=torch.float32, device="cpu"), state.items())

    load(hf_state)
    missing = {k: v for k, v in hf_state.items() if "k_proj" not in k}
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load(missing)
    with pytest.raises(ValueError, match="has no place"):
        load({**hf_state, "model.layers.0.self_attn.rotary_mix.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="has shape"):
        load({**hf_state, "model.norm.weight": torch.zeros(3)})


def test_gguf_names() -> None:
    assert gguf_model_name(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert gguf_model_name(Path("Meta-Llama-3.1-8B-Instruct-Q4_K_M.gguf")) == "Meta-Llama-3.1-8B-Instruct"
    assert gguf_model_name(Path("tiny.gguf")) == "tiny"
    assert default_gguf_path().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_gguf_conversion_is_atomic_and_done_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gguf = tmp_path / "model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    calls = []

    def killed_midway(src: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"partial")
        raise KeyboardInterrupt

    def converts(src: Path, out: Path) -> None:
        calls.append(src)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(loader, "write_converted", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []

    # What a SIGKILL leaves behind: an old temp folder, removed by the next conversion.
    stale = tmp_path / "cache" / "gguf" / f".model.Q8_0-{gguf_fingerprint(gguf)}.killed.tmp"
    stale.mkdir()
    os.utime(stale, (0, 0))
    monkeypatch.setattr(loader, "write_converted", converts)
    first = convert_gguf(gguf, cache_dir=tmp_path / "cache")
    assert first.name.startswith("model.Q8_0-") and (first / "config.json").is_file()
    assert convert_gguf(gguf, cache_dir=tmp_path / "cache") == first
    assert calls == [gguf]
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [first.name]

    # A different file (a new release under the same name) converts to a folder of its own.
    gguf.write_bytes(b"GGUF" + bytes(101))
    assert convert_gguf(gguf, cache_dir=tmp_path / "cache") != first


def test_missing_files_are_reported(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        convert_gguf(tmp_path / "absent.gguf", cache_dir=tmp_path)
