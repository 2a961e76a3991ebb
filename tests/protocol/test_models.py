"""protocol.models: the default model's files, and the tokenizers the gateway loads by YAML spec —
from the worker's converted folder when there is one, else from the GGUF through a cache folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from protocol import models
from protocol.models import (
    cache_root,
    converted_folder,
    default_gguf_path,
    default_tokenizer,
    load_tokenizer_spec,
    tokenizer_folder,
)
from protocol.tokenizer import Tokenizer


@pytest.fixture
def cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def forbid_gguf_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(path: object) -> Tokenizer:
        raise AssertionError(f"read {path} again")

    monkeypatch.setattr(Tokenizer, "from_gguf", fail)


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PREFIXGATE_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("PREFIXGATE_CACHE")
    assert cache_root() == Path.home() / ".cache" / "prefixgate"


def test_the_default_gguf_is_found_without_importing_its_package() -> None:
    assert default_gguf_path().name == models.DEFAULT_GGUF_FILE
    assert default_gguf_path().read_bytes()[:4] == b"GGUF"


def test_the_default_tokenizer_is_read_from_the_gguf_once_then_from_its_cache(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = default_tokenizer()
    folder = tokenizer_folder(default_gguf_path())
    assert folder.is_relative_to(cache) and sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert json.loads((folder / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert [p.name for p in folder.parent.iterdir()] == [folder.name], "no temporary folder is left"
    forbid_gguf_reads(monkeypatch)
    again = default_tokenizer()
    assert again.backend.to_str() == first.backend.to_str()
    assert (again.chat_template, again.special_tokens) == (first.chat_template, first.special_tokens)


def test_the_workers_converted_folder_wins_when_it_exists(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker tokenizes with its converted folder; the gateway then reads the very same files."""
    converted = converted_folder(default_gguf_path())
    converted.mkdir(parents=True)
    default_tokenizer().save(converted)
    (converted / "chat_template.jinja").write_text("converted: {{ messages[0].content }}")
    shutil.rmtree(cache / "tokenizers")
    forbid_gguf_reads(monkeypatch)
    assert default_tokenizer().render_chat([{"role": "user", "content": "x"}]) == "converted: x"


def test_yaml_specs(cache: Path, tmp_path: Path) -> None:
    assert load_tokenizer_spec("none") is None
    default = load_tokenizer_spec("default")
    assert default is not None
    from_gguf = load_tokenizer_spec(str(default_gguf_path()))
    assert from_gguf is not None and from_gguf.encode("Hi there") == default.encode("Hi there")
    default.save(tmp_path / "folder")
    from_folder = load_tokenizer_spec(str(tmp_path / "folder"))
    assert from_folder is not None and from_folder.special_tokens == default.special_tokens
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_tokenizer_spec(str(tmp_path / "absent.gguf"))
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_tokenizer_spec(str(tmp_path / "absent"))


def test_a_killed_build_leaves_nothing_that_looks_finished(tmp_path: Path) -> None:
    target = tmp_path / "cache" / "thing"

    def killed(out: Path) -> None:
        (out / "done").write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        models.build_folder_once(target, killed, "done")
    assert list(target.parent.iterdir()) == []
    built = models.build_folder_once(target, lambda out: (out / "done").write_text("whole"), "done")
    assert built == target and (target / "done").read_text() == "whole"
    assert target.stat().st_mode & 0o777 == 0o755 and (target / "done").stat().st_mode & 0o777 == 0o644
    assert models.build_folder_once(target, killed, "done") == target, "built once, then reused"
