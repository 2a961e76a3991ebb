"""`prefixgate worker`: one bundled worker process (engine + HTTP server + KV events) from its flags.

Assembly is split so that other engines and transports slot in without touching the rest:
`build_engine` makes the engine from the flags (the model, or with `--sim` the simulated engine),
`build_worker` wraps it with its event log, and `extra_contexts` lists the app's extra start-up
contexts (with `--redis`, the publisher of the registry entry, KV events and load; with
`--kv-events-zmq`, the publisher of KV events in vLLM's wire format). Heavy imports
(torch, the model) happen only when a worker runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import socket
from typing import TYPE_CHECKING

from protocol.disaggregation import ROLES
from protocol.serving import EVENT_LOOPS
from protocol.transfer_auth import SECRET_ENV, parse_secret
from workers.kv_handoff import DEFAULT_ROOM_WAIT_S, DEFAULT_TRANSFER_TIMEOUT_S

if TYPE_CHECKING:
    from workers.app_state import Context
    from workers.bundled_worker import Worker
    from workers.engine.engine_core import Engine, EngineConfig
    from workers.kv_event_log import KVEventLog
    from workers.sim.sim_engine import SimEngine
    from workers.sim.word_tokenizer import WordTokenizer

DEFAULT_PORT = 8101
DEFAULT_BLOCK_SIZE = 16
# Bind-all addresses: a worker bound to one of these must advertise a name others can reach.
_ANY_HOST = ("", "0.0.0.0", "::")
SIM_BACKEND = "sim"
SIM_BACKEND_REASON = "--sim: a cost model stands in for the model, there is no attention to run"
# What a simulated worker reads text prompts with: nothing (token ids only), or words as tokens.
SIM_TOKENIZERS = ("none", "words")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """A byte count: plain, or with a binary suffix (512M, 2G, 1.5GiB)."""
    match = _SIZE.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte count: {text!r} (try 268435456, 256M or 2G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    value = int(number * 1024 ** " kmgt".index(unit or " "))
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a byte count must be positive, got {text!r}")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text!r}")
    return value


def _zmq_endpoint(text: str) -> str:
    from protocol.vllm_kv_events import check_endpoint

    try:
        return check_endpoint(text, bind=True)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} {error}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF safetensors folder or .gguf file (default: SmolLM2)"
    )
    parser.add_argument(
        "--prepare",
        action="store_true",
        help="convert the model to the cache (a .gguf, once) and exit: what a fleet launcher or an image "
        "build runs before starting workers",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument(
        "--listen-fd",
        type=int,
        default=None,
        help="serve on this inherited, listening socket (bound by a parent such as `prefixgate up` "
        "to --port) instead of binding one",
    )
    parser.add_argument("--id", dest="worker_id", default=None, help="worker id (default: HOST:PORT)")
    parser.add_argument(
        "--block-size",
        type=_positive,
        default=None,
        help=f"tokens per KV block (default {DEFAULT_BLOCK_SIZE}, or the --sim profile's)",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=_positive, default=None, help="KV pool size in blocks")
    pool.add_argument("--kv-memory", type=parse_bytes, default=None, help="KV pool size in bytes (256M, 2G)")
    parser.add_argument("--max-waiting", type=_positive, default=256, help="queued requests before 429")
    parser.add_argument("--max-body", type=parse_bytes, default=8 * 2**20, help="largest request body (8M)")
    parser.add_argument("--max-num-seqs", type=_positive, default=64, help="sequences in the running batch")
    parser.add_argument("--max-batched-tokens", type=_positive, default=2048, help="token budget per step")
    parser.add_argument(
        "--backend",
        choices=("auto", "torch_sdpa", "flash_attn", "triton"),
        default="auto",
        help="attention: auto picks flash-attn, else Triton on CUDA, else SDPA (the log and /health say why)",
    )
    parser.add_argument(
        "--cuda-graphs",
        choices=("auto", "on", "off"),
        default="auto",
        help="decode steps replayed from CUDA graphs: auto where they can be captured (CUDA, Triton "
        "attention, a dense model), on to insist, off for eager steps (the log and /health say which)",
    )
    parser.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:1, ...")
    parser.add_argument("--threads", type=_positive, default=None, help="torch CPU threads")
    parser.add_argument(
        "--expert-parallel",
        type=_positive,
        default=1,
        metavar="N",
        help="a mixture-of-experts model's experts split over N processes (gloo, CPU); --threads is per rank",
    )
    parser.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="auto: uvloop when installed (the fast extra)",
    )
    parser.add_argument("--log-level", default="INFO")
    pd = parser.add_argument_group("prefill/decode disaggregation")
    pd.add_argument(
        "--role",
        choices=ROLES,
        default="mixed",
        help="what the gateway sends here: whole requests (mixed), prompts to compute and push to a "
        "decode worker (prefill), or requests whose prompt KV is pulled from a prefill worker (decode)",
    )
    pd.add_argument(
        "--kv-transfer-port",
        type=int,
        default=0,
        help="TCP port prefill workers push KV to (decode role; default: any free port)",
    )
    pd.add_argument(
        "--kv-transfer-timeout",
        type=_seconds,
        default=DEFAULT_TRANSFER_TIMEOUT_S,
        help="the most seconds a pull from a prefill worker may take before the prompt is computed here "
        "(its deadline scales with the blocks moved: 5 s plus 0.25 s a block, up to this)",
    )
    pd.add_argument(
        "--kv-room-wait",
        type=_seconds,
        default=DEFAULT_ROOM_WAIT_S,
        help="seconds a decode worker waits for KV room to receive a prompt into before computing it here",
    )
    pd.add_argument(
        "--transfer-secret",
        default=None,
        metavar="SECRET",
        help=f"the fleet's KV transfer secret, shared with its gateway and the other workers (default: "
        f"${SECRET_ENV}, which keeps it out of the process list); without one a prefill or decode "
        "worker refuses disaggregated requests",
    )
    sim = parser.add_argument_group("simulated engine")
    sim.add_argument(
        "--sim",
        action="store_true",
        help="serve a cost model instead of a model (prompts as token ids, or as text with --sim-tokenizer)",
    )
    sim.add_argument(
        "--sim-profile",
        default="cpu-smollm2",
        help="built-in profile (cpu-smollm2, h100-8b) or a calibrated .json; its pool and batch limits apply",
    )
    sim.add_argument(
        "--sim-tokenizer",
        choices=SIM_TOKENIZERS,
        default="none",
        help="how text prompts are read: not at all (none: token ids only), or one token per "
        "whitespace-separated word (words: usage and KV blocks count words, a unit of its own)",
    )
    redis = parser.add_argument_group("shared state in Redis")
    redis.add_argument("--redis", default=None, metavar="URL", help="publish registry, KV events and load")
    redis.add_argument(
        "--advertise-url", default=None, metavar="URL", help="the URL gateways use (default http://HOST:PORT)"
    )
    redis.add_argument("--heartbeat", type=_seconds, default=1.0, help="registry heartbeat period (s)")
    redis.add_argument("--load-period", type=_seconds, default=0.2, help="load report period (s)")
    redis.add_argument(
        "--stream-maxlen", type=_positive, default=10_000, help="KV event batches the stream keeps (about)"
    )
    zmq = parser.add_argument_group("KV events in vLLM's wire format")
    zmq.add_argument(
        "--kv-events-zmq",
        type=_zmq_endpoint,
        default=None,
        metavar="ADDR",
        help="publish KV events as vLLM does (ZMQ PUB bound to tcp://HOST:PORT or ipc://PATH)",
    )
    zmq.add_argument(
        "--kv-events-replay",
        type=_zmq_endpoint,
        default=None,
        metavar="ADDR",
        help="the replay (ROUTER) socket (default: the --kv-events-zmq host, port + 1)",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    from workers.engine.engine_core import EngineConfig

    memory = {} if args.kv_memory is None else {"kv_memory_bytes": args.kv_memory}
    return EngineConfig(
        block_size=args.block_size or DEFAULT_BLOCK_SIZE,
        num_blocks=args.num_blocks,
        max_num_batched_tokens=args.max_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        backend=args.backend,
        cuda_graphs={"auto": None, "on": True, "off": False}[args.cuda_graphs],
        num_threads=args.threads,
        **memory,
    )


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def sim_engine(args: argparse.Namespace, events: KVEventLog) -> SimEngine:
    """The --sim engine: the profile as given, but with the pool the flags ask for, if they do."""
    from workers.sim.profiles import get_profile
    from workers.sim.sim_engine import SimEngine

    if args.kv_memory is not None:
        raise SystemExit(
            "prefixgate worker: --kv-memory does not apply to --sim; size its pool with --num-blocks"
        )
    try:
        profile = get_profile(args.sim_profile)
    except ValueError as error:
        raise SystemExit(f"prefixgate worker: {error}") from None
    block_size = args.block_size or profile.block_size
    capacity = profile.kv_capacity_tokens if args.num_blocks is None else args.num_blocks * block_size
    profile = dataclasses.replace(profile, block_size=block_size, kv_capacity_tokens=capacity)
    return SimEngine(profile, **events.callbacks())


def build_engine(args: argparse.Namespace, events: KVEventLog) -> tuple[Engine | SimEngine, str, str]:
    """The engine the flags describe, wired to `events`, and its attention backend's name and why it
    is the one (and whether decode steps replay CUDA graphs), for the log and /health."""
    if args.sim:
        return sim_engine(args, events), SIM_BACKEND, SIM_BACKEND_REASON
    if args.expert_parallel > 1:
        engine = _expert_parallel_engine(args, events)
    else:
        from workers.engine.engine_core import Engine
        from workers.engine.llm import load

        model = load(args.model, device=_device(args.device))
        engine = Engine(model, engine_config(args), **events.callbacks())
    runner = engine.runner
    return engine, runner.attention.name, f"{runner.attention_reason}; {runner.graphs_reason}"


def _expert_parallel_engine(args: argparse.Namespace, events: KVEventLog) -> Engine:
    """Rank 0's engine; the other ranks are daemonic processes that end with this one."""
    from workers.engine.expert_parallel import ExpertParallelGroup
    from workers.engine.model import UnsupportedModelError

    if args.role == "decode" or _device(args.device) != "cpu":
        raise SystemExit(
            "prefixgate worker: --expert-parallel runs on the CPU only, and not in the decode role (KV "
            "pulled into rank 0's cache would not reach the other ranks)"
        )
    try:
        group = ExpertParallelGroup.start(
            args.model,
            args.expert_parallel,
            engine_config(args),
            threads=args.threads or 1,
            **events.callbacks(),
        )
    except UnsupportedModelError as error:
        raise SystemExit(f"prefixgate worker: {error}") from None
    return group.engine


