"""What a replica's report of reused prompt tokens says about the gateway's own blocks.

A foreign backend reports `cached_tokens` in its own unit: its tokenizer's tokens (which need not be
the gateway's: another model, a template that renders differently, a backend that counts words),
rounded down to its own KV block, and never the whole prompt (its last token is always computed). The
gateway's predictions are in blocks of its own tokens. So a report is read as the share of the prompt
reused (its `prompt_tokens` against the gateway's), and a shortfall against the prediction is evidence
of an eviction only beyond what that rounding can explain: two of the backend's blocks (the round-down
and the last token's block) plus one of the gateway's (its own round-down), in the gateway's tokens.

The backend's block is whatever its reports are all multiples of: the greatest common divisor of the
nonzero cached_tokens it reported (vLLM's 16 or 32, SGLang's page size, a word-counting backend's
block). Until a few distinct reports agree on it, the configured block size stands in for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Distinct nonzero reports before their common divisor is taken for the backend's block: one report
# is a multiple of the block, not the block; a few distinct ones rarely share a larger factor.
REPORTS_FOR_BLOCK = 3


@dataclass(slots=True)
class ReportedUnit:
    """A backend's block in its own tokens, learned from the cached_tokens it reports."""

    divisor: int = 0
    # Nonzero reports that differed from the one before: a repeat (a prompt sent again) is no new
    # evidence of what the block is.
    distinct: int = 0
    last: int = 0

    def observe(self, cached_tokens: int) -> None:
        if cached_tokens <= 0 or cached_tokens == self.last:
            return
        self.last = cached_tokens
        self.divisor = math.gcd(self.divisor, cached_tokens)
        self.distinct += 1

    def block(self, configured: int) -> int:
        """The backend's block in its tokens: the common divisor of REPORTS_FOR_BLOCK distinct reports
        or more, else the configured block size."""
        return self.divisor if self.distinct >= REPORTS_FOR_BLOCK else configured


def realised_blocks(
    predicted_blocks: int,
    cached_tokens: int,
    reported_prompt: int | None,
    prompt_tokens: int,
    block_size: int,
    backend_block: int,
    hashed_blocks: int,
) -> int:
    """How many of the gateway's `hashed_blocks` blocks of a prompt the report says were reused, given
    that `predicted_blocks` were predicted: the prediction itself when the report falls short of it by
    no more than the report's rounding (module docstring), the report's share of the prompt otherwise.

    `reported_prompt` is the backend's count of the same prompt (None: it counts the gateway's tokens,
    as a bundled worker does); `block_size` the gateway's block for this replica, `backend_block` the
    backend's in its own tokens."""
    # In integers: a replica's counts are whatever it sends, of any size.
    if reported_prompt:
        reused = min(cached_tokens, reported_prompt) * prompt_tokens // reported_prompt
        slack = 2 * backend_block * prompt_tokens // reported_prompt + block_size
    else:
        reused, slack = cached_tokens, 2 * backend_block + block_size
    if reused + slack >= predicted_blocks * block_size:
        return min(max(predicted_blocks, reused // block_size), hashed_blocks)
    return min(reused // block_size, hashed_blocks)
