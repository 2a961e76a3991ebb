"""bench.vllm_fleet's pure parts (the servers themselves are tests/gateway/test_real_vllm.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.vllm_fleet import VllmServer, VllmSpec, cpu_has_bfloat16, vllm_command

AVX2_ONLY = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 fma avx f16c avx2\n\n"


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        (AVX2_ONLY, False),
        (AVX2_ONLY.replace("avx2", "avx2 avx512f avx512_bf16"), True),
        (AVX2_ONLY.replace("avx2", "avx2 amx_bf16 amx_tile"), True),
        ("processor\t: 0\n", False),
    ],
)
def test_bfloat16_is_read_off_the_cpu_flags(tmp_path: Path, cpuinfo: str, expected: bool) -> None:
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo)
    assert cpu_has_bfloat16(path) is expected


def test_no_cpuinfo_reads_as_no_bfloat16(tmp_path: Path) -> None:
    assert cpu_has_bfloat16(tmp_path / "absent") is False


def test_servers_run_in_float32_unless_the_cpu_computes_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    server = VllmServer(0, 8000, "ipc:///tmp/e0", "tcp://127.0.0.1:9000")
    for has_bf16 in (False, True):
        monkeypatch.setattr("bench.vllm_fleet.cpu_has_bfloat16", lambda has=has_bf16: has)
        command = vllm_command(Path("python"), VllmSpec(), server, Path("model"))
        assert ("--dtype" in command) is not has_bf16
        if not has_bf16:
            assert command[command.index("--dtype") + 1] == "float32"
