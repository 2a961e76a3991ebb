"""`prefixgate bench cuda-check`: the engine on a CUDA device, in the few minutes a GPU is lent for.

The models are of SmolLM2-135M's and Llama-3.2-1B's shapes (or any HF folder's config) with random
weights, built on the spot: a GPU host here can be sent a config and a tokenizer, not GBs of
weights. (Both take SmolLM2's tokenizer; the 1B keeps its own 128,256-token vocabulary, whose ids past
the tokenizer's decode to nothing.) That is enough for what the check is for: that the engine's CUDA
path computes what HF transformers computes (greedy tokens in fp32), how fast it generates in bf16
against HF `generate`, what a cached prefix saves in TTFT there, and how long a decode step takes on
each attention backend, eager and replayed from CUDA graphs.
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
from tqdm import tqdm

from bench.engine_bench import cached_prefix_ttft, decode_step_ms, synchronize
from bench.report import bar_panels, format_table, write_json
from protocol.models import default_gguf_path
from workers.engine.attention import BackendUnavailableError
from workers.engine.attention.flash_attn import FLASH_BLOCK_MULTIPLE
from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.loader import LoadedModel, convert_gguf, load_tokenizer, load_weights
from workers.engine.sampling_params import SamplingParams

# The files of a model folder besides its weights: what a random model of that shape needs.
FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CHECK_PROMPT_LENS = (5, 17, 33, 64, 100, 7, 48, 250)
CHECK_NEW_TOKENS = 16
# What decode steps are timed on a GPU, by name: the attention backend, and whether decode replays
# CUDA graphs (EngineConfig.cuda_graphs); on the CPU only SDPA runs natively.
CUDA_BACKENDS: dict[str, tuple[str, bool | None]] = {
    "torch_sdpa": ("torch_sdpa", None),
    "triton": ("triton", False),
    "triton+cuda_graphs": ("triton", True),
    "flash_attn": ("flash_attn", None),
}
# Llama-3.2-1B's published config (its HF config.json), for a random model of its shape.
LLAMA_32_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
}
SHAPES = ("smollm2-135m", "llama-3.2-1b")
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


def shape_folder(name: str, smollm2: Path, folder: Path) -> Path:
    """A folder with the config of shape `name` and SmolLM2's tokenizer."""
    if name == "smollm2-135m":
        return smollm2
    if name != "llama-3.2-1b":
        raise SystemExit(
            f"prefixgate bench cuda-check: unknown shape {name!r}; choose from {', '.join(SHAPES)}"
        )
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    for file in FOLDER_FILES[1:]:
        if (smollm2 / file).is_file():
            shutil.copy(smollm2 / file, folder / file)
    LlamaConfig(**LLAMA_32_1B).save_pretrained(folder)
    return folder


