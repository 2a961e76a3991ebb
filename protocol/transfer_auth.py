"""Worker-to-worker KV transfers, authenticated (docs/design.md §4): the secret a gateway and its bundled
workers share, and the HMACs each hop of a transfer carries, over what that hop authorises.

- grant (gateway -> decode worker, inside PREFILL_FIELD): pull transfer `transfer` from the prefill
  worker at `url`, before `expires`. Only a gateway holding the secret makes one, and it strips any
  `prefixgate_*` field a client sent, so no client can name a URL for a decode worker to call.
- order (decode worker -> prefill worker, `POST /kv/prefill`): compute these token ids, skip this many
  blocks, push the rest for this transfer to this host and port, before `expires`. A prefill worker
  pushes nowhere an order it cannot verify names.
- push (prefill worker -> the decode worker's transfer port, in the frame header): these hashes for this
  transfer, in this layout. The receiver writes nothing for a header it cannot verify.

Signatures are HMAC-SHA256 over the JSON array of the hop's purpose and fields, compared in constant time.
Expiries are wall-clock seconds: the fleet's clocks must agree to within GRANT_TTL_S.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import orjson

# Where the secret is read from when no flag or config names it: one variable for the whole fleet.
SECRET_ENV = "PREFIXGATE_TRANSFER_SECRET"
MIN_SECRET_BYTES = 16
# How long a gateway's grant stays valid: the time from routing to the decode worker starting its pull.
GRANT_TTL_S = 30.0


def parse_secret(text: str | None) -> bytes | None:
    """The secret as bytes (None for none given); a short one is refused: it could be guessed."""
    if text is None or not text.strip():
        return None
    secret = text.strip().encode()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"a transfer secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
    return secret


def env_secret() -> bytes | None:
    return parse_secret(os.environ.get(SECRET_ENV))


def sign(secret: bytes, purpose: str, *fields: Any) -> str:
    message = orjson.dumps([purpose, *fields])
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def verify(secret: bytes, signature: object, purpose: str, *fields: Any) -> bool:
    """Whether `signature` is this secret's over these fields. Anything but an ASCII string is not one
    (compare_digest refuses other strings with an exception)."""
    if not isinstance(signature, str) or not signature.isascii():
        return False
    try:
        expected = sign(secret, purpose, *fields)
    except (TypeError, orjson.JSONEncodeError):
        return False
    return hmac.compare_digest(expected.encode(), signature.encode())


def live(expires: object, now: float | None = None) -> bool:
    """Whether an expiry is a finite number not yet passed."""
    if isinstance(expires, bool) or not isinstance(expires, int | float) or not math.isfinite(expires):
        return False
    return (time.time() if now is None else now) <= expires


def digest(token_ids: Sequence[int]) -> str:
    """A prompt's ids in an order's signature: a fixed-size stand-in for the whole list."""
    return hashlib.sha256(orjson.dumps(list(token_ids))).hexdigest()


def grant(secret: bytes, prefill_url: str, transfer_id: str, ttl_s: float = GRANT_TTL_S) -> dict[str, Any]:
    """The gateway's PREFILL_FIELD value: which prefill worker to pull which transfer from, signed."""
    expires = round(time.time() + ttl_s, 3)
    return {
        "url": prefill_url,
        "transfer": transfer_id,
        "expires": expires,
        "sig": sign(secret, "grant", prefill_url, transfer_id, expires),
    }


def check_grant(secret: bytes, value: object) -> tuple[str, str, float] | None:
    """(prefill url, transfer id, expiry) of a grant this secret signed and still valid; else None."""
    if not isinstance(value, dict):
        return None
    url, transfer_id, expires = value.get("url"), value.get("transfer"), value.get("expires")
    if not isinstance(url, str) or not isinstance(transfer_id, str) or not transfer_id or not live(expires):
        return None
    if not verify(secret, value.get("sig"), "grant", url, transfer_id, expires):
        return None
    assert isinstance(expires, int | float)
    return url, transfer_id, float(expires)


def order_signature(
    secret: bytes,
    transfer_id: str,
    host: str,
    port: int,
    skip_blocks: int,
    expires: float,
    token_ids: Sequence[int],
) -> str:
    return sign(secret, "order", transfer_id, host, port, skip_blocks, expires, digest(token_ids))


def push_signature(
    secret: bytes, transfer_id: str, layout: str, block_bytes: int, group_blocks: int, hashes: Sequence[int]
) -> str:
    return sign(secret, "push", transfer_id, layout, block_bytes, group_blocks, list(hashes))
