"""A replica's reported reuse in the gateway's blocks: rounding is no evidence, a real shortfall is."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from radix.reports import REPORTS_FOR_BLOCK, ReportedUnit, realised_blocks


def test_the_backend_block_is_the_common_divisor_of_its_reports_once_a_few_agree() -> None:
    unit = ReportedUnit()
    for cached in (320, 320, 128):
        unit.observe(cached)
    assert unit.block(16) == 16  # two distinct reports: not yet
    unit.observe(0)  # nothing reused says nothing of the block
    unit.observe(448)
    assert unit.distinct == REPORTS_FOR_BLOCK
    assert unit.block(16) == 64


def test_a_same_unit_report_a_few_blocks_short_keeps_the_prediction() -> None:
    # Predicted 40 blocks of 16 (640 tokens); a backend with blocks of 64 reuses 576 of 650.
    assert realised_blocks(40, 576, 650, 650, 16, 64, 40) == 40
    # ... but 320 of them is an eviction, read at the reported depth.
    assert realised_blocks(40, 320, 650, 650, 16, 64, 40) == 20


def test_a_report_in_another_unit_is_read_as_a_share_of_the_prompt() -> None:
    # The backend counts 300 words for the gateway's 840 tokens, and reused 280 of them (blocks of 16
    # words): 784 of the gateway's tokens, 49 blocks, within the rounding of a 52-block prediction.
    assert realised_blocks(52, 272, 300, 840, 16, 16, 52) == 52
    # 100 words reused is 280 tokens: 17 blocks, far short.
    assert realised_blocks(52, 100, 300, 840, 16, 16, 52) == 17


def test_more_than_predicted_is_reported_as_it_is_within_the_prompts_blocks() -> None:
    assert realised_blocks(10, 480, 500, 500, 16, 16, 31) == 30
    assert realised_blocks(10, 10_000, 500, 500, 16, 16, 31) == 31


@given(
    predicted=st.integers(0, 200),
    block=st.sampled_from([16, 32]),
    backend_block=st.sampled_from([1, 16, 32, 64, 256]),
    extra=st.integers(0, 300),
)
def test_rounding_alone_never_reads_as_an_eviction(
    predicted: int, block: int, backend_block: int, extra: int
) -> None:
    """A backend of the gateway's unit holding every predicted token reports them rounded down to its
    block, less its last token's block: the prediction stands."""
    prompt = predicted * block + extra + 1
    held = predicted * block
    reported = max(0, min(held, prompt - 1) // backend_block * backend_block - backend_block)
    realised = realised_blocks(predicted, reported, prompt, prompt, block, backend_block, prompt // block)
    assert realised >= predicted
