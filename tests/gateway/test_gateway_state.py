"""GatewayState across a reload: the hash-chain cache is kept while its bound stays, and made anew at
a new bound; the prefix index is kept, under the bound the reload sets."""

from __future__ import annotations

import pytest

from gateway.gateway_config import parse_config
from gateway.gateway_state import GatewayState
from policies.routing_config import ConfigError


def test_the_hash_chains_survive_a_reload_that_keeps_their_bound() -> None:
    state = GatewayState(parse_config({}), "test-state")
    try:
        chains = state.chains
        assert chains.max_bytes == 32 * 2**20  # limits.hash_cache_mib's default
        state.configure(parse_config({"routing": {"policy": "least_load"}}))
        assert state.chains is chains
        state.configure(parse_config({"limits": {"hash_cache_mib": 0}}))
        assert state.chains is not chains and state.chains.max_bytes == 0
    finally:
        state.tokenizers.close()


def test_the_index_keeps_what_it_holds_across_a_reload_under_the_bound_it_sets() -> None:
    state = GatewayState(parse_config({}), "test-state")
    try:
        index = state.index
        assert index.max_entries == 4_000_000  # limits.index_max_entries's default
        index.add_replica("a")
        index.insert("a", list(range(3_000)))
        state.configure(parse_config({"limits": {"index_max_entries": 2_048}}))
        assert state.index is index and index.max_entries == 2_048
        assert len(index) == 2_048  # enforced at once, the least recently used gone
        assert index.holds("a", 0) and not index.holds("a", 2_999)
    finally:
        state.tokenizers.close()
    with pytest.raises(ConfigError, match="index_max_entries"):
        parse_config({"limits": {"index_max_entries": 10}})
