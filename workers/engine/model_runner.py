"""Runs one scheduled step on the model: flattens the chunks, runs the forward pass, samples.

The runner owns the model, the attention backend and the paged KV cache. It knows nothing about
which blocks belong to whom beyond what each ScheduledChunk says; allocation is the block manager's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from workers.engine import decode_graphs
from workers.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    BackendUnavailableError,
    TritonBackend,
    build_metadata,
    choose_backend,
)
from workers.engine.batch import ScheduledChunk, StepOutput, sample_slots
from workers.engine.decode_graphs import DecodeGraphs
from workers.engine.model import LlamaForCausalLM, ModelConfig
from workers.engine.sampler import sample


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def num_blocks_for_budget(budget_bytes: int, config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """How many KV blocks fit in `budget_bytes`."""
    return budget_bytes // (kv_bytes_per_token(config, dtype) * block_size)


def default_num_threads() -> int:
    """The cores this process may run on (a container's CPU set, not the host's core count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class ModelRunner:
    """Executes steps for one model on one device.

    backend: None or "auto" (flash-attn where it can run, else the Triton kernels on CUDA, else SDPA),
    or one of them by name (refused with the reason when it cannot run); `attention_reason` says why
    the one chosen was. cuda_graphs: None replays decode steps from CUDA graphs wherever they can be
    captured (decode_graphs.py), for batches of up to max_num_seqs; True insists (refused with the
    reason where they cannot), False keeps every step eager; `graphs_reason` says which and why.
    num_threads sets torch's CPU threads for the whole
    process; several workers sharing a host should split its cores between them rather than each
    take all (OpenMP threads that outnumber free cores slow every matmul down many times over).
    generator: the source of randomness for requests without a seed.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int = 16,
        backend: str | None = None,
        num_threads: int | None = None,
        generator: torch.Generator | None = None,
        cuda_graphs: bool | None = None,
        max_num_seqs: int = 256,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks and block_size >= 1, got {num_blocks} and {block_size}")
        self.model = model
        self.config = model.config
        weight = model.model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type == "cpu":
            torch.set_num_threads(num_threads or default_num_threads())
        self.num_blocks = num_blocks
        self.block_size = block_size
        choice = choose_backend(backend, device=self.device, dtype=self.dtype, block_size=block_size)
        self.attention: AttentionBackend = choice.backend
        self.attention_reason = choice.reason
        self.generator = generator
        c = self.config
        # One allocation for the whole cache: [layers, K/V, blocks, block_size, kv_heads, head_dim].
        # Zeroed, not empty: padded slots are masked, but a NaN there would still leak through 0 * NaN.
        self.kv_cache = torch.zeros(
            (c.num_layers, 2, num_blocks, block_size, c.num_kv_heads, c.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self._layer_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        # Called with every step about to run: expert parallelism (expert_parallel.py) sends it to the
        # other ranks, which must run the same forward for their experts' share of it.
        self.on_step: Callable[[Sequence[ScheduledChunk]], None] | None = None
        self.decode_graphs: DecodeGraphs | None = None
        self.graphs_reason = self._capture_decode_graphs(cuda_graphs, max_num_seqs)

    def _capture_decode_graphs(self, wanted: bool | None, max_num_seqs: int) -> str:
        if wanted is False:
            return "decode runs eager: CUDA graphs were turned off"
        reasons = decode_graphs.unavailable_reasons(self.model, self.attention, self.device)
        if reasons and wanted:
            raise BackendUnavailableError("decode CUDA graphs cannot be captured: " + "; ".join(reasons))
        if reasons:
            return "decode runs eager: " + "; ".join(reasons)
        sizes = decode_graphs.batch_sizes_for(max_num_seqs)
        self.decode_graphs = self.build_decode_graphs(sizes, capture=True)
        return f"decode replays CUDA graphs captured at batch sizes {', '.join(map(str, sizes))}"

    def build_decode_graphs(
        self, batch_sizes: Sequence[int], *, capture: bool, max_context: int | None = None
    ) -> DecodeGraphs:
        """Decode graphs over this runner's model and cache, for contexts up to max_context (default:
        what the model and the pool allow). capture=False: the padded steps alone, as the CPU tests run
        them."""
        if not isinstance(self.attention, TritonBackend):
            raise BackendUnavailableError(f"decode graphs need the triton backend, not {self.attention.name}")
        limit = min(self.config.max_context_len, self.num_blocks * self.block_size)
        return DecodeGraphs(
            self.model,
            self.attention,
            self._layer_caches,
            block_size=self.block_size,
            max_context=max_context or limit,
            batch_sizes=batch_sizes,
            capture=capture,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.config, self.dtype)

    # -- blocks as bytes, for KV moved between workers (workers.kv_transfer.KVStore) ---------------

    @property
    def kv_layout(self) -> str:
        """One block's bytes: [layers, K/V, block_size, kv_heads, head_dim] of the cache dtype."""
        c = self.config
        return f"{self.dtype}[{c.num_layers},2,{self.block_size},{c.num_kv_heads},{c.head_dim}]"

    @property
    def kv_block_bytes(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def staging(self, num_bytes: int) -> memoryview:
        """Host memory a transfer lands in; pinned on CUDA, so that the copy to the device is a DMA."""
        pinned = self.device.type == "cuda"
        return memoryview(torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned).numpy())

    def read_blocks(self, blocks: list[int]) -> memoryview:
        """The blocks' K and V as [layers, K/V, blocks, block_size, kv_heads, head_dim] (the cache's
        own order, so one gather is the only copy), in host memory (pinned on CUDA)."""
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        data = self.kv_cache.index_select(2, index)
        if self.device.type == "cuda":
            host = torch.empty(data.shape, dtype=self.dtype, pin_memory=True)
            data = host.copy_(data)
        return memoryview(data.view(torch.uint8).numpy()).cast("B")

    def write_blocks(self, blocks: list[int], data: memoryview) -> None:
        """Copy read_blocks' bytes of as many blocks into `blocks`."""
        c = self.config
        shape = (c.num_layers, 2, len(blocks), self.block_size, c.num_kv_heads, c.head_dim)
        host = torch.frombuffer(data, dtype=torch.uint8).view(self.dtype).view(shape)
        index = torch.tensor(blocks, dtype=torch.int64, device=self.device)
        self.kv_cache.index_copy_(2, index, host.to(self.device, non_blocking=True))

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[StepOutput]:
        """Run a step; one StepOutput per sample slot (a chunk with sample=True, then its forks)."""
        logits = self._run(chunks)
        slots = sample_slots(chunks)
        if not slots:
            return []
        if len(slots) > logits.shape[0]:
            # Forks sample from their parent's row: repeat it once per fork (a few rows of a vocab).
            rows = torch.tensor([s.row for s in slots], dtype=torch.int64, device=logits.device)
            logits = logits.index_select(0, rows)
        tokens = sample(logits, [s.sampling for s in slots], [s.num_generated for s in slots], self.generator)
        return [
            StepOutput(s.seq_id, t.token_id, t.logprob, t.top_logprobs)
            for s, t in zip(slots, tokens, strict=True)
        ]

    def compute_logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run a step (KV written as in execute) and return the fp32 last-position logits of the chunks
        that sample, [num_sampled, vocab], instead of sampling them."""
        return self._run(chunks)

    @torch.inference_mode()
    def _run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        if not chunks:
            return torch.empty(0, self.config.vocab_size)
        max_len = self.config.max_context_len
        for c in chunks:
            if c.start_pos + len(c.token_ids) > max_len:
                raise ValueError(f"sequence {c.seq_id} would exceed the model's {max_len}-token context")
        if self.on_step is not None:
            self.on_step(chunks)
        elif self.decode_graphs is not None and self.decode_graphs.covers(chunks):
            return self.decode_graphs.run(chunks)
        meta = build_metadata(
            [c.start_pos for c in chunks],
            [len(c.token_ids) for c in chunks],
            [c.block_table for c in chunks],
            self.block_size,
            self.num_blocks,
            self.device,
        )
        input_ids = torch.tensor(
            [t for c in chunks for t in c.token_ids], dtype=torch.int64, device=self.device
        )
        attention = self.attention.prepare(meta, self.config.head_dim**-0.5)
        hidden = self.model(input_ids, meta.positions, attention, self._layer_caches)
        if self.model.routing is not None:
            self.model.routing.end_step()
        last_rows = _last_rows(meta, [c.sample for c in chunks])
        return self.model.compute_logits(hidden.index_select(0, last_rows.to(self.device)))


def _last_rows(meta: AttentionMetadata, sample: Sequence[bool]) -> torch.Tensor:
    """Rows of the flattened batch holding the last token of each sampling chunk."""
    rows, end = [], 0
    for q_len, wanted in zip(meta.query_lens, sample, strict=True):
        end += q_len
        if wanted:
            rows.append(end - 1)
    return torch.tensor(rows, dtype=torch.int64)
