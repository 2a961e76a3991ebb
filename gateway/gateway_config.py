"""The gateway's YAML configuration (docs/design.md §5), validated up front with errors that name the key.

Secrets never live in the file: it names the environment variables that hold the API keys and the
admin token, so the same YAML serves every environment and a reload (SIGHUP) picks up rotated keys.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.collector import YOUNG_THRESHOLD
from policies import ConfigError, Role, RoutingConfig
from policies.routing_config import format_validation_error
from protocol.vllm_kv_events import check_endpoint, default_replay_endpoint

ReplicaKind = Literal["auto", "bundled", "openai"]
# How a foreign prefill/decode fleet moves KV between its replicas (gateway.forward.pd_legs).
PdProtocol = Literal["vllm", "sglang"]
# SGLang's default --disaggregation-bootstrap-port.
SGLANG_BOOTSTRAP_PORT = 8998


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Listen(_Section):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class Auth(_Section):
    # Comma-separated bearer keys for /v1/*; with neither set the API is open (local use).
    api_keys_env: str | None = None
    admin_token_env: str | None = None
    # Send the client's Authorization header on to the replica (for backends that check keys too).
    forward_client_key: bool = False
    # A key of the gateway's own for foreign backends that require one (the env var holding it).
    upstream_key_env: str | None = None
    # The fleet's KV transfer secret, shared with its bundled workers (their --transfer-secret): what
    # the gateway signs each prefill/decode pairing with. Unset, bundled workers are not paired.
    transfer_secret_env: str | None = "PREFIXGATE_TRANSFER_SECRET"


class RedisSection(_Section):
    url: str
    # How often the replica registry and load reports are read.
    poll_interval_s: float = Field(0.5, gt=0)
    # A healthy replica missing from the registry stays this long before it is dropped: a Redis that
    # restarted empty (or was flushed) lists nobody until the workers' next heartbeats. One that also
    # fails its health checks is dropped at once.
    registry_grace_s: float = Field(5.0, ge=0)


class ReplicaEntry(_Section):
    url: str
    # Id for routing and metrics; bundled workers announce theirs, others default to host:port.
    id: str | None = None
    # "auto": a bundled worker when its /health says so, an OpenAI server otherwise.
    kind: ReplicaKind = "auto"
    # The model a foreign backend serves (default: the first of its /v1/models).
    model: str | None = None
    # A foreign backend's KV block size, and its cache capacity in blocks for approximate mode's
    # predictions: only a prior, corrected from what the backend reports reusing; none: learned from
    # the first report.
    block_size: int = Field(16, ge=1)
    capacity_blocks: int | None = Field(None, ge=1)
    # Where the replica publishes its KV events in vLLM's wire format (vLLM's or SGLang's
    # --kv-events-config endpoint, a bundled worker's --kv-events-zmq): tcp://HOST:PORT or
    # ipc://PATH. Set, the replica is routed in precise mode, its index followed from those events.
    kv_events: str | None = None
    # Its replay (ROUTER) socket; default: the same host, port + 1 (none for an ipc:// endpoint).
    kv_events_replay: str | None = None
    # Its part in a prefill/decode disaggregated fleet (policies.pd). A bundled worker announces its
    # own: one given here must agree (else the worker's wins, and the log says so).
    role: Role = "mixed"
    # How a foreign prefill or decode replica moves KV to its pair: vLLM's kv_transfer_params, or
    # SGLang's bootstrap fields. Required for a foreign prefill or decode replica.
    pd_protocol: PdProtocol | None = None
    # An SGLang prefill server's --disaggregation-bootstrap-port, which its decode servers pull from.
    bootstrap_port: int = Field(SGLANG_BOOTSTRAP_PORT, ge=1, le=65535)

    @field_validator("kv_events", "kv_events_replay")
    @classmethod
    def _zmq(cls, address: str | None) -> str | None:
        return None if address is None else check_endpoint(address)

    @model_validator(mode="after")
    def _pd(self) -> ReplicaEntry:
        """A foreign pair needs a protocol, a protocol needs a pair, and only SGLang prefills bootstrap."""
        if self.pd_protocol is not None:
            if self.role == "mixed":
                raise ValueError("pd_protocol needs role: prefill or decode (a mixed replica has no pair)")
            if self.kind == "bundled":
                raise ValueError("pd_protocol is for foreign replicas: bundled workers move KV their way")
        elif self.kind == "openai" and self.role != "mixed":
            raise ValueError(f"role: {self.role} on a foreign replica needs pd_protocol (vllm or sglang)")
        sglang_prefill = self.pd_protocol == "sglang" and self.role == "prefill"
        if "bootstrap_port" in self.model_fields_set and not sglang_prefill:
            raise ValueError("bootstrap_port is an SGLang prefill's (pd_protocol: sglang, role: prefill)")
        return self

    @model_validator(mode="after")
    def _replay(self) -> ReplicaEntry:
        if self.kv_events is None:
            if self.kv_events_replay is not None:
                raise ValueError("kv_events_replay needs kv_events")
        elif self.kv_events_replay is None:
            self.kv_events_replay = default_replay_endpoint(self.kv_events)
        return self

    @field_validator("url")
    @classmethod
    def _http(cls, url: str) -> str:
        if not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        try:
            parts = urlsplit(url)
            parts.port  # noqa: B018 (raises ValueError for a port that is not a number in range)
            url.encode()
        except (ValueError, UnicodeError) as error:
            raise ValueError(f"is not a valid URL: {error}") from None
        if not parts.hostname:
            raise ValueError("names no host")
        return url.rstrip("/")


class KubernetesSection(_Section):
    """Replicas discovered from a Kubernetes cluster (gateway.fleet.kubernetes): the ready pods an
    InferencePool selects, or the ready endpoints of a Service. Pod annotations prefixgate.io/* override
    kind, model, block size and KV events per pod."""

    namespace: str = Field("default", min_length=1, max_length=63)
    # Exactly one: an InferencePool (inference.networking.k8s.io/v1) or a Service (its EndpointSlices).
    inference_pool: str | None = Field(None, min_length=1, max_length=253)
    service: str | None = Field(None, min_length=1, max_length=253)
    # The replicas' port, in place of the pool's targetPorts or the EndpointSlices' ports.
    port: int | None = Field(None, ge=1, le=65535)
    kind: Literal["openai", "bundled"] = "openai"
    # The served model, for pods that do not name theirs (default: the first of their /v1/models).
    model: str | None = Field(None, min_length=1)
    # The API server's URL, with no credentials; default: in-cluster config (the service account), else
    # the kubeconfig $KUBECONFIG names (or ~/.kube/config).
    api_server: str | None = None
    # How often the set is listed again in full and reconciled, besides following the watch: a safety
    # net for a watch that is silently stuck.
    resync_s: float = Field(300.0, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> KubernetesSection:
        if (self.inference_pool is None) == (self.service is None):
            raise ValueError("name exactly one of inference_pool or service")
        return self

    @field_validator("api_server")
    @classmethod
    def _server(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return url


# The `tokenizer:` of a model routed on its prompt's text (gateway.forward.text_ids).
TEXT_SPEC = "text"


class ModelEntry(_Section):
    # "default": SmolLM2's tokenizer (docs/design.md §6); a HF folder path; "text" (routed on the
    # prompt's text, untokenized: its replicas predicted, never followed by KV events;
    # gateway.forward.text_ids); or "none" (token-id prompts only).
    tokenizer: str = "default"
    # How a foreign backend of this model continues a stream another replica lost mid-answer
    # (gateway.forward.migration): "none" (the client gets an error event), "completions" (completions with a
    # text prompt: the prompt plus the text so far, which any OpenAI server takes), or "vllm" (those, and
    # chat with vLLM's continue_final_message). Bundled workers always continue, from token ids.
    foreign_continuation: Literal["none", "completions", "vllm"] = "none"


class Limits(_Section):
    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    # For the whole request body to arrive: a client that announces more than it sends is refused
    # (408) rather than holding a connection and an in-flight slot for ever.
    body_timeout_s: float = Field(30.0, gt=0)
    # Whole request, upstream included; streaming responses reset it at every chunk.
    request_timeout_s: float = Field(600.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    # Replicas tried for one request before giving up (the policy's order, then fallbacks).
    max_attempts: int = Field(2, ge=1)
    # Generation requests this gateway holds at once (reading, routing, forwarding, relaying); one
    # more is refused at once with 429 and Retry-After. It bounds the gateway's memory, and the work a
    # burst puts on its one event loop: past about a thousand arrivals at once (measured on 2 shared
    # cores, tests/faults/test_overload.py) the loop lags by seconds, its upstream connects time out,
    # and busy replicas are taken for dead ones.
    max_inflight: int = Field(1024, ge=1)
    # What one prompt may cost the gateway to route. Its first max_routed_tokens ids are hashed,
    # matched, recorded and published (128k by default: a whole real context; 8,192 block hashes at
    # block size 16), the rest routed as if it matched nothing; of its text, the first
    # max_tokenized_chars characters are tokenized (512 Ki by default: 128k tokens of English text,
    # about half a second of one core). The replica gets the whole prompt, and judges its length.
    max_routed_tokens: int = Field(131_072, ge=16)
    max_tokenized_chars: int = Field(524_288, ge=1024)
    # Per model, the token ids of prompt prefixes seen lately, so that a conversation's next turn is
    # tokenized only where it grew (gateway.forward.prefix_cache); 0 turns the cache off.
    tokenizer_cache_mib: int = Field(64, ge=0)
    # Recent prompts' block hashes, so that a prompt extending one is hashed only where it grew
    # (radix.chain_cache); 0 turns it off.
    hash_cache_mib: int = Field(32, ge=0)
    # (block, replica) entries the prefix index holds, predicted and exact together: about 250 bytes
    # each (`bench radix`), so about 1 GB at the default. Past it the largest replica's least recently
    # used go first: a gateway routing many new prompts holds this many, and pays an eviction per new
    # block (docs/benchmarks.md, "The index at its entry bound").
    index_max_entries: int = Field(4_000_000, ge=1024)
    # Prompts a replica computes at once from this gateway (sent, no first output yet); the requests
    # past them wait at the gateway and go shortest prefill first, with their arrival counted
    # (gateway.forward.prefill_queue). None: each goes at once, the replica's own queue orders them.
    prefill_depth: int | None = Field(None, ge=1, le=1024)


class Health(_Section):
    interval_s: float = Field(1.0, gt=0)
    timeout_s: float = Field(2.0, gt=0)
    # Consecutive failed checks (or failed forwards) before a replica stops receiving traffic.
    failures: int = Field(2, ge=1)
    # Embedded mode: how often each bundled worker's /load is read.
    load_interval_s: float = Field(0.25, gt=0)


class Approximate(_Section):
    # How long a routing decision is believed to stay in a foreign backend's cache.
    ttl_s: float = Field(300.0, gt=0)
    # Streams to a predicted replica ask it for usage (stream_options.include_usage) when the client
    # did not, to learn what it reused; the usage chunk is then left out of what the client receives.
    request_usage: bool = True


class Responses(_Section):
    # How long the gateway remembers which replica produced a Responses API response (the only one
    # that can continue it), locally and in Redis, and how many it keeps locally.
    ttl_s: float = Field(86_400.0, gt=0)
    max_entries: int = Field(100_000, ge=1)


class Learning(_Section):
    # Prefill rate assumed before any TTFT is observed, and the EWMA weight of each observation.
    prefill_rate_prior: float = Field(10_000.0, gt=0)
    ewma_alpha: float = Field(0.2, gt=0, le=1)
    # Only TTFTs of requests that prefilled at least this many tokens teach the rate.
    min_prefill_tokens: int = Field(64, ge=1)


class Collector(_Section):
    """Python's garbage collector under the gateway (gateway.collector), set as it starts (a reload
    leaves it as it is)."""

    # Net allocations between young collections; null: Python's default (700).
    young_threshold: int | None = Field(YOUNG_THRESHOLD, ge=1)
    # Keep what is alive once the gateway is up, and when a replica joins, out of full collections.
    freeze: bool = True


class GatewayConfig(_Section):
    # The default model's name: requests that name no model go there when several are served.
    model: str | None = None
    models: dict[str, ModelEntry] = {}
    listen: Listen = Listen()
    auth: Auth = Auth()
    redis: RedisSection | None = None
    replicas: list[ReplicaEntry] = []
    kubernetes: KubernetesSection | None = None
    routing: RoutingConfig = RoutingConfig()
    limits: Limits = Limits()
    health: Health = Health()
    approximate: Approximate = Approximate()
    responses: Responses = Responses()
    learning: Learning = Learning()
    collector: Collector = Collector()
    # Names this gateway in shared predictions and logs (default: hostname-pid-random, unique).
    gateway_id: str | None = None

    @model_validator(mode="after")
    def _text_events(self) -> GatewayConfig:
        """KV events name token blocks, which a model routed on its text never matches."""
        for i, entry in enumerate(self.replicas):
            model = entry.model or self.model
            if entry.kv_events is not None and model is not None and self.tokenizer_for(model) == TEXT_SPEC:
                raise ValueError(
                    f"replicas[{i}] names kv_events, but its model {model!r} is routed on its text "
                    "(tokenizer: text), which KV events' token blocks never match: drop one of the two"
                )
        return self

    def api_keys(self) -> frozenset[str]:
        return frozenset(_secret_list(self.auth.api_keys_env))

    def admin_token(self) -> str | None:
        tokens = _secret_list(self.auth.admin_token_env)
        return tokens[0] if tokens else None

    def upstream_key(self) -> str | None:
        keys = _secret_list(self.auth.upstream_key_env)
        return keys[0] if keys else None

    def transfer_secret(self) -> str | None:
        env = self.auth.transfer_secret_env
        return os.environ.get(env) if env is not None else None

    def tokenizer_for(self, model: str) -> str:
        entry = self.models.get(model)
        return entry.tokenizer if entry is not None else "default"


def _secret_list(env: str | None) -> list[str]:
    if env is None:
        return []
    return [part.strip() for part in os.environ.get(env, "").split(",") if part.strip()]


def parse_config(data: dict[str, Any] | None) -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data or {})
    except ValidationError as error:
        raise ConfigError(format_validation_error(error, "gateway")) from None


def load_config(path: str | os.PathLike[str]) -> GatewayConfig:
    file = Path(path)
    try:
        data = yaml.safe_load(file.read_text())
    except OSError as error:
        raise ConfigError(f"cannot read the gateway config {file}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{file} is not valid YAML: {error}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{file} must hold a mapping at the top level")
    return parse_config(data)
