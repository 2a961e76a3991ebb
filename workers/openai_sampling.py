"""An OpenAI request's knobs as the engine's SamplingParams, with the context window checked against
the real prompt length (known only once the prompt is tokenized)."""

from __future__ import annotations

from protocol.errors import ApiError
from protocol.openai_api import DEFAULT_COMPLETION_MAX_TOKENS, GenerationRequest, ServedModel
from workers.engine.sampling_params import SamplingParams


def sampling_params(
    request: GenerationRequest, prompt_len: int, model: ServedModel, block_size: int = 1
) -> SamplingParams:
    """The engine's parameters, with the context window checked against the real prompt length.

    `block_size` is the KV pool's: a default max_tokens sized to the pool leaves room for all n
    choices at once, as the engine requires of a request (Scheduler.add).
    """
    window = model.max_context_len
    param = "messages" if request.chat else "prompt"
    if prompt_len >= window:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens, but this model's context window is {window} tokens "
            "(and it must leave room for at least one generated token)",
            param=param,
            code="context_length_exceeded",
        )
    max_tokens = request.max_tokens
    if max_tokens is None:
        room = window - prompt_len
        default = room if request.chat else DEFAULT_COMPLETION_MAX_TOKENS
        max_tokens = max(1, min(default, room, _pool_room(model, prompt_len, request.n, block_size)))
    elif prompt_len + max_tokens > window:
        raise ApiError(
            400,
            f"this model's context window is {window} tokens, but the request needs "
            f"{prompt_len + max_tokens} ({prompt_len} in the prompt + {max_tokens} max_tokens)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        stop=request.stop,
        ignore_eos=request.ignore_eos,
        logprobs=request.logprobs,
    )


def _pool_room(model: ServedModel, prompt_len: int, n: int, block_size: int) -> int:
    """The most tokens each of `n` choices can be given with all of them in the KV pool at once: the
    prompt's full blocks are shared, and each choice holds its own blocks from the prompt's partial
    last one on (for n=1: the pool less the prompt)."""
    shared, tail = divmod(prompt_len, block_size)
    per_choice = (model.kv_capacity_tokens // block_size - shared) // n
    return block_size * per_choice - tail
