"""The engine against HF transformers on the same model and machine, side by side in one run.

(a) A Poisson stream of requests (random token prompts and fixed output lengths, EOS ignored so
    every system does the same work) through prefixgate's engine, HF `generate` in static
    batches, and HF's own continuous batching: useful output tokens/s and mean TTFT.
(b) TTFT of a long prompt whose prefix is cached, as a fraction of the same prompt cold.
(c) KV bytes allocated per live token: the paged pool vs a contiguous cache sized for the
    workload's longest sequence.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from bench.report import bar_panels, format_table, write_json
from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.llm import load
from workers.engine.loader import LoadedModel
from workers.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    arrival_s: float
    prompt: list[int]
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Result:
    tokens_per_s: float
    ttft_mean_s: float
    elapsed_s: float

    def summary(self) -> dict[str, float]:
        return {
            "tokens_per_s": self.tokens_per_s,
            "ttft_mean_s": self.ttft_mean_s,
            "elapsed_s": self.elapsed_s,
        }


def workload(
    n: int,
    rate: float,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int,
    seed: int = 0,
) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    requests = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(*prompt_range))]
        requests.append(Request(t, prompt, rng.randint(*output_range)))
        t += rng.expovariate(rate)
    return requests


def sleep_until(start: float, offset: float) -> None:
    delay = start + offset - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_engine(
    loaded: LoadedModel, requests: list[Request], config: EngineConfig
) -> tuple[Result, dict[str, float]]:
    """Requests join the running batch as they arrive. Also returns the mean, over steps, of KV bytes
    allocated per live token: the paged pool's, and a contiguous cache's that reserves the
    workload's longest sequence for every running request."""
    engine = Engine(loaded, config)
    token_bytes = engine.runner.kv_bytes_per_token
    longest = max(len(r.prompt) + r.output_tokens for r in requests)
    pending = list(requests)
    first_token: dict[int, float] = {}
    arrival: dict[int, float] = {}
    produced = 0
    paged, contiguous = [], []
    start = time.perf_counter()
    with tqdm(total=len(requests), desc="prefixgate engine", leave=False) as bar:
        while pending or engine.has_work():
            now = time.perf_counter() - start
            while pending and pending[0].arrival_s <= now:
                r = pending.pop(0)
                rid = engine.add_request(
                    r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
                )
                arrival[rid] = r.arrival_s
            if not engine.has_work():
                sleep_until(start, pending[0].arrival_s)
                continue
            outputs = engine.step()
            t = time.perf_counter() - start
            running = engine.scheduler.running
            live = sum(s.num_computed_tokens for s in running)
            if live:
                used = engine.block_manager.num_used_blocks * config.block_size
                paged.append(used * token_bytes / live)
                contiguous.append(len(running) * longest * token_bytes / live)
            for out in outputs:
                produced += len(out.new_token_ids)
                first_token.setdefault(out.request_id, t)
                if out.finished:
                    bar.update()
    elapsed = time.perf_counter() - start
    ttft = statistics.fmean(first_token[i] - arrival[i] for i in arrival)
    kv = {"paged": statistics.fmean(paged), "contiguous": statistics.fmean(contiguous)}
    return Result(produced / elapsed, ttft, elapsed), kv


class _FirstToken:
    """A generate() streamer that notes when the first generated tokens come out (its second put)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf_static(model: Any, requests: list[Request], batch_size: int, pad_id: int) -> Result:
    """Batches of `batch_size` in arrival order, each starting once its last request has arrived and
    the previous batch is done; left-padded, generating to the batch's longest output."""
    start = time.perf_counter()
    ttfts = []
    produced = 0
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    for batch in tqdm(batches, desc="HF static", leave=False):
        sleep_until(start, batch[-1].arrival_s)
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[pad_id] * (width - len(r.prompt)) + r.prompt for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
        longest = max(r.output_tokens for r in batch)
        streamer = _FirstToken()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
                streamer=streamer,
            )
        first = (streamer.at or time.perf_counter()) - start
        ttfts += [first - r.arrival_s for r in batch]
        produced += sum(r.output_tokens for r in batch)
    elapsed = time.perf_counter() - start
    return Result(produced / elapsed, statistics.fmean(ttfts), elapsed)


