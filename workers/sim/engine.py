"""SimEngine: the engine's public surface over the real scheduler and block manager and a SimRunner.

It mirrors workers.engine.engine.Engine (add_request, step, abort, has_work, stats, block_manager,
model_name, max_context_len, the KV-event callbacks, RequestOutput deltas), so AsyncLLM drives it
unchanged. What differs is only what has no model behind it: there is no tokenizer (`tokenizer` is
None: prompts arrive as token ids), the vocabulary size is the profile's (`vocab_size`, where Engine
has `model_config`), and each new token's text is a synthetic word, so that streams carry non-empty
deltas; stop strings therefore never match. The clock is a SimClock object (`clock.now()`), where
Engine takes a bare callable, because the runner must also make time pass on it.

Engine builds its runner from a loaded model inside its constructor, so it cannot take this runner;
given a runner parameter there, this class would shrink to choosing the runner and the text.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from workers.engine.block_manager import BlockManager
from workers.engine.engine import PromptTooLong, RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from workers.engine.sequence import Sequence
from workers.sim.profiles import Profile
from workers.sim.runner import SimClock, SimRunner


def synthetic_text(token_id: int) -> str:
    """A word per token: about the four characters per token of English text."""
    return f" t{token_id % 1000}"


class SimEngine:
    def __init__(
        self,
        profile: Profile,
        *,
        clock: SimClock | None = None,
        seed: int = 0,
        eos_probability: float = 0.0,
        on_stored: Callable[[list[int], int | None], None] | None = None,
        on_removed: Callable[[list[int]], None] | None = None,
        on_cleared: Callable[[], None] | None = None,
    ) -> None:
        self.profile = profile
        self.model_name = profile.model_name
        self.tokenizer = None
        self.vocab_size = profile.vocab_size
        callbacks = {
            name: fn
            for name, fn in (("on_stored", on_stored), ("on_removed", on_removed), ("on_cleared", on_cleared))
            if fn is not None
        }
        self.block_manager = BlockManager(
            profile.num_blocks, profile.block_size, profile.model_name, **callbacks
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=profile.max_num_batched_tokens,
                max_num_seqs=profile.max_num_seqs,
                eos_token_ids=profile.eos_token_ids,
            ),
            self.block_manager,
        )
        self.runner = SimRunner(
            profile.cost,
            vocab_size=profile.vocab_size,
            eos_token_ids=profile.eos_token_ids,
            eos_probability=eos_probability,
            clock=clock,
            seed=seed,
        )
        self.clock = self.runner.clock
        self._ids = itertools.count()

    @property
    def max_context_len(self) -> int:
        return self.profile.max_context_len

    def add_request(self, prompt_token_ids: list[int], sampling: SamplingParams) -> int:
        """Queue a request; raises PromptTooLong or UnschedulableSequence for one that can never run."""
        needed = len(prompt_token_ids) + sampling.max_tokens
        if needed > self.max_context_len:
            raise PromptTooLong(
                f"this model's context window is {self.max_context_len} tokens, but the request needs "
                f"{needed} ({len(prompt_token_ids)} in the prompt + {sampling.max_tokens} max_tokens)"
            )
        request_id = next(self._ids)
        seq = Sequence(request_id, list(prompt_token_ids), sampling, arrival_time=self.clock.now())
        self.scheduler.add(seq)
        return request_id

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def step(self) -> list[RequestOutput]:
        """Schedule, let the step's modelled time pass, and return a delta per request that got a token."""
        chunks = self.scheduler.schedule(self.clock.now())
        if not chunks:
            return []
        outputs = self.runner.execute(chunks)
        changed = self.scheduler.update(chunks, outputs, self.clock.now())
        return [self._delta(seq) for seq in changed]

    def abort(self, request_id: int) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; None when it had already finished."""
        seq = self.scheduler.abort(request_id, self.clock.now())
        if seq is None:
            return None
        return self._delta(seq, new_token=False)

    def _delta(self, seq: Sequence, new_token: bool = True) -> RequestOutput:
        new_ids = seq.output_token_ids[-1:] if new_token else []
        logprobs = None
        if new_ids and seq.sampling.logprobs is not None and seq.output_logprobs:
            last = seq.output_logprobs[-1]
            logprobs = [(last.logprob, last.top_logprobs)]
        return RequestOutput(
            request_id=seq.seq_id,
            new_token_ids=new_ids,
            new_text="".join(synthetic_text(t) for t in new_ids),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            prompt_tokens=seq.num_prompt_tokens,
            cached_tokens=seq.num_cached_tokens,
            completion_tokens=seq.num_output_tokens,
            new_logprobs=logprobs,
        )
