"""Decode steps replayed from CUDA graphs, one captured per batch size of a ladder.

A decode step of a small model is launch-bound: a few kernels per layer, each done in microseconds,
each costing the host as long to launch. A CUDA graph records the whole forward, embedding to logits,
once per batch size; a step then copies its inputs into the buffers the graph reads, pads the batch
up to the next captured size, and launches the lot as one.

What makes a step replayable: every tensor the kernels read lives at a fixed address (the buffers
below), and no launch depends on the step's values. The Triton decode launch is planned once for the
longest context the buffers hold (TritonBackend.prepare_decodes). Pad rows write their K/V to slot -1,
which the store kernel skips, and attend over whatever stale position and block table their row holds
(always valid ids); their logits are dropped.

Prefill and mixed steps stay eager (their shapes change every step); so do mixture-of-experts models,
whose expert grouping is shaped by the gate's choices.

capture=False runs the same padded step without capturing it: that is how the CPU tests check the
buffers and the padding, with the Triton kernels in their interpreter. Capture and replay need CUDA.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from workers.engine.attention import AttentionBackend, TritonBackend
from workers.engine.batch import ScheduledChunk
from workers.engine.model import LlamaForCausalLM

BATCH_LADDER = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def batch_sizes_for(max_num_seqs: int) -> tuple[int, ...]:
    """The ladder up to the first size that holds max_num_seqs decodes."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = [b for b in BATCH_LADDER if b < max_num_seqs]
    return (*sizes, next((b for b in BATCH_LADDER if b >= max_num_seqs), max_num_seqs))


def unavailable_reasons(
    model: LlamaForCausalLM, attention: AttentionBackend, device: torch.device
) -> list[str]:
    """What stops decode graphs here, if anything, in words for the log and an error message."""
    reasons = []
    if device.type != "cuda":
        reasons.append(f"CUDA graphs need a CUDA device, and the model is on {device.type}")
    if not isinstance(attention, TritonBackend):
        reasons.append(
            f"decode graphs are captured over the Triton kernels, and attention is {attention.name}"
        )
    if model.routing is not None:
        reasons.append("a mixture-of-experts layer groups tokens by expert in shapes the gate decides")
    return reasons


class DecodeGraphs:
    """The decode step at each of `batch_sizes`, over sequences of at most `max_context` tokens."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        attention: TritonBackend,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_context: int,
        batch_sizes: Sequence[int],
        capture: bool,
    ) -> None:
        if not batch_sizes or list(batch_sizes) != sorted(set(batch_sizes)) or batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes must be distinct, ascending and positive, got {batch_sizes}")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_context = max_context
        self.batch_sizes = tuple(batch_sizes)
        self.max_blocks = -(-max_context // block_size)
        device = model.model.embed_tokens.weight.device
        largest = self.batch_sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(largest, self.max_blocks, dtype=torch.int32, device=device)
        # Decode work items (sequence, row, position, 1 token): only the position changes per step.
        rows = torch.arange(largest, dtype=torch.int32)
        self.items = torch.stack([rows, rows, torch.zeros_like(rows), torch.ones_like(rows)], 1).to(device)
        scale = model.config.head_dim**-0.5
        self._steps = {
            b: attention.prepare_decodes(
                self.items[:b], self.slot_mapping[:b], self.block_tables[:b], block_size, max_context, scale
            )
            for b in self.batch_sizes
        }
        # Batch size -> its graph and the logits [batch, vocab] each replay writes.
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture(device)

    def covers(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A step of single-token chunks (decodes) that the buffers hold."""
        return (
            0 < len(chunks) <= self.batch_sizes[-1]
            and all(len(c.token_ids) == 1 for c in chunks)
            and max(c.start_pos for c in chunks) < self.max_context
            and max(len(c.block_table) for c in chunks) <= self.max_blocks
        )

    @torch.inference_mode()
    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Write the chunks' K/V and return the fp32 logits of those that sample, [num_sampled, vocab]:
        a view of the graph's output, valid until the next run (graphs share one memory pool)."""
        n = len(chunks)
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        positions = torch.tensor([c.start_pos for c in chunks], dtype=torch.int64)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.tensor(
            [c.block_table + [0] * (width - len(c.block_table)) for c in chunks], dtype=torch.int32
        )
        blocks = tables.gather(1, (positions // self.block_size)[:, None])[:, 0].to(torch.int64)
        self.input_ids[:n].copy_(torch.tensor([c.token_ids[0] for c in chunks]), non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.items[:n, 2].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(blocks * self.block_size + positions % self.block_size, non_blocking=True)
        # Pad rows must not store: their stale slots may by now belong to another sequence.
        self.slot_mapping[n:batch].fill_(-1)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        if batch in self._graphs:
            graph, logits = self._graphs[batch]
            graph.replay()
        else:
            logits = self._forward(batch)
        sampled = [i for i, c in enumerate(chunks) if c.sample]
        if len(sampled) == n:
            return logits[:n]
        return logits.index_select(0, torch.tensor(sampled, dtype=torch.int64, device=logits.device))

    def _forward(self, batch: int) -> torch.Tensor:
        attention = self._steps[batch]
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], attention, self.kv_caches)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture(self, device: torch.device) -> None:
        """Largest first, all in one memory pool: a smaller graph reuses the larger's activations' memory.
        Every buffer's slots are -1 here, so neither the warm-up nor the capture stores any K/V."""
        pool = None
        for batch in reversed(self.batch_sizes):
            self._forward(batch)  # compiles the kernels and settles the allocator before capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(batch)
            pool = graph.pool()
            self._graphs[batch] = (graph, logits)
        torch.cuda.synchronize(device)