def sim_tokenizer(name: str, vocab_size: int) -> WordTokenizer | None:
    """The --sim-tokenizer named, over the simulated engine's vocabulary (none: None)."""
    if name == "none":
        return None
    from workers.sim.word_tokenizer import WordTokenizer

    return WordTokenizer(vocab_size)


def build_worker(args: argparse.Namespace) -> Worker:
    from workers.bundled_worker import Worker
    from workers.kv_event_log import KVEventLog

    # vLLM's events carry each stored block's tokens, which the log keeps only for that publisher.
    events = KVEventLog(keep_tokens=args.kv_events_zmq is not None)
    if args.sim_tokenizer != "none" and not args.sim:
        raise SystemExit("prefixgate worker: --sim-tokenizer is for --sim; a model brings its own tokenizer")
    engine, backend, reason = build_engine(args, events)
    worker_id = args.worker_id or f"{socket.gethostname()}:{args.port}"
    tokenizer = sim_tokenizer(args.sim_tokenizer, engine.vocab_size) if args.sim else None
    return Worker.around(
        engine,
        events,
        worker_id=worker_id,
        backend=backend,
        backend_reason=reason,
        role=args.role,
        tokenizer=tokenizer,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body,
        transfer_port=args.kv_transfer_port,
        transfer_host=_reachable_host(args),
        transfer_timeout_s=args.kv_transfer_timeout,
        room_wait_s=args.kv_room_wait,
        transfer_secret=transfer_secret(args),
    )