def decode_steps(model: LoadedModel, device: str, args: argparse.Namespace) -> DecodeTimings:
    """flash-attn gets its own block size (its paged API's multiple); the others, the engine's default."""
    names = list(CUDA_BACKENDS) if device.startswith("cuda") else ["torch_sdpa"]
    timings: DecodeTimings = {}
    for name in tqdm(names, desc="decode steps", leave=False):
        backend, graphs = CUDA_BACKENDS[name]
        block_size = FLASH_BLOCK_MULTIPLE if backend == "flash_attn" else 16
        try:
            timings[name] = {
                batch: decode_step_ms(
                    model, backend, batch, args.decode_context, args.decode_steps, block_size, graphs
                )
                for batch in args.decode_batches
            }
        except BackendUnavailableError as error:
            timings[name] = str(error)
    return timings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--shapes",
        type=lambda text: text.split(","),
        default=list(SHAPES),
        help=f"model shapes to check, comma-separated, of {', '.join(SHAPES)}",
    )
    parser.add_argument(
        "--shape-from",
        default=None,
        help="instead of --shapes: an HF folder whose config and tokenizer the random model takes",
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:1, ... (cpu only to try the check)")
    parser.add_argument("--requests", type=int, default=256, help="requests of the throughput run")
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
    with tempfile.TemporaryDirectory(prefix="prefixgate-cuda-check-") as tmp:
        if args.shape_from:
            shapes = {Path(args.shape_from).name: Path(args.shape_from)}
        else:
            smollm2 = convert_gguf(default_gguf_path())
            shapes = {name: shape_folder(name, smollm2, Path(tmp) / f"shape-{name}") for name in args.shapes}
        results = {
            name: check_shape(name, folder, Path(tmp) / f"random-{name}", args)
            for name, folder in tqdm(shapes.items(), desc="model shapes")
        }
    payload = {
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else device,
        "torch": torch.__version__,
        "shapes": results,
    }
    rows = [
        [name, check, result] for name, shape in results.items() for check, result in table_rows(shape, args)
    ]
    print(
        format_table(
            f"the engine on {payload['device']}, random weights", ["model shape", "check", "result"], rows
        )
    )
    if args.json:
        write_json(args.json, payload)
        panels = []
        for name, shape in results.items():
            t, prefix = shape["throughput_bf16"], shape["prefix_ttft_bf16"]
            engine = f"engine ({shape['backend']})"
            panels.append(
                (
                    f"{name}: output tok/s",
                    {engine: t["engine_out_tok_s"], "HF generate": t["hf_generate_out_tok_s"]},
                )
            )
            panels.append(
                (
                    f"{name}: TTFT ms",
                    {"cold": prefix["cold_s"] * 1e3, "prefix cached": prefix["cached_s"] * 1e3},
                )
            )
            batch = max(args.decode_batches)
            decode = shape["decode_step_ms_bf16"]["backends"]
            steps = {b: ms[batch] for b, ms in decode.items() if isinstance(ms, dict)}
            panels.append((f"{name}: decode step ms, batch {batch}", steps))
        bar_panels(Path(args.json).with_suffix(".png"), f"the engine on {payload['device']}", panels)
    return payload


def check_shape(name: str, shape_from: Path, folder: Path, args: argparse.Namespace) -> dict:
    """The whole check for one model shape: fp32 tokens against HF, then bf16 speed."""
    device = args.device
    rng = random.Random(args.seed)
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
    del hf
    cold, warm = cached_prefix_ttft(bf16, args.prefix_prompt, args.prefix_cached, args.prefix_repeats)
    generated = args.requests * args.output
    return {
        "model": f"random weights, the shape of {name}",
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
        "prefix_ttft_bf16": {
            "prompt_tokens": args.prefix_prompt,
            "cached_tokens": args.prefix_cached,
            "cold_s": cold,
            "cached_s": warm,
        },
        "decode_step_ms_bf16": {"context": args.decode_context, "backends": decode_steps(bf16, device, args)},
    }


def table_rows(shape: dict, args: argparse.Namespace) -> list[list[str]]:
    check, t, prefix = shape["greedy_match_fp32"], shape["throughput_bf16"], shape["prefix_ttft_bf16"]
    decode = shape["decode_step_ms_bf16"]["backends"]
    return [
        [
            "greedy tokens = HF generate (fp32)",
            f"{check['matched']} of {check['prompts']} prompts ({shape['backend']})",
        ],
        [
            f"output tok/s, {t['requests']} x ({t['prompt']} in, {t['output']} out), bf16",
            f"engine {t['engine_out_tok_s']:.0f}, HF generate (batches of {t['hf_generate_batch']}) "
            f"{t['hf_generate_out_tok_s']:.0f}: {t['engine_out_tok_s'] / t['hf_generate_out_tok_s']:.1f}x",
        ],
        [
            f"TTFT of {prefix['prompt_tokens']} tokens, bf16",
            f"cold {prefix['cold_s'] * 1e3:.1f} ms, {prefix['cached_tokens']} cached "
            f"{prefix['cached_s'] * 1e3:.1f} ms ({prefix['cached_s'] / prefix['cold_s']:.0%} of cold)",
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
    ]
