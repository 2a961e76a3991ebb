"""Benchmark output: a text table on stdout, a JSON file and a PNG plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def format_table(title: str, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in header]] + [[_cell(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    rule = "-+-".join("-" * w for w in widths)
    lines = [title, " | ".join(c.ljust(w) for c, w in zip(cells[0], widths, strict=True)), rule]
    lines += [" | ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells[1:]]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def bar_panels(
    path: str | Path,
    title: str,
    panels: Sequence[tuple[str, dict[str, float]]],
    reference: dict[int, tuple[str, float]] | None = None,
) -> None:
    """One bar chart per metric side by side; `reference` draws a labelled line on panel i."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.0))
    axes = [axes] if len(panels) == 1 else list(axes)
    for i, (ax, (metric, values)) in enumerate(zip(axes, panels, strict=True)):
        names = list(values)
        ax.bar(names, [values[n] for n in names], color="tab:blue")
        ax.set_title(metric)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        if reference and i in reference:
            label, y = reference[i]
            ax.axhline(y, color="tab:red", linestyle="--", label=label)
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
