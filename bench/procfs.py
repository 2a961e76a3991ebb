"""What Linux's /proc says a process costs (CPU seconds, resident and peak memory): the one reader of
those numbers for the benchmarks (soak's RSS trend, overhead's CPU per request, chaos's memory bound)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

KIB = 1024


@dataclass(frozen=True, slots=True)
class ProcStat:
    cpu_s: float  # user + system, all threads
    rss_bytes: int
    peak_rss_bytes: int


def _status_bytes(pid: int, key: str) -> int:
    """One memory line of /proc/PID/status (in kB there), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * KIB
    raise RuntimeError(f"/proc/{pid}/status has no {key} line: is the process a zombie?")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process now (VmRSS)."""
    return _status_bytes(pid, "VmRSS")


def cpu_s(pid: int) -> float:
    """CPU seconds a process has used, user and system, all its threads (/proc/PID/stat)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 onward
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> set[int]:
    """The processes whose parent is `pid` now (a `serve --workers N` gateway's processes)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # it exited while we looked
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == pid:
            found.add(int(entry))
    return found


def group_cpu_s(pid: int) -> float:
    """CPU seconds of a process and its children now (those that exited are not counted)."""
    return _group_sum(pid, cpu_s)


def group_peak_rss_bytes(pid: int) -> int:
    """The peak resident memory (VmHWM) of a process and of each of its children, summed."""
    return int(_group_sum(pid, lambda p: _status_bytes(p, "VmHWM")))


def _group_sum(pid: int, read: Callable[[int], float]) -> float:
    total = read(pid)
    for child in child_pids(pid):
        try:
            total += read(child)
        except (OSError, RuntimeError):  # it exited while we looked
            continue
    return total


def proc_stat(pid: int) -> ProcStat:
    """CPU seconds and memory (now and at its peak, VmHWM) of a process."""
    return ProcStat(cpu_s(pid), rss_bytes(pid), _status_bytes(pid, "VmHWM"))


def own_cpu_s() -> float:
    """CPU seconds this process has used, user and system."""
    times = os.times()
    return times.user + times.system
