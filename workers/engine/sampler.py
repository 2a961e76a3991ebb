"""Next-token choice for the rows of a step that sample, batched across requests.

Seeded requests draw their randomness from a generator of their own, seeded from (seed, tokens
generated so far), and sample by the exponential race (argmax of p / E with E ~ Exp(1), which picks
token i with probability p_i). A row's draw therefore depends on nothing else in the batch: the same
seed and logits give the same token whatever runs beside it. Logprobs are those of the model's own
distribution (before temperature, top-k and top-p), as the OpenAI API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from workers.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


def step_seed(seed: int, num_generated: int) -> int:
    """A well-mixed 64-bit seed per (request seed, step), so neighbouring steps are unrelated."""
    z = (seed * 0x9E3779B97F4A7C15 + num_generated + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    generator: torch.Generator | None = None,
) -> list[SampledToken]:
    """One token per row of `logits` ([rows, vocab]); `generator` serves the unseeded rows."""
    if logits.shape[0] != len(params) or len(params) != len(num_generated):
        raise ValueError("logits, params and num_generated must have one entry per row")
    logits = logits.float()
    tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = torch.tensor(greedy, device=logits.device)
        tokens[rows] = logits.index_select(0, rows).argmax(dim=-1)
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if drawn:
        rows = torch.tensor(drawn, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, rows), [params[i] for i in drawn])
        noise = _exponential_noise(
            probs, [params[i] for i in drawn], [num_generated[i] for i in drawn], generator
        )
        tokens[rows] = (probs / noise).argmax(dim=-1)
    return _with_logprobs(logits, params, tokens.tolist())


def _filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Softmax at each row's temperature, with top-k and top-p applied where asked for."""
    device = logits.device
    temperatures = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    scaled = logits / temperatures[:, None]
    if all(p.top_k == 0 and p.top_p >= 1.0 for p in params):
        return torch.softmax(scaled, dim=-1)
    vocab = scaled.shape[-1]
    # Stable, so equal logits keep index order and top-k 1 picks the token argmax would.
    ordered, order = scaled.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device)[None, :]
    top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
    drop = rank >= top_k[:, None]
    ordered = ordered.masked_fill(drop, float("-inf"))
    # A token stays while the mass strictly before it is under top_p; the first always stays.
    # Rows with top_p 1 skip this, so rounding in the cumulative sum never trims their tail.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device)
    sorted_probs = torch.softmax(ordered, dim=-1)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    ordered = ordered.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
    return torch.softmax(filtered, dim=-1)


def _exponential_noise(
    probs: torch.Tensor,
    params: Sequence[SamplingParams],
    num_generated: Sequence[int],
    generator: torch.Generator | None,
) -> torch.Tensor:
    noise = torch.empty_like(probs)
    unseeded = [row for row, p in enumerate(params) if p.seed is None]
    if unseeded:
        fresh = torch.empty(len(unseeded), probs.shape[-1], device=probs.device)
        fresh.exponential_(generator=generator)
        noise[torch.tensor(unseeded, device=probs.device)] = fresh
    seeded = [
        (row, step_seed(p.seed, n))
        for row, (p, n) in enumerate(zip(params, num_generated, strict=True))
        if p.seed is not None
    ]
    if seeded:
        # Drawn on the host, where a seed gives the same numbers on every device, into one (pinned)
        # buffer that reaches the device in one copy: no sync per seeded row.
        on_host = torch.empty(len(seeded), probs.shape[-1], pin_memory=probs.device.type == "cuda")
        for i, (_, seed) in enumerate(seeded):
            on_host[i].exponential_(generator=torch.Generator(device="cpu").manual_seed(seed))
        rows = torch.tensor([row for row, _ in seeded], device=probs.device)
        noise[rows] = on_host.to(probs.device, non_blocking=True)
    # A zero draw would turn p / E into inf (or nan where p is 0) and pick a token by accident.
    return noise.clamp_min_(torch.finfo(torch.float32).tiny)


def _with_logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: list[int]
) -> list[SampledToken]:
    out = [SampledToken(t) for t in tokens]
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not wanted:
        return out
    device = logits.device
    logprobs = torch.log_softmax(logits.index_select(0, torch.tensor(wanted, device=device)), dim=-1)
    chosen = logprobs.gather(1, torch.tensor([[tokens[i]] for i in wanted], device=device))[:, 0].tolist()
    n_top = max(params[i].logprobs or 0 for i in wanted)
    top_values, top_ids = logprobs.topk(n_top, dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, i in enumerate(wanted):
        k = params[i].logprobs or 0
        out[i] = SampledToken(tokens[i], chosen[j], list(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
    return out