def transfer_secret(args: argparse.Namespace) -> bytes | None:
    """--transfer-secret, else the environment's; one too short to be safe stops the worker."""
    try:
        return parse_secret(args.transfer_secret or os.environ.get(SECRET_ENV))
    except ValueError as error:
        raise SystemExit(f"prefixgate worker: {error}") from None


def _reachable_host(args: argparse.Namespace) -> str:
    """The host others reach this worker at: the one it listens on, or its name when that is any."""
    return socket.gethostname() if args.host in _ANY_HOST else args.host


def advertise_url(args: argparse.Namespace) -> str:
    if args.advertise_url:
        return args.advertise_url.rstrip("/")
    host = _reachable_host(args)
    return f"http://[{host}]:{args.port}" if ":" in host else f"http://{host}:{args.port}"


def extra_contexts(args: argparse.Namespace) -> list[Context]:
    """Start-up contexts beyond the HTTP API: the Redis publisher, when --redis is given, and the
    vLLM-format ZMQ publisher, when --kv-events-zmq is."""
    contexts: list[Context] = []
    if args.redis is not None:
        from workers.redis_publisher import PublisherConfig, redis_context

        config = PublisherConfig(
            redis_url=args.redis,
            advertise_url=advertise_url(args),
            heartbeat_s=args.heartbeat,
            load_period_s=args.load_period,
            stream_maxlen=args.stream_maxlen,
        )
        contexts.append(redis_context(config))
    if args.kv_events_zmq is not None:
        from protocol.vllm_kv_events import default_replay_endpoint
        from workers.zmq_publisher import ZmqPublisherConfig, zmq_context

        replay = args.kv_events_replay or default_replay_endpoint(args.kv_events_zmq)
        contexts.append(zmq_context(ZmqPublisherConfig(args.kv_events_zmq, replay)))
    return contexts


def run(args: argparse.Namespace) -> int:
    from protocol.serving import serve
    from workers.worker_app import create_app

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.prepare:
        from workers.engine.loader import model_folder

        folder, name = model_folder(args.model)
        print(f"{name}: {folder}")
        return 0
    worker = build_worker(args)
    app = create_app(worker, contexts=extra_contexts(args))
    if args.listen_fd is None:
        serve(app, args.event_loop, host=args.host, port=args.port)
    else:
        serve(app, args.event_loop, sock=socket.socket(fileno=args.listen_fd))
    return 0
