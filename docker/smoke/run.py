"""`make docker-smoke`: the images built for real, a fleet of them up, one conversation through it.

Builds prefixgate-base:bookworm (docker/bootstrap-base.sh, cached), the wheelhouse (docker/wheelhouse.sh)
and the four images compose runs, then starts docker/smoke/compose.yaml (host networking, loopback
ports), waits for the gateway to be ready, sends a chat and a second turn that extends it and checks
that the second reused the first's KV (`usage.prompt_tokens_details.cached_tokens`), checks that
Prometheus scrapes the gateway (its HTTP API), and takes the fleet down. Prints the time of each step
and the images' sizes. Needs root's Docker engine; reaches no registry.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlencode

import httpx

from bench.probes import get_json, wait_for

ROOT = Path(__file__).resolve().parents[2]
SMOKE = Path(__file__).resolve().parent
PROJECT = "prefixgate-smoke"
GATEWAY = "http://127.0.0.1:18000"
PROMETHEUS = "http://127.0.0.1:19090"
MODEL = "SmolLM2-135M-Instruct"
GATEWAY_UP = 'up{job="prefixgate-gateway"}'
IMAGES = {
    "prefixgate-gateway": "docker/Dockerfile.gateway",
    "prefixgate-worker": "docker/Dockerfile.worker",
    "prefixgate-redis": "docker/Dockerfile.redis",
    "prefixgate-prometheus": "docker/Dockerfile.prometheus",
}


def docker() -> str:
    """A `docker` that builds with BuildKit: the one on PATH when it has buildx, else Debian's
    docker.io client, whose engine-side BuildKit needs no plugin."""
    if subprocess.run(["docker", "buildx", "version"], capture_output=True).returncode == 0:
        return "docker"
    for candidate in ("/usr/bin/docker", shutil.which("docker")):
        if candidate and Path(candidate).exists():
            return candidate
    sys.exit("no docker client: apt-get install docker.io")


def compose() -> list[str]:
    """Compose v2 (`docker compose`) where installed, else Debian's docker-compose."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    sys.exit("no compose: apt-get install docker-compose")


def step(name: str, action: Callable[[], object]) -> None:
    start = time.monotonic()
    action()
    print(f"== {name}: {time.monotonic() - start:.1f} s", flush=True)


def run(*args: str, **env: str) -> None:
    subprocess.run(args, cwd=ROOT, check=True, env={**os.environ, **env})


def build_images() -> None:
    client = docker()
    for image, dockerfile in IMAGES.items():
        step(
            f"build {image}",
            lambda image=image, dockerfile=dockerfile: run(
                client,
                "build",
                "--network",
                "host",
                "-f",
                dockerfile,
                "-t",
                f"{image}:latest",
                ".",
                DOCKER_BUILDKIT="1",
            ),
        )


def chat(messages: list[dict[str, str]]) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    response = httpx.post(f"{GATEWAY}/v1/chat/completions", json=body, timeout=120)
    response.raise_for_status()
    return response.json()


def conversation() -> None:
    first = [
        {"role": "system", "content": "You are a terse assistant who answers in one sentence. " * 8},
        {"role": "user", "content": "Name three colours of the rainbow."},
    ]
    answer = chat(first)
    second = [
        *first,
        {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And three more?"},
    ]
    usage = chat(second)["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    print(f"second turn: {usage['prompt_tokens']} prompt tokens, {cached} of them cached")
    if not cached:
        raise AssertionError(f"the second turn reused no KV from the first: {usage}")


def gateway_ready() -> bool:
    try:
        return httpx.get(f"{GATEWAY}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def gateway_scraped() -> bool:
    body = get_json(f"{PROMETHEUS}/api/v1/query?{urlencode({'query': GATEWAY_UP})}")
    result = body["data"]["result"] if body else []
    return bool(result) and all(series["value"][1] == "1" for series in result)


def gateway_has_no_torch() -> None:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)"
    run("docker", "run", "--rm", "--entrypoint", "python", "prefixgate-gateway:latest", "-c", probe)


def smoke(up: list[str]) -> None:
    step("the gateway image has no torch", gateway_has_no_torch)
    step("compose up", lambda: run(*up, "up", "-d", "--no-build"))
    step("gateway ready", lambda: wait_for(gateway_ready, "a ready gateway", timeout=300, interval=0.5))
    step("two-turn chat", conversation)
    step(
        "prometheus scrapes the gateway",
        lambda: wait_for(gateway_scraped, "Prometheus to scrape the gateway", timeout=60, interval=0.5),
    )


def main() -> None:
    started = time.monotonic()
    step("base image", lambda: run("docker/bootstrap-base.sh"))
    step("wheelhouse", lambda: run("docker/wheelhouse.sh", PYTHON=sys.executable))
    build_images()
    up = [*compose(), "-p", PROJECT, "-f", str(SMOKE / "compose.yaml")]
    try:
        smoke(up)
    except Exception:
        subprocess.run([*up, "logs", "--tail", "40"], cwd=ROOT)
        raise
    finally:
        step("compose down", lambda: run(*up, "down", "--volumes", "--remove-orphans"))
    subprocess.run(["docker", "image", "ls", "prefixgate-*"], check=True)
    print(f"docker-smoke passed in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
