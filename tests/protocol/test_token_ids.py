"""Token-id prompts, checked in C-level passes: exactly the non-empty lists of ints in [0, 2**32)."""

from __future__ import annotations

from typing import Any

import pytest

from protocol.token_ids import MAX_TOKEN_ID, are_token_ids, checked_token_ids


@pytest.mark.parametrize(
    "value",
    [[], [True], [1, False], [1.0], [-1], [MAX_TOKEN_ID + 1], [1, None], [[1]], ["1"], "1", None, (1, 2)],
)
def test_anything_but_a_list_of_ids_is_not_one(value: Any) -> None:
    assert checked_token_ids(value) is None
    assert not are_token_ids(value)


def test_the_largest_id_is_found_and_bounds_the_vocabulary() -> None:
    ids = [5, MAX_TOKEN_ID, 0, 17]
    checked = checked_token_ids(ids)
    assert checked is not None and checked.largest == MAX_TOKEN_ID and checked.ids is ids
    assert are_token_ids([3, 99], vocab_size=100) and not are_token_ids([3, 100], vocab_size=100)
