"""`prefixgate bench cuda-check`: the engine on a CUDA device, in the few minutes a GPU is lent for.

The model is one of SmolLM2-135M's shape (or any HF folder's config) with random weights, built on
the spot: a GPU host here can be sent a config and a tokenizer, not hundreds of MB of weights. That
is enough for what the check is for: that the engine's CUDA path computes what HF transformers
computes (greedy tokens in fp32), how fast it generates in bf16 against HF `generate`, what a
cached prefix saves in TTFT there, and how long a decode step takes on each attention backend.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.engine import cached_prefix_ttft, decode_step_ms, synchronize
from bench.report import bar_panels, format_table, write_json
from protocol.models import default_gguf_path
from workers.engine.attention import BackendUnavailableError
from workers.engine.attention.flash_attn import FLASH_BLOCK_MULTIPLE
from workers.engine.engine import Engine, EngineConfig
from workers.engine.loader import LoadedModel, convert_gguf, load_tokenizer, load_weights
from workers.engine.sampling_params import SamplingParams

# The files of a model folder besides its weights: what a random model of that shape needs.
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CHECK_PROMPT_LENS = (5, 17, 33, 64, 100, 7, 48, 250)
CHECK_NEW_TOKENS = 16
# The backends whose decode steps are timed on a GPU; on the CPU only SDPA runs natively.
CUDA_BACKENDS = ("torch_sdpa", "triton", "flash_attn")
# Per backend: milliseconds per decode step at each batch size, or why the backend cannot run.
DecodeTimings = dict[str, dict[int, float] | str]


def random_model(shape_from: Path, folder: Path, seed: int) -> Any:
    """An HF Llama with `shape_from`'s config and tokenizer and random weights, saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    for name in FOLDER_FILES:
        if (shape_from / name).is_file():
            shutil.copy(shape_from / name, folder / name)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(LlamaConfig.from_pretrained(shape_from)).eval()
    hf.save_pretrained(folder)
    return hf


def loaded(folder: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    model = load_weights(folder, dtype=dtype, device=device)
    return LoadedModel(model, load_tokenizer(folder), folder.name, model.config, folder)


@dataclass(frozen=True, slots=True)
class Generated:
    tokens: list[list[int]]
    seconds: float
    steps: int
    backend: str


def generate(
    model: LoadedModel, prompts: list[list[int]], new_tokens: int, config: EngineConfig
) -> Generated:
    """Greedy outputs of the engine for every prompt, and the time and steps they took."""
    engine = Engine(model, config)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    synchronize(model)
    start = time.perf_counter()
    steps = 0
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        steps += 1
    synchronize(model)
    seconds = time.perf_counter() - start
    return Generated([tokens[i] for i in ids], seconds, steps, engine.runner.attention.name)


def hf_greedy(hf: Any, prompt: list[int], new_tokens: int, device: str) -> list[int]:
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt], device=device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


