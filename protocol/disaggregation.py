"""Prefill/decode disaggregation as the gateway and the bundled workers speak it (docs/design.md §4),
named once so that the two sides cannot drift apart.

- Roles: a "mixed" replica computes and decodes its own prompts; a "prefill" one computes prompts for
  decode replicas and answers no client; a "decode" one answers clients, its prompts computed by a
  prefill replica when the gateway pairs them (policies.pd).
- A worker announces its role in its `/health` JSON and in its Redis registry hash, as ROLE_FIELD: one
  of ROLES. A worker that does not (one from before roles) is "mixed": it computes and decodes its own
  prompts, as every worker did.
- The gateway names a decode worker's prefill partner in the chat or completion body it forwards:
  PREFILL_FIELD, `{"url": "<the prefill worker's base URL>", "transfer", "expires", "sig"}`, a grant
  signed with the fleet's transfer secret (protocol.transfer_auth); the decode worker acts on no other.
  Without it the decode worker computes the prompt itself.
- The decode worker's answer says, in TRANSFERRED_TOKENS_HEADER, how many prompt tokens arrived by
  transfer; and in PREFILL_ERROR_HEADER, why, when its prefill partner failed and it computed the prompt
  itself (the request still succeeds); in PULL_MS_HEADER and TRANSFER_MS_HEADER, the milliseconds
  from asking the prefill worker to having the KV, and of those the push alone.
"""

from __future__ import annotations

from typing import Literal, get_args

Role = Literal["mixed", "prefill", "decode"]
ROLE_FIELD = "role"
ROLES: tuple[Role, ...] = get_args(Role)
DEFAULT_ROLE = "mixed"
PREFILL_FIELD = "prefixgate_prefill"
TRANSFERRED_TOKENS_HEADER = "x-prefixgate-transferred-tokens"
PREFILL_ERROR_HEADER = "x-prefixgate-prefill-error"
PULL_MS_HEADER = "x-prefixgate-pull-ms"
TRANSFER_MS_HEADER = "x-prefixgate-transfer-ms"
