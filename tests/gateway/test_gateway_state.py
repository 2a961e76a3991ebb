"""GatewayState across a reload: the hash-chain cache is kept while its bound stays, and made anew at
a new bound."""

from __future__ import annotations

from gateway.gateway_config import parse_config
from gateway.gateway_state import GatewayState


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
