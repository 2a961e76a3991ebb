"""Expert parallelism: a MoE model's experts sharded over N processes, attention replicated.

In docs/design.md §6's terms: the worker (rank 0) keeps everything a worker has — HTTP server, scheduler,
block manager, sampler — and its ModelRunner sends every step it is about to run (the flattened chunks: token
ids, positions, block tables) to ranks 1..N-1 (`broadcast_object_list`). Every rank runs the same
forward over the same tokens with a full copy of attention and its own paged KV cache, written
identically, because the schedule is rank 0's; each holds only E/N experts of every MoE layer
(`ExpertShard`, a contiguous run, so the checkpoint's expert e lives on rank e // (E/N)).

Per MoE layer (`AllToAllDispatch`) each rank is responsible for a 1/N slice of the step's tokens, as
it would be with data-parallel attention:
  1. dispatch: the slice's (token, top-k slot) rows, sorted by expert and so grouped by destination
     rank, go to the ranks holding their experts (`all_to_all_single`);
  2. each rank runs its experts over the rows it received (grouped by expert, one matmul each);
  3. combine: the outputs go back the way they came (`all_to_all_single`) and are weighted by the gate
     and summed per token;
  4. attention is replicated, so the next layer needs every token's output on every rank: the slices
     are gathered (`all_gather`).
The gate is computed on every rank for all tokens (a [hidden x E] matmul, cheap), so the split sizes
of both exchanges are known locally and no count exchange is needed. Experts see their rows in token
order, and tokens' slots are summed in slot order, exactly as in the single-process model, so
the outputs are the same with any number of ranks.

With attention replicated the dispatch sends rows the receiver already has; it is kept because it is
the data flow of expert parallelism proper (where each rank's attention holds different sequences),
and its cost is what the `bench ep` benchmark measures. The cheaper layout for replicated attention
(each rank computes its experts over all tokens, then one all-reduce) is not implemented.

Processes: `start` spawns ranks 1..N-1 (torch.multiprocessing, spawn, daemonic: they die with the
worker), rendezvous over tcp://127.0.0.1 on a free port, gloo on the CPU. Only the CPU ran here: on
CUDA the same code would use NCCL with one device per rank, which was not run or tested.
KV written into rank 0's cache from outside a step (prefill/decode disaggregation's decode role)
would not reach the other ranks, so that role is refused with expert parallelism.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from protocol.loopback_ports import free_port
from workers.engine.batch import ScheduledChunk
from workers.engine.engine_core import Engine, EngineConfig
from workers.engine.loader import load_model, load_weights, model_folder, read_config
from workers.engine.model import LlamaForCausalLM, UnsupportedModelError
from workers.engine.model.moe import ExpertBank, ExpertShard, combine
from workers.engine.model_runner import ModelRunner

# Ranks wait for rank 0's next step for as long as the worker is idle: collectives must not time out.
_GROUP_TIMEOUT = timedelta(days=365)


@dataclass(slots=True)
class ExchangeTimes:
    """Seconds this rank spent in each exchange (including waiting for slower ranks), for `bench ep`."""

    all_to_all: float = 0.0
    all_gather: float = 0.0
    # Rows this rank's experts computed, one entry per MoE layer call.
    rows_computed: list[int] = field(default_factory=list)


class AllToAllDispatch:
    """The MoE block's dispatch (moe.Dispatch) across the ranks of the default process group."""

    def __init__(self, shard: ExpertShard, num_experts: int, times: ExchangeTimes) -> None:
        self.shard = shard
        self.num_experts = num_experts
        self.per_rank = num_experts // shard.size
        self.times = times

    def __call__(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: ExpertBank
    ) -> tuple[torch.Tensor, torch.Tensor]:
        size, rank, k = self.shard.size, self.shard.rank, expert_ids.shape[1]
        slices = torch.arange(x.shape[0]).tensor_split(size)
        # counts[s, e]: rows of rank s's token slice routed to expert e.
        counts = torch.stack(
            [torch.bincount(expert_ids[s].reshape(-1), minlength=self.num_experts) for s in slices]
        )
        mine = slices[rank]
        flat = expert_ids[mine].reshape(-1)
        order = torch.argsort(flat, stable=True)
        rows = mine.repeat_interleave(k).index_select(0, order)
        send = x.index_select(0, rows)
        send_splits = counts[rank].view(size, self.per_rank).sum(1).tolist()
        received_counts = counts[:, experts.global_ids.start : experts.global_ids.stop]
        recv_splits = received_counts.sum(1).tolist()
        received = self._all_to_all(send, recv_splits, send_splits)
        local_ids = torch.arange(self.per_rank).repeat(size).repeat_interleave(received_counts.reshape(-1))
        self.times.rows_computed.append(received.shape[0])
        back = self._all_to_all(experts(received, local_ids), send_splits, recv_splits)
        slot_out = torch.empty_like(back).index_copy_(0, order, back)
        out = combine(slot_out.view(len(mine), k, x.shape[1]), weights[mine])
        return self._gather(out, [len(s) for s in slices]), counts.sum(0)

    def _all_to_all(self, send: torch.Tensor, recv_splits: list[int], send_splits: list[int]) -> torch.Tensor:
        received = send.new_empty((sum(recv_splits), send.shape[1]))
        start = time.perf_counter()
        dist.all_to_all_single(received, send, recv_splits, send_splits)
        self.times.all_to_all += time.perf_counter() - start
        return received

    def _gather(self, out: torch.Tensor, lens: list[int]) -> torch.Tensor:
        """Every rank's slice of outputs, in token order (padded to one size: all_gather needs it)."""
        padded = out.new_zeros((lens[0], out.shape[1]))
        padded[: out.shape[0]] = out
        parts = [torch.empty_like(padded) for _ in lens]
        start = time.perf_counter()
        dist.all_gather(parts, padded)
        self.times.all_gather += time.perf_counter() - start
        return torch.cat([part[:n] for part, n in zip(parts, lens, strict=True)])


