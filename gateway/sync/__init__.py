"""Followers of the replicas' KV events that keep the radix index exact: the bundled workers' feed over
HTTP or Redis, and vLLM-format events over ZMQ."""
