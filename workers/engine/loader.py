"""Weights, tokenizer and config from a HF safetensors folder or a GGUF file, with no network.

A GGUF file is dequantised by transformers (slow: 40 s for SmolLM2 on two cores, mostly metadata
parsing) and converted once into a safetensors folder under the cache root, so every later start reads
plain tensors in a second or two. The conversion is
written to a temporary folder and renamed into place, so a killed conversion never leaves a folder
that looks finished.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from protocol.models import DEFAULT_MODEL_NAME, build_folder_once, converted_folder, default_gguf_path
from protocol.tokenizer import Tokenizer
from workers.engine.model import LlamaForCausalLM, ModelConfig, load_hf_weights
from workers.engine.model.moe import ExpertShard

# Nothing here may reach the Hub; huggingface_hub reads this when it is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    name: str
    config: ModelConfig
    # The safetensors folder the weights came from (for a GGUF source, its converted cache).
    path: Path


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 there changes greedy outputs and is slower), bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def model_folder(source: str | os.PathLike[str] | None) -> tuple[Path, str]:
    """A model's safetensors folder and served name: a HF folder as it is, a .gguf file converted once
    to the cache; None, "default" or the default's name is SmolLM2 from its package."""
    if source is None or str(source) in ("default", DEFAULT_MODEL_NAME):
        return convert_gguf(default_gguf_path()), DEFAULT_MODEL_NAME
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        return convert_gguf(path), gguf_model_name(path)
    return path, path.name


def load_model(
    source: str | os.PathLike[str] | None,
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    shard: ExpertShard | None = None,
) -> LoadedModel:
    """Load a model (see model_folder for what `source` may be); `shard`: the experts to hold, for a
    rank of an expert-parallel group."""
    folder, served = model_folder(source)
    model = load_weights(folder, dtype=dtype, device=device, shard=shard)
    return LoadedModel(model, load_tokenizer(folder), name or served, model.config, folder)


def gguf_model_name(path: Path) -> str:
    """The served name of a GGUF: its file name without the quantisation tag ("X.Q4_K_M.gguf" -> "X")."""
    return _QUANT_SUFFIX.sub("", path.stem)


def load_tokenizer(folder: Path) -> Tokenizer:
    """The folder's tokenizer, as the gateway loads it (protocol.tokenizer): the same ids on both sides."""
    return Tokenizer.from_folder(folder)


def read_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a model folder: it has no config.json")
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return ModelConfig.from_hf(json.loads(config_file.read_text()), generation)


def load_weights(
    folder: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    shard: ExpertShard | None = None,
) -> LlamaForCausalLM:
    """The model alone (its config in `.config`), for callers that bring their own tokenizer or none."""
    folder, device = Path(folder), torch.device(device)
    config = read_config(folder)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    model = LlamaForCausalLM.empty(config, dtype=dtype or default_dtype(device), device=device, shard=shard)
    load_hf_weights(model, _read_safetensors(weight_files))
    return model


def _read_safetensors(files: list[Path]) -> Any:
    """Tensors one at a time, so peak memory stays near one copy of the model."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield key, f.get_tensor(key)


def convert_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The safetensors folder for `gguf_path`, converting it the first time (atomically)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    return build_folder_once(
        converted_folder(gguf_path, cache_dir), lambda out: write_converted(gguf_path, out), "config.json"
    )


def write_converted(gguf_path: Path, out: Path) -> None:
    """Dequantise with transformers and write config.json, model.safetensors and the tokenizer to `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, file = str(gguf_path.parent), gguf_path.name
    hf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=file, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file, local_files_only=True)
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(hf_model).__name__]
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        # safetensors refuses shared storage; the tie is restored from the config on load.
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    hf_model.generation_config.to_json_file(str(out / "generation_config.json"))
    tokenizer.save_pretrained(str(out))
    (out / "source.json").write_text(json.dumps({"gguf": str(gguf_path)}, indent=2))