def shard_model(model: LlamaForCausalLM) -> ExchangeTimes:
    """Route `model`'s MoE layers through the process group; the exchange timings it will record."""
    moe = model.config.moe
    assert moe is not None, "ExpertParallelGroup.start checks the model is MoE"
    times = ExchangeTimes()
    for block in model.moe_blocks():
        block.dispatch = AllToAllDispatch(model.shard, moe.num_experts, times)
    return times


def _join(rank: int, size: int, port: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size, timeout=_GROUP_TIMEOUT
    )


def _follower(rank: int, size: int, port: int, folder: str, threads: int) -> None:
    """Ranks 1..N-1: run every step rank 0 sends, for their experts, until it sends None or goes away."""
    torch.set_num_threads(threads)
    # Joined before loading, so that a rank failing to load breaks rank 0's first step, not its start.
    _join(rank, size, port)
    model = load_weights(folder, shard=ExpertShard(rank, size))
    shard_model(model)
    setup: list[object] = [None]
    dist.broadcast_object_list(setup, src=0)
    num_blocks, block_size = setup[0]  # type: ignore[misc]
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, num_threads=threads)
    try:
        while True:
            step: list[object] = [None]
            dist.broadcast_object_list(step, src=0)
            if step[0] is None:
                # Every rank has the word before any leaves (a broadcast may relay through peers).
                dist.barrier()
                break
            runner.compute_logits(step[0])  # type: ignore[arg-type]
    except RuntimeError:
        pass  # rank 0 went away (its connection closed): there is no one left to serve
    # Out without tearing the group down: gloo's teardown races the peers closing theirs and can abort
    # the process (seen as exit status -6); the OS closes the sockets either way.
    sys.stderr.flush()
    os._exit(0)


class ExpertParallelGroup:
    """Rank 0's side: the other ranks' processes, and the engine whose steps they mirror."""

    def __init__(self, engine: Engine, processes: list[mp.Process], times: ExchangeTimes) -> None:
        self.engine = engine
        self.processes = processes
        self.times = times

    @classmethod
    def start(
        cls,
        source: str | Path,
        size: int,
        config: EngineConfig,
        *,
        name: str | None = None,
        threads: int = 1,
        **engine_kwargs: object,
    ) -> ExpertParallelGroup:
        """Spawn ranks 1..size-1, load rank 0's share of `source` (a HF safetensors folder) and build
        its Engine; `engine_kwargs` go to Engine (the KV-event callbacks)."""
        folder, _ = model_folder(source)
        moe = read_config(folder).moe
        if moe is None:
            raise UnsupportedModelError(f"expert parallelism needs a mixture-of-experts model, not {folder}")
        # Refuses expert counts that do not split evenly before any process starts.
        ExpertShard(0, size).experts(moe.num_experts)
        port, context = free_port(), mp.get_context("spawn")
        processes = [
            context.Process(target=_follower, args=(rank, size, port, str(folder), threads), daemon=True)
            for rank in range(1, size)
        ]
        for process in processes:
            process.start()
        _join(0, size, port)
        loaded = load_model(folder, name=name, shard=ExpertShard(0, size))
        times = shard_model(loaded.model)
        engine = Engine(loaded, config, **engine_kwargs)  # type: ignore[arg-type]
        runner: ModelRunner = engine.runner  # type: ignore[assignment]
        dist.broadcast_object_list([(runner.num_blocks, runner.block_size)], src=0)
        runner.on_step = _broadcast_step
        return cls(engine, processes, times)

    def close(self) -> None:
        """Stop the other ranks; call it with no step running (the engine loop stopped)."""
        dist.broadcast_object_list([None], src=0)
        dist.barrier()
        for process in self.processes:
            process.join(30)
        dist.destroy_process_group()


def _broadcast_step(chunks: Sequence[ScheduledChunk]) -> None:
    dist.broadcast_object_list([list(chunks)], src=0)
