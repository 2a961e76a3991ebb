"""The Redis key names and value formats of the fleet's shared state (docs/design.md §4), in one place so
that the workers that write them and the gateways that read them cannot drift apart.

- `prefixgate:workers` (set): ids of workers that registered. Members never expire, so a reader must
  check that the worker's hash still exists (a crashed worker leaves its id behind).
- `prefixgate:worker:{id}` (hash, expires unless refreshed by the worker's heartbeat): the fields in
  REGISTRY_FIELDS, every value a string (block_size, num_blocks and max_context_len are decimal);
  `role` (protocol.disaggregation) may be absent, from a worker older than roles: it is then mixed.
  `incarnation` changes at every worker start: a reader holding another one must resync.
- `prefixgate:kv:{id}` (stream, trimmed to about the configured length): one entry per KV event batch,
  fields `incarnation`, `seq` (decimal) and `events` (the batch's events as a JSON list, the wire
  format of protocol.kv_events). Delivery is at least once and may have holes: a reader skips entries
  whose seq it already applied, and on a hole (the stream was trimmed, Redis restarted, or the worker
  could not reach Redis for longer than its event ring lasts) resyncs from the worker's /kv/snapshot.
- `prefixgate:load:{id}` (string, short expiry): JSON `{"running", "waiting", "queued_prefill_tokens",
  "kv_blocks_used", "kv_blocks_total", "ts"}`, `ts` in Unix seconds; absent means no recent report.
- `prefixgate:predictions` (stream, trimmed to about the configured length): written by gateways, not
  workers. One entry per routing decision to a backend that publishes no KV events (approximate mode),
  fields `gateway` (the writer's id, so it can skip its own), `replica` (a worker id), `expires_at`
  (Unix seconds, a decimal float) and `hashes` (the request's block hashes as a JSON list). Every gateway
  inserts the others' entries into its index with that expiry, so all of them predict the same cache.
  An entry with `capacity` (decimal blocks) instead of `expires_at` and `hashes` is a capacity a gateway
  learned for that replica from what it reported reusing; the others bound their predictions by it.
- `prefixgate:response:{id}` (string, expires): written by gateways. The id of the replica that produced
  the Responses API response `id`, the only one that can continue it (`previous_response_id`).
"""

from __future__ import annotations

PREFIX = "prefixgate"
WORKERS = f"{PREFIX}:workers"
PREDICTIONS = f"{PREFIX}:predictions"
REGISTRY_FIELDS = (
    "id",
    "url",
    "model",
    "block_size",
    "num_blocks",
    "max_context_len",
    "backend",
    "role",
    "incarnation",
)
LOAD_FIELDS = ("running", "waiting", "queued_prefill_tokens", "kv_blocks_used", "kv_blocks_total", "ts")


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


def kv_stream_key(worker_id: str) -> str:
    return f"{PREFIX}:kv:{worker_id}"


def load_key(worker_id: str) -> str:
    return f"{PREFIX}:load:{worker_id}"


def response_key(response_id: str) -> str:
    return f"{PREFIX}:response:{response_id}"
