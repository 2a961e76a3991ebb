"""`prefixgate up`: the local fleet — a gateway and N SmolLM2 workers on this machine — answering.

The workers are child processes (each its own engine and torch threads, as in production); the
gateway runs in this process. After start-up it sends two chat requests through the official
`openai` client that share a long system prompt: the first shows where it went, the second that the
gateway sent it to the replica already holding that prefix, and how many tokens came from the cache.
With `--prefill N` the first N workers are prefill workers and the rest decode workers: the first
request's prompt is computed on a prefill worker and its KV moved to the decode worker that answers;
the pairs authenticate with a transfer secret `up` makes for the fleet (or the one already in
$PREFIXGATE_TRANSFER_SECRET), which the workers inherit and the gateway reads from there.

The workers are started, awaited and stopped by the local fleet harness (bench.local_fleet), with
their output on this terminal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator

from aiohttp import web
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from bench.local_fleet import Child, cli, spawn, stop, transfer_secret, wait_healthy
from gateway.gateway_config import GatewayConfig, parse_config
from gateway.http.app import create_app
from gateway.http.keys import STATE
from protocol.disaggregation import TRANSFERRED_TOKENS_HEADER
from protocol.transfer_auth import SECRET_ENV

SYSTEM_PROMPT = (
    "You are the support assistant of a small bicycle shop in Lyon. The shop sells city bikes, "
    "folding bikes and cargo bikes, repairs every brand, and rents bikes by the day. Opening hours "
    "are 9:00 to 19:00 from Tuesday to Saturday. A standard service costs 60 euros and takes two "
    "days; a flat tyre is fixed while the customer waits. Answer in one or two short sentences, "
    "politely, and never invent prices or services that are not listed here."
)
QUESTIONS = ("When are you open?", "How much does a standard service cost?")
# A SmolLM2 worker's graceful stop (its server's, then its engine's) is given this long before SIGKILL.
STOP_TIMEOUT_S = 15.0

console = Console()


def listen(host: str, port: int) -> socket.socket:
    """A listening socket bound now (port 0: one the OS picks). Binding every port before anything
    starts, and handing the sockets over, leaves no window in which another process takes a port
    that was free when it was chosen, and a busy port fails at once rather than after model loading."""
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as error:
        raise SystemExit(f"prefixgate up: cannot listen on {host}:{port}: {error.strerror}") from error
    sock.set_inheritable(True)
    return sock


def _bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def _role(args: argparse.Namespace, index: int) -> str:
    if not args.prefill:
        return "mixed"
    return "prefill" if index < args.prefill else "decode"


def _worker_command(args: argparse.Namespace, index: int, sock: socket.socket) -> list[str]:
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    command = cli(
        "worker",
        "--port",
        str(_bound_port(sock)),
        "--listen-fd",
        str(sock.fileno()),
        "--id",
        f"worker-{index}",
        "--role",
        _role(args, index),
        "--threads",
        str(threads),
        "--log-level",
        "WARNING",
    )
    if args.model:
        command += ["--model", args.model]
    if args.redis:
        command += ["--redis", args.redis]
    return command


@contextlib.contextmanager
def start_fleet(args: argparse.Namespace, progress: Progress) -> Iterator[list[Child]]:
    """The workers, each serving on a socket bound here, answering /health when this yields; stopped
    (SIGINT once each, SIGKILL past STOP_TIMEOUT_S) on the way out."""
    socks = [listen("127.0.0.1", args.worker_port and args.worker_port + i) for i in range(args.workers)]
    step = progress.add_task("preparing the model (converted once to ~/.cache/prefixgate)", total=None)
    # Once, before the workers start, so that they do not all convert it at the same time.
    prepare = cli("worker", "--prepare", "--log-level", "WARNING")
    done = subprocess.run(prepare + (["--model", args.model] if args.model else []))
    if done.returncode != 0:
        raise SystemExit(f"prefixgate up: preparing the model failed (status {done.returncode})")
    progress.update(step, description="model ready", completed=1, total=1)
    # Each worker in a session of its own: a terminal's Ctrl-C reaches this process alone, which stops
    # the gateway first and then each worker once (a second SIGINT during a worker's own shutdown
    # would interrupt its exit handlers, and workers gone before the gateway make it log failures).
    workers: list[Child] = []
    try:
        for i, sock in enumerate(socks):
            url = f"http://127.0.0.1:{_bound_port(sock)}"
            command = _worker_command(args, i, sock)
            workers.append(
                spawn(f"worker-{i}", command, url, None, pass_fds=(sock.fileno(),), new_session=True)
            )
        # The workers hold their sockets now; this process's copies would only keep the ports open.
        for sock in socks:
            sock.close()
        step = progress.add_task(f"starting {args.workers} workers", total=None)
        try:
            wait_healthy(workers, args.start_timeout)
        except RuntimeError as error:
            raise SystemExit(f"prefixgate up: {error}") from None
        urls = ", ".join(w.url for w in workers)
        progress.update(step, description=f"{args.workers} workers up: {urls}", completed=1, total=1)
        yield workers
    finally:
        stop(workers, STOP_TIMEOUT_S)


def gateway_config(args: argparse.Namespace, urls: list[str]) -> GatewayConfig:
    data: dict[str, object] = {
        "listen": {"host": args.host, "port": args.port},
        "replicas": [{"url": u} for u in urls],
        "routing": {"policy": args.policy},
    }
    if args.prefill:
        # The demo's prompts are short: pair them anyway, so that the transfer shows.
        data["routing"] = {"policy": args.policy, "pd": {"min_transfer_tokens": 1}}
    if args.redis:
        data["redis"] = {"url": args.redis}
    return parse_config(data)


def first_requests(base_url: str) -> list[dict[str, object]]:
    """Two chats sharing the system prompt, through the official client; what each one showed."""
    import openai

    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=os.environ.get("PREFIXGATE_API_KEY", "none"))
    model = client.models.list().data[0].id
    shown = []
    for question in QUESTIONS:
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
            max_tokens=48,
            temperature=0,
        )
        reply = raw.parse()
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage and usage.prompt_tokens_details else 0
        shown.append(
            {
                "question": question,
                "answer": reply.choices[0].message.content,
                "replica": raw.headers.get("x-prefixgate-replica"),
                "prompt_tokens": usage.prompt_tokens if usage else 0,
                "cached_tokens": cached or 0,
                "prefill": raw.headers.get("x-prefixgate-prefill-replica"),
                "transferred": int(raw.headers.get(TRANSFERRED_TOKENS_HEADER, "0")),
            }
        )
        line = shown[-1]
        console.print(
            f"[bold]Q:[/bold] {question}\n[bold]A:[/bold] {line['answer']}\n"
            f"   served by [cyan]{line['replica']}[/cyan], "
            f"{line['cached_tokens']} of {line['prompt_tokens']} prompt tokens from its cache"
        )
        if line["prefill"]:
            console.print(
                f"   prompt computed by [cyan]{line['prefill']}[/cyan], "
                f"{line['transferred']} tokens of KV moved to {line['replica']}"
            )
    return shown


async def _serve(
    args: argparse.Namespace, sock: socket.socket, urls: list[str], progress: Progress
) -> list[dict[str, object]]:
    app = create_app(gateway_config(args, urls))
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    base = f"http://{args.host}:{_bound_port(sock)}"
    # Installed before anything is shown, so that no Ctrl-C falls between the banner and the handler
    # (asyncio's own would cancel the task mid-await); one during the first requests stops after them.
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    try:
        step = progress.add_task("gateway: discovering replicas", total=None)
        state = app[STATE]
        while len(state.replicas) < len(urls):
            await asyncio.sleep(0.1)
        progress.update(step, description=f"gateway up at {base}", completed=1, total=1)
        progress.stop()
        shown = await asyncio.to_thread(first_requests, base)
        if args.once:
            return shown
        console.print(f"\nServing at {base}/v1 (OpenAI API). Ctrl-C stops the fleet.")
        await stopping.wait()
        return shown
    finally:
        await runner.cleanup()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--prefill",
        type=int,
        default=0,
        help="of the workers, how many are prefill workers, the rest decode workers (default 0: all mixed)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port (0: any free one)")
    parser.add_argument(
        "--worker-port", type=int, default=8101, help="first worker's port, the rest follow (0: any free)"
    )
    parser.add_argument("--model", default=None, help="HF folder or .gguf for the workers (default: SmolLM2)")
    parser.add_argument("--redis", default=None, metavar="URL", help="share state through Redis")
    parser.add_argument("--policy", default="prefix_aware")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--once", action="store_true", help="exit after the first requests")


def share_transfer_secret() -> None:
    """The fleet's KV transfer secret (the environment's, or a fresh one: bench.local_fleet's, which
    `spawn` gives the workers) in this process's environment too, where the gateway
    (auth.transfer_secret_env's default) reads it: never on a command line others can list."""
    os.environ[SECRET_ENV] = transfer_secret()


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.prefill < args.workers:
        console.print(f"prefixgate up: --prefill must be in [0, --workers), got {args.prefill}")
        return 2
    share_transfer_secret()
    gateway_sock = listen(args.host, args.port)
    with (
        Progress(
            SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console
        ) as progress,
        start_fleet(args, progress) as workers,
    ):
        shown = asyncio.run(_serve(args, gateway_sock, [w.url for w in workers], progress))
    hit = shown[-1]
    if hit["cached_tokens"] and hit["replica"] == shown[0]["replica"]:
        console.print(
            f"[green]cache hit:[/green] the second request reused {hit['cached_tokens']} cached tokens"
        )
    return 0
