"""The package layout of docs/design.md §1, as imports: the protocol both sides speak depends on neither
side, the gateway on no worker code, the workers on no gateway code, and the pure layers on no I/O stack."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Package -> the top-level packages it must never import (lazily inside a function included).
FORBIDDEN = {
    "protocol": {"gateway", "workers", "bench", "prefixgate", "torch", "transformers"},
    "gateway": {"workers", "bench", "prefixgate", "torch", "transformers"},
    "workers": {"gateway", "prefixgate"},
    "radix": {"gateway", "workers", "protocol", "prefixgate", "aiohttp", "redis", "torch"},
    "policies": {"gateway", "workers", "protocol", "prefixgate", "aiohttp", "redis", "torch"},
    # The benchmarks start the command line as a process; they import none of it.
    "bench": {"prefixgate"},
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


PACKAGES = ("protocol", "gateway", "workers", "radix", "policies", "bench", "prefixgate")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The repository's modules `path` imports, wherever the import stands (a function's, or under
    TYPE_CHECKING): `from a.b import c` counts as a.b.c when that is a module, else as a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {f"{node.module}.{alias.name}" for alias in node.names} | {node.module}
    return {name for name in found if name in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif step not in index:
                index[step] = low[step] = len(index)
                stack.append(step)
                on_stack.add(step)
                work.append((step, iter(sorted(graph[step]))))
            elif step in on_stack:
                low[node] = min(low[node], index[step])
    return found


def test_no_module_imports_itself_through_others_type_checking_and_lazy_imports_included() -> None:
    files = {module_name(f): f for package in PACKAGES for f in (ROOT / package).rglob("*.py")}
    modules = set(files)
    graph = {name: imported_modules(path, modules) - {name} for name, path in files.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