def run_hf_continuous(
    model: Any,
    requests: list[Request],
    max_batch_tokens: int,
    max_requests: int,
    num_blocks: int,
    block_size: int,
) -> Result:
    """HF's continuous batching manager, sized explicitly, fed at the requests' arrival times."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    manager = model.init_continuous_batching(
        generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=max(r.output_tokens for r in requests)
        ),
        continuous_batching_config=ContinuousBatchingConfig(
            page_size=block_size,
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests,
        ),
    )
    manager.start()
    start = time.perf_counter()
    arrival = {}
    try:
        for i, r in enumerate(requests):
            sleep_until(start, r.arrival_s)
            rid = manager.add_request(
                r.prompt,
                request_id=f"r{i}",
                max_new_tokens=r.output_tokens,
                record_timestamps=True,
                eos_token_id=-1,
            )
            arrival[rid] = time.perf_counter()
        results = []
        with tqdm(total=len(requests), desc="HF continuous", leave=False) as bar:
            while len(results) < len(requests):
                out = manager.get_result(timeout=600)
                if out is None:
                    raise RuntimeError("HF continuous batching stopped before finishing every request")
                results.append(out)
                bar.update()
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    produced = sum(len(out.generated_tokens) for out in results)
    ttft = statistics.fmean(out.timestamps[0] - arrival[out.request_id] for out in results)
    return Result(produced / elapsed, ttft, elapsed)


def synchronize(loaded: LoadedModel) -> None:
    """Wait for the model's device to finish its queued kernels, so a clock read after is honest."""
    device = next(loaded.model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cached_prefix_ttft(
    loaded: LoadedModel, prompt_tokens: int, cached_tokens: int, repeats: int
) -> tuple[float, float]:
    """Median TTFT of a prompt cold, and with its first `cached_tokens` in the prefix cache (each cold
    run uses a fresh prefix, each warm one re-warms its own)."""
    engine = Engine(loaded, EngineConfig(block_size=16, max_num_batched_tokens=prompt_tokens))
    rng = random.Random(7)
    vocab = loaded.config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int]) -> float:
        engine.add_request(prompt, one)
        synchronize(loaded)
        t = time.perf_counter()
        while engine.has_work():
            engine.step()
        synchronize(loaded)
        return time.perf_counter() - t

    cold, warm = [], []
    for _ in tqdm(range(repeats), desc="cached prefix", leave=False):
        prefix = [rng.randrange(vocab) for _ in range(cached_tokens)]
        tail = [rng.randrange(vocab) for _ in range(prompt_tokens - cached_tokens)]
        cold.append(ttft(prefix + tail))
        ttft([*prefix, 1])
        warm.append(ttft(prefix + [rng.randrange(vocab) for _ in range(prompt_tokens - cached_tokens)]))
    return statistics.median(cold), statistics.median(warm)