def decode_steps(model: LoadedModel, device: str, args: argparse.Namespace) -> DecodeTimings:
    """flash-attn gets its own block size (its paged API's multiple); the others, the engine's default."""
    names = CUDA_BACKENDS if device.startswith("cuda") else CUDA_BACKENDS[:1]
    timings: DecodeTimings = {}
    for name in names:
        block_size = FLASH_BLOCK_MULTIPLE if name == "flash_attn" else 16
        try:
            timings[name] = {
                batch: decode_step_ms(model, name, batch, args.decode_context, args.decode_steps, block_size)
                for batch in args.decode_batches
            }
        except BackendUnavailableError as error:
            timings[name] = str(error)
    return timings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shape-from",
        default=None,
        help="HF folder whose config and tokenizer the random model takes (default: SmolLM2-135M's)",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, ... (cpu only to try the check)")
    parser.add_argument("--requests", type=int, default=128, help="requests of the throughput run")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--output", type=int, default=128, help="output tokens per request")
    parser.add_argument("--hf-batch", type=int, default=64, help="HF generate's batch size")
    parser.add_argument("--prefix-prompt", type=int, default=2000)
    parser.add_argument("--prefix-cached", type=int, default=1984)
    parser.add_argument("--prefix-repeats", type=int, default=3)
    parser.add_argument(
        "--decode-batches",
        type=lambda text: [int(b) for b in text.split(",")],
        default=[1, 16, 64, 256],
        help="batch sizes whose decode step is timed per backend, comma-separated",
    )
    parser.add_argument("--decode-context", type=int, default=1024, help="tokens of context per sequence")
    parser.add_argument("--decode-steps", type=int, default=10, help="timed steps per batch size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)


def run(args: argparse.Namespace) -> dict:
    device = args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "prefixgate bench cuda-check: no CUDA device here (torch.cuda.is_available() is False)"
        )
    shape_from = Path(args.shape_from) if args.shape_from else convert_gguf(default_gguf_path())
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="prefixgate-cuda-check-") as tmp:
        folder = Path(tmp) / f"random-{shape_from.name}"
        hf = random_model(shape_from, folder, args.seed).to(device)
        fp32 = loaded(folder, torch.float32, device)
        vocab = fp32.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in CHECK_PROMPT_LENS]
        check = generate(fp32, prompts, CHECK_NEW_TOKENS, EngineConfig(block_size=16, num_blocks=512))
        expected = [hf_greedy(hf, p, CHECK_NEW_TOKENS, device) for p in prompts]
        matches = sum(e == g for e, g in zip(expected, check.tokens, strict=True))
        del fp32

        bf16 = loaded(folder, torch.bfloat16, device)
        batch = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.requests)]
        blocks = args.requests * (-(-(args.prompt + args.output) // 16)) + 64
        config = EngineConfig(
            block_size=16, num_blocks=blocks, max_num_seqs=args.requests, max_num_batched_tokens=8192
        )
        generate(bf16, batch[:4], 8, config)  # warm-up
        timed = generate(bf16, batch, args.output, config)
        hf = hf.to(torch.bfloat16)
        hf_greedy(hf, batch[0], 8, device)  # warm-up
        synchronize(bf16)
        start = time.perf_counter()
        for first in range(0, args.requests, args.hf_batch):
            with torch.no_grad():
                hf.generate(
                    torch.tensor(batch[first : first + args.hf_batch], device=device),
                    max_new_tokens=args.output,
                    min_new_tokens=args.output,
                    do_sample=False,
                )
        synchronize(bf16)
        hf_s = time.perf_counter() - start
        cold, warm = cached_prefix_ttft(bf16, args.prefix_prompt, args.prefix_cached, args.prefix_repeats)
        prefix = {
            "prompt_tokens": args.prefix_prompt,
            "cached_tokens": args.prefix_cached,
            "cold_s": cold,
            "cached_s": warm,
        }
        decode = decode_steps(bf16, device, args)
    generated = args.requests * args.output
    payload = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "model": f"random weights, the shape of {shape_from.name}",
        "backend": check.backend,
        "greedy_match_fp32": {"matched": matches, "prompts": len(prompts), "new_tokens": CHECK_NEW_TOKENS},
        "throughput_bf16": {
            "requests": args.requests,
            "prompt": args.prompt,
            "output": args.output,
            "engine_s": timed.seconds,
            "engine_steps": timed.steps,
            "engine_out_tok_s": generated / timed.seconds,
            "hf_generate_s": hf_s,
            "hf_generate_batch": args.hf_batch,
            "hf_generate_out_tok_s": generated / hf_s,
        },
        "prefix_ttft_bf16": prefix,
        "decode_step_ms_bf16": {"context": args.decode_context, "backends": decode},
    }
    t = payload["throughput_bf16"]
    print(
        format_table(
            f"engine on {payload['device']} ({check.backend}), {payload['model']}",
            ["check", "result"],
            [
                ["greedy tokens = HF generate (fp32)", f"{matches} of {len(prompts)} prompts"],
                [
                    f"output tok/s, {args.requests} x ({args.prompt} in, {args.output} out), bf16",
                    f"engine {t['engine_out_tok_s']:.0f}, HF generate (batches of {args.hf_batch}) "
                    f"{t['hf_generate_out_tok_s']:.0f}",
                ],
                [
                    f"TTFT of {prefix['prompt_tokens']} tokens, bf16",
                    f"cold {prefix['cold_s'] * 1e3:.1f} ms, {prefix['cached_tokens']} cached "
                    f"{prefix['cached_s'] * 1e3:.1f} ms",
                ],
                *(
                    [
                        f"decode step ms, batch {batch} x {args.decode_context} tokens, bf16",
                        ", ".join(
                            f"{name} {ms[batch]:.2f}" if isinstance(ms, dict) else f"{name} cannot run"
                            for name, ms in decode.items()
                        ),
                    ]
                    for batch in args.decode_batches
                ),
            ],
        )
    )
    if args.json:
        write_json(args.json, payload)
        bar_panels(
            Path(args.json).with_suffix(".png"),
            f"engine on {payload['device']}: {payload['model']}",
            [
                (
                    "output tokens/s (bf16)",
                    {"engine": t["engine_out_tok_s"], "HF generate": t["hf_generate_out_tok_s"]},
                ),
                (
                    "TTFT ms (bf16)",
                    {"cold": prefix["cold_s"] * 1e3, "prefix cached": prefix["cached_s"] * 1e3},
                ),
            ],
        )
    return payload
