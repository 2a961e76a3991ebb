"""Prefill/decode disaggregation as vLLM's OpenAI servers speak it, for the gateway's P/D tests."""

# The `kv_transfer_params` the gateway sends a prefill leg: compute the prompt's KV, a decoder fetches it.
REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
