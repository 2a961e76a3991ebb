"""One /metrics answer for the processes of `serve --workers N`: each process's samples labelled with
`process`, every family's samples together under one HELP and TYPE, as the text format requires.

Labelling rather than summing: a counter sums across processes, but a gauge such as a replica's health
does not, and a query can `sum by` what it needs.
"""

from __future__ import annotations

from collections.abc import Iterable


def merge_expositions(parts: Iterable[tuple[str, bytes]]) -> bytes:
    """Prometheus text expositions, each with the `process` label value it came from, as one."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for process, text in parts:
        family: tuple[list[str], list[str]] | None = None
        for line in text.decode().splitlines():
            if line.startswith("#"):
                words = line.split(" ", 3)
                if len(words) < 3 or words[1] not in ("HELP", "TYPE"):
                    continue
                family = families.setdefault(words[2], ([], []))
                if line not in family[0]:
                    family[0].append(line)
            elif line and family is not None:
                family[1].append(_labelled(line, process))
    lines = [line for head, samples in families.values() for line in (*head, *samples)]
    return ("\n".join(lines) + "\n").encode()


def _labelled(sample: str, process: str) -> str:
    """`name{a="b"} 1` -> `name{process="0",a="b"} 1`; `name 1` -> `name{process="0"} 1`."""
    brace, space = sample.find("{"), sample.find(" ")
    label = f'process="{process}"'
    if 0 <= brace < space or (brace >= 0 and space < 0):
        rest = sample[brace + 1 :]
        return f"{sample[: brace + 1]}{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:space]}{{{label}}}{sample[space:]}"
