"""`bench cuda-check` refuses without CUDA, and its whole check runs (on the CPU, with a tiny model's
shape) with the engine's greedy tokens equal to HF's and a decode step timed per batch size."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from bench.cuda_check import FOLDER_FILES, shape_folder
from prefixgate.cli import main
from protocol.models import default_gguf_path
from tests.support.hf_models import tiny_llama_config
from workers.engine.loader import convert_gguf

pytestmark = pytest.mark.real


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_it_refuses_clearly_without_a_cuda_device() -> None:
    with pytest.raises(SystemExit, match="no CUDA device here"):
        main(["bench", "cuda-check"])


def test_the_whole_check_runs_and_matches_hf(tmp_path: Path) -> None:
    shape = tmp_path / "tiny-shape"
    smollm2 = convert_gguf(default_gguf_path())
    shape.mkdir()
    for name in FOLDER_FILES[1:]:
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, shape / name)
    vocab_size = json.loads((smollm2 / "config.json").read_text())["vocab_size"]
    tiny_llama_config(vocab_size).save_pretrained(shape)
    out = tmp_path / "cuda_check.json"
    argv = ["bench", "cuda-check", "--device", "cpu", "--shape-from", str(shape), "--requests", "6"]
    argv += ["--prompt", "24", "--output", "5", "--hf-batch", "3", "--prefix-prompt", "256"]
    argv += ["--prefix-cached", "240", "--decode-batches", "1,3", "--decode-context", "20"]
    argv += ["--decode-steps", "2", "--json", str(out)]
    assert main(argv) == 0
    payload = json.loads(out.read_text())
    [(name, result)] = payload["shapes"].items()
    assert name == "tiny-shape" and result["backend"] == "torch_sdpa"
    check = result["greedy_match_fp32"]
    assert check["matched"] == check["prompts"] == 8
    speed = result["throughput_bf16"]
    assert speed["engine_out_tok_s"] > 0 and speed["hf_generate_out_tok_s"] > 0
    assert speed["engine_steps"] >= speed["output"]  # one step per output token at least
    prefix = result["prefix_ttft_bf16"]
    # Reuse is what is checked here; which of two millisecond prefills of a tiny model is faster is
    # the benchmark's to report (it flipped on a busy CI machine).
    assert prefix["cached_tokens"] == 240 and prefix["cached_s"] > 0 and prefix["cold_s"] > 0
    decode = result["decode_step_ms_bf16"]
    assert decode["context"] == 20
    # Only SDPA runs natively on the CPU; each batch size has its time.
    assert list(decode["backends"]) == ["torch_sdpa"]
    assert set(decode["backends"]["torch_sdpa"]) == {"1", "3"}
    assert all(ms > 0 for ms in decode["backends"]["torch_sdpa"].values())
    assert out.with_suffix(".png").stat().st_size > 0


def test_the_llama_1b_shape_is_llama_32_1b(tmp_path: Path) -> None:
    """The 1B shape's folder: Llama-3.2-1B's config as the engine reads it, SmolLM2's tokenizer."""
    from workers.engine.model import ModelConfig

    smollm2 = convert_gguf(default_gguf_path())
    folder = shape_folder("llama-3.2-1b", smollm2, tmp_path / "shape")
    config = ModelConfig.from_hf(json.loads((folder / "config.json").read_text()))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (16, 2048, 32, 8)
    assert (config.vocab_size, config.head_dim, config.tie_word_embeddings) == (128256, 64, True)
    assert (folder / "tokenizer.json").is_file()
    assert shape_folder("smollm2-135m", smollm2, tmp_path / "unused") == smollm2
    with pytest.raises(SystemExit, match="unknown shape 'gpt-9'"):
        shape_folder("gpt-9", smollm2, tmp_path / "x")