def decode_step_ms(
    loaded: LoadedModel,
    backend: str,
    batch: int,
    context: int,
    steps: int,
    block_size: int = 16,
    cuda_graphs: bool | None = None,
) -> float:
    """Median milliseconds of an engine step in which `batch` sequences of `context` tokens each decode
    one token: the whole step (planning, forward, sampling), as a client's inter-token gap sees it.
    cuda_graphs as EngineConfig's."""
    per_seq = -(-(context + steps + 2) // block_size)
    config = EngineConfig(
        block_size=block_size,
        num_blocks=batch * per_seq + 1,
        max_num_seqs=batch,
        max_num_batched_tokens=8192,
        backend=backend,
        cuda_graphs=cuda_graphs,
    )
    engine = Engine(loaded, config)
    rng = random.Random(11)
    vocab = loaded.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    pending = {engine.add_request(prompt, params) for prompt in prompts}
    while pending:  # prefill until every sequence has its first token
        pending -= {out.request_id for out in engine.step() if out.new_token_ids}
    engine.step()  # the first all-decode step (allocator, kernel compilation)
    times = []
    for _ in range(steps):
        synchronize(loaded)
        t = time.perf_counter()
        engine.step()
        synchronize(loaded)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    loaded = load(args.model)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    hf = AutoModelForCausalLM.from_pretrained(str(loaded.path), dtype=torch.float32).eval()
    requests = workload(
        args.requests,
        args.rate,
        (args.min_prompt, args.max_prompt),
        (args.min_output, args.max_output),
        loaded.config.vocab_size,
    )
    longest = max(len(r.prompt) + r.output_tokens for r in requests)
    config = EngineConfig(
        block_size=16, max_num_batched_tokens=args.max_batch_tokens, max_num_seqs=args.requests
    )
    engine, kv = run_engine(loaded, requests, config)
    pad = loaded.tokenizer.special_token_id("pad_token")
    pad = 0 if pad is None else pad
    static = run_hf_static(hf, requests, args.static_batch, pad)
    blocks = -(-longest // 16) * args.requests
    continuous = run_hf_continuous(hf, requests, args.max_batch_tokens, args.requests, blocks, 16)
    cold, warm = cached_prefix_ttft(loaded, args.prefix_prompt, args.prefix_cached, args.prefix_repeats)
    ratio = warm / cold
    payload = {
        "engine": engine.summary(),
        "hf_static": static.summary(),
        "hf_continuous": continuous.summary(),
        "cached_prefix_ttft_ratio": ratio,
        "kv_bytes_per_token": kv,
        "workload": {
            "requests": args.requests,
            "rate": args.rate,
            "prompt": [args.min_prompt, args.max_prompt],
            "output": [args.min_output, args.max_output],
            "threads": torch.get_num_threads(),
        },
    }
    rows = [
        [
            name,
            payload[key]["tokens_per_s"],
            payload[key]["ttft_mean_s"],
            payload[key]["elapsed_s"],
            payload[key]["tokens_per_s"] / static.tokens_per_s,
        ]
        for name, key in (
            ("prefixgate engine", "engine"),
            (f"HF generate, static batches of {args.static_batch}", "hf_static"),
            ("HF continuous batching", "hf_continuous"),
        )
    ]
    title = (
        f"engine vs HF transformers: {loaded.name}, {args.requests} requests at {args.rate}/s (Poisson), "
        f"prompts {args.min_prompt}-{args.max_prompt}, outputs {args.min_output}-{args.max_output}, "
        f"{torch.get_num_threads()} threads"
    )
    print(format_table(title, ["system", "output tok/s", "TTFT mean s", "elapsed s", "x HF static"], rows))
    print(
        f"cached prefix: TTFT of a {args.prefix_prompt}-token prompt with {args.prefix_cached} cached = "
        f"{ratio:.1%} of cold"
    )
    print(
        f"KV bytes per live token: paged {kv['paged']:,.0f}, contiguous (sized for {longest} tokens) "
        f"{kv['contiguous']:,.0f}"
    )
    if args.json:
        write_json(args.json, payload)
        bar_panels(
            args.json.rsplit(".", 1)[0] + ".png",
            "engine vs HF transformers",
            [
                (
                    "output tokens/s",
                    {
                        "prefixgate": engine.tokens_per_s,
                        "HF static": static.tokens_per_s,
                        "HF continuous": continuous.tokens_per_s,
                    },
                ),
                (
                    "TTFT mean (s)",
                    {
                        "prefixgate": engine.ttft_mean_s,
                        "HF static": static.ttft_mean_s,
                        "HF continuous": continuous.ttft_mean_s,
                    },
                ),
                ("KV bytes / live token", payload["kv_bytes_per_token"]),
            ],
        )
    return payload


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    parser.add_argument("--min-prompt", type=int, default=64)
    parser.add_argument("--max-prompt", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--static-batch", type=int, default=8)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--prefix-prompt", type=int, default=2000)
    parser.add_argument("--prefix-cached", type=int, default=1900)
    parser.add_argument("--prefix-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
