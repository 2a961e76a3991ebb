"""SimEngine: Engine's loop (workers.engine.engine_core) over the real scheduler and block manager, with a
SimRunner in place of the model.

Only what has no model behind it differs: there is no tokenizer (`tokenizer` is None: prompts arrive
as token ids), the vocabulary size is the profile's (`vocab_size`), and each new token's text is a
synthetic word, so that streams carry non-empty deltas; stop strings therefore never match. `clock`
is a SimClock object (`clock.now()`), because the runner must also make time pass on it.
"""

from __future__ import annotations

from workers.engine.block_manager import BlockManager, StoredTokensCallback
from workers.engine.engine_core import ClearedCallback, Engine, RemovedCallback, StoredCallback, kv_callbacks
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.engine.sequence import Sequence
from workers.sim.profiles import Profile
from workers.sim.runner import SimClock, SimRunner


def synthetic_text(token_id: int) -> str:
    """A word per token: about the four characters per token of English text."""
    return f" t{token_id % 1000}"


class SimEngine(Engine):
    """Engine's loop with the profile's pool and limits and a SimRunner in place of the model."""

    def __init__(
        self,
        profile: Profile,
        *,
        clock: SimClock | None = None,
        seed: int = 0,
        eos_probability: float = 0.0,
        on_stored: StoredCallback | None = None,
        on_removed: RemovedCallback | None = None,
        on_cleared: ClearedCallback | None = None,
        on_stored_tokens: StoredTokensCallback | None = None,
    ) -> None:
        self.profile = profile
        self.vocab_size = profile.vocab_size
        block_manager = BlockManager(
            profile.num_blocks,
            profile.block_size,
            profile.model_name,
            **kv_callbacks(on_stored, on_removed, on_cleared, on_stored_tokens),
        )
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=profile.max_num_batched_tokens,
                max_num_seqs=profile.max_num_seqs,
                max_prefill_chunk=profile.max_prefill_chunk,
                eos_token_ids=profile.eos_token_ids,
            ),
            block_manager,
        )
        runner = SimRunner(
            profile.cost,
            vocab_size=profile.vocab_size,
            eos_token_ids=profile.eos_token_ids,
            eos_probability=eos_probability,
            clock=clock,
            seed=seed,
        )
        # The runner makes time pass on this clock, so it is an object here, not Engine's bare callable.
        self.clock = runner.clock
        self._attach(profile.model_name, None, profile.max_context_len, scheduler, runner, runner.clock.now)

    def _text(self, seq: Sequence) -> str:
        return synthetic_text(seq.output_token_ids[-1])
