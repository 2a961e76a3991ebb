"""protocol.cpuinfo: fields of the first processor, and nothing where the file says nothing."""

from __future__ import annotations

from pathlib import Path

from protocol.cpuinfo import cpuinfo_field

TWO_CPUS = (
    "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n\n"
    "processor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n"
)


def test_the_first_processors_field_is_read(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(TWO_CPUS)
    assert cpuinfo_field("model name", path) == "AMD EPYC"
    assert cpuinfo_field("flags", path) == "fpu avx2"


def test_an_absent_field_or_file_is_none(tmp_path: Path) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(TWO_CPUS)
    assert cpuinfo_field("microcode", path) is None
    assert cpuinfo_field("model name", tmp_path / "absent") is None
