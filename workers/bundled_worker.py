"""What a bundled worker is before it serves (docs/design.md §4): an engine front, its tokenizer, what
it announces, its KV event log and its serving limits.

Kept apart from the HTTP app so that the command line, the tests and the benchmarks can build a
`Worker` around an engine (real or simulated) without reading how requests are served.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protocol.disaggregation import Role
from protocol.openai_api import ServedModel
from protocol.tokenizer import Tokenizer
from workers.engine.engine_core import Engine
from workers.engine.llm import AsyncLLM
from workers.kv_event_log import KVEventLog
from workers.kv_handoff import DEFAULT_ROOM_WAIT_S, DEFAULT_TRANSFER_TIMEOUT_S
from workers.kv_transfer import KVStore, NoKV

if TYPE_CHECKING:
    from workers.sim.sim_engine import SimEngine
    from workers.sim.word_tokenizer import WordTokenizer

DEFAULT_MAX_WAITING = 256
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """What the worker announces (/health, and the registry entry another transport publishes)."""

    worker_id: str
    model: str
    block_size: int
    num_blocks: int
    max_context_len: int
    vocab_size: int
    backend: str
    # Why that backend (the log and /health say it: "auto chose torch_sdpa: flash_attn cannot run ...").
    backend_reason: str = ""
    role: Role = "mixed"

    @property
    def served_model(self) -> ServedModel:
        return ServedModel(
            self.model, self.vocab_size, self.max_context_len, self.block_size * self.num_blocks
        )


@dataclass(slots=True)
class Worker:
    """One worker to serve: its engine front and tokenizer, what it announces, and its limits."""

    # The engine loop in its thread (the model's, or the simulated engine's).
    front: AsyncLLM
    # None for an engine without one (the simulated engine): prompts must then come as token ids. A
    # simulated engine may be given one that counts words (workers.sim.word_tokenizer).
    tokenizer: Tokenizer | WordTokenizer | None
    info: WorkerInfo
    events: KVEventLog
    # Where the engine's KV blocks are read and written as bytes, to move them between workers.
    store: KVStore = field(default_factory=NoKV)
    # Requests accepted but not yet generating; one more is refused with 429.
    max_waiting: int = DEFAULT_MAX_WAITING
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    # The decode side of disaggregation: the TCP port prefill workers push KV to (0: any free one),
    # the host they reach it at, and how long a pull may take before the prompt is computed here.
    transfer_port: int = 0
    transfer_host: str = "127.0.0.1"
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    # How long a pull waits for KV room before the prompt is computed here after all.
    room_wait_s: float = DEFAULT_ROOM_WAIT_S
    # The fleet's KV transfer secret (protocol.transfer_auth); None: no part in disaggregation.
    transfer_secret: bytes | None = None

    @classmethod
    def around(
        cls,
        engine: Engine | SimEngine,
        events: KVEventLog,
        *,
        worker_id: str,
        backend: str,
        backend_reason: str = "",
        role: Role = "mixed",
        tokenizer: WordTokenizer | None = None,
        **options: Any,
    ) -> Worker:
        """A worker over an engine built with `events.callbacks()`, run by an AsyncLLM thread, that
        tokenizes text prompts with the engine's tokenizer or, for a simulated engine (which has
        none), with `tokenizer` if given."""
        bm = engine.block_manager
        # The simulated engine has no model config, only the vocabulary size its tokens are drawn from.
        vocab_size = getattr(engine, "vocab_size", None) or engine.model_config.vocab_size
        info = WorkerInfo(
            worker_id=worker_id,
            model=engine.model_name,
            block_size=bm.block_size,
            num_blocks=bm.num_blocks,
            max_context_len=engine.max_context_len,
            vocab_size=vocab_size,
            backend=backend,
            backend_reason=backend_reason,
            role=role,
        )
        # The simulated engine has no KV tensors: its transfers move hashes only.
        store = engine.runner if isinstance(engine.runner, KVStore) else NoKV()
        prompts = tokenizer if tokenizer is not None else engine.tokenizer
        return cls(AsyncLLM(engine), prompts, info, events, store, **options)
