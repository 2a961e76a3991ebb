"""The package layout of docs/design.md §1, as imports: the protocol both sides speak depends on neither
side, the gateway on no worker code, the workers on no gateway code, and the pure layers on no I/O stack."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Package -> the top-level packages it must never import (lazily inside a function included).
FORBIDDEN = {
    "protocol": {"gateway", "workers", "bench", "torch", "transformers"},
    "gateway": {"workers", "bench", "torch", "transformers"},
    "workers": {"gateway"},
    "radix": {"gateway", "workers", "protocol", "aiohttp", "redis", "torch"},
    "policies": {"gateway", "workers", "protocol", "aiohttp", "redis", "torch"},
}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_what_its_layer_may(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files
    for file in files:
        wrong = imported_roots(file) & FORBIDDEN[package]
        assert not wrong, f"{file.relative_to(ROOT)} imports {sorted(wrong)}"
