"""A worker built around an engine (workers.bundled_worker): what it announces comes from the engine,
and a simulated engine, which has no tokenizer and no KV tensors, gets neither."""

from __future__ import annotations

from workers.bundled_worker import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, Worker, WorkerInfo
from workers.kv_event_log import KVEventLog
from workers.kv_transfer import NoKV
from workers.sim.profiles import CPU_SMOLLM2
from workers.sim.runner import VirtualClock
from workers.sim.sim_engine import SimEngine
from workers.sim.word_tokenizer import WordTokenizer


def test_the_served_model_holds_the_whole_kv_pool() -> None:
    info = WorkerInfo("w", "m", block_size=16, num_blocks=10, max_context_len=100, vocab_size=50, backend="b")
    served = info.served_model
    assert (served.name, served.vocab_size, served.max_context_len) == ("m", 50, 100)
    assert served.kv_capacity_tokens == 160
    assert info.role == "mixed" and info.backend_reason == ""


def test_a_worker_around_a_simulated_engine_announces_the_profile() -> None:
    events = KVEventLog()
    sim = SimEngine(CPU_SMOLLM2, clock=VirtualClock(), **events.callbacks())
    worker = Worker.around(sim, events, worker_id="sim-1", backend="sim", role="decode", max_waiting=3)
    try:
        info = worker.info
        assert (info.worker_id, info.model, info.backend, info.role) == (
            "sim-1",
            CPU_SMOLLM2.model_name,
            "sim",
            "decode",
        )
        assert info.vocab_size == CPU_SMOLLM2.vocab_size
        assert (info.block_size, info.num_blocks) == (
            sim.block_manager.block_size,
            sim.block_manager.num_blocks,
        )
        assert info.max_context_len == sim.max_context_len
        assert worker.tokenizer is None and isinstance(worker.store, NoKV)
        assert worker.events is events and worker.max_waiting == 3
        assert worker.max_body_bytes == DEFAULT_MAX_BODY_BYTES and worker.transfer_secret is None
    finally:
        worker.front.shutdown()


def test_a_simulated_engine_may_be_given_a_tokenizer_that_counts_words() -> None:
    events = KVEventLog()
    sim = SimEngine(CPU_SMOLLM2, clock=VirtualClock(), **events.callbacks())
    words = WordTokenizer(CPU_SMOLLM2.vocab_size)
    worker = Worker.around(sim, events, worker_id="sim-2", backend="sim", tokenizer=words)
    try:
        assert worker.tokenizer is words and worker.max_waiting == DEFAULT_MAX_WAITING
    finally:
        worker.front.shutdown()
