"""The host's CPU as Linux describes it in /proc/cpuinfo: what a benchmark or a calibration records
of the machine it ran on, and what decides how a CPU engine is started there."""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpuinfo_field(key: str, cpuinfo: Path = CPUINFO) -> str | None:
    """The first processor's `key` ("model name", "flags"), None where it is not given or the file is
    not there (not Linux)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return value.strip()
    return None
