"""Simulated engine profiles for tests."""

from __future__ import annotations

import dataclasses

from workers.sim.profiles import CPU_SMOLLM2

# The CPU SmolLM2 profile on a small pool (64 blocks of 16 tokens) and small batches: tests fill it fast.
SMALL = dataclasses.replace(
    CPU_SMOLLM2, kv_capacity_tokens=64 * 16, max_num_batched_tokens=96, max_num_seqs=8, max_context_len=1024
)
