"""The router daemon's configuration: frozen pydantic models, one per section, each default defined once.

Sources, later wins: defaults < TOML file (`--config`) < environment (`SWITCHYARD_<SECTION>_<KEY>`) < CLI flags
(`--port`, ..., or the generic `--set section.key=value`). Unknown sections and keys are rejected from every
source with a message that names the source and lists the valid keys. Tables (`routing.params`,
`tokenizer.models`) merge key by key across sources; `--set section.table.key=value` sets one key of one.
"""

from __future__ import annotations

import json
import os
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from switchyard.grpc_options import (
    KEEPALIVE_TIME_S,
    KEEPALIVE_TIMEOUT_S,
    MIN_KEEPALIVE_TIME_S,
    SERVER_KEEPALIVE_TIME_S,
    SERVER_KEEPALIVE_TIMEOUT_S,
    channel_options,
)
from switchyard.router.policies.registry import DEFAULT_POLICY
from switchyard.tls import ClientTls, ServerTls

ENV_PREFIX = "SWITCHYARD_"


class ConfigError(ValueError):
    """A configuration source is malformed or names an unknown key."""


class _Section(BaseModel):
    # finite numbers only: an interval or timeout of inf would stop a loop for good (0 is "off" where one is)
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class ServerConfig(_Section):
    host: str = "127.0.0.1"  # public Router service (+ health, reflection)
    port: int = Field(default=50051, ge=0, le=65535)  # 0 = any free port (printed on the READY line)
    admin_host: str = "127.0.0.1"  # NOTE: the Admin service can add/remove workers, so loopback by default
    admin_port: int = Field(default=50052, ge=0, le=65535)
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(default=9464, ge=0, le=65535)
    metrics_enabled: bool = True
    grace_s: float = Field(default=30.0, ge=0)  # SIGTERM: how long in-flight requests may take to finish
    # ping a client silent this long, and close its connection (cancelling its requests) if the ping gets no answer
    # within keepalive_timeout_s: a client host gone without a word frees what it held; 0 = gRPC's 2 hours
    keepalive_time_s: float = Field(default=SERVER_KEEPALIVE_TIME_S, ge=0)
    keepalive_timeout_s: float = Field(default=SERVER_KEEPALIVE_TIMEOUT_S, gt=0)
    log_level: str = "INFO"
    gc_freeze_at_start: bool = True  # freeze what startup loaded out of later garbage collections (gc_watch.py)
    gc_warn_ms: float = Field(default=50.0, ge=0)  # log a collector pause this long or longer; 0 = never
    # Generate's token ids per chunk when a request does not say (GenerateRequest.stream_interval_tokens); the first
    # token is never held. 1 streams each engine step's; more costs the router and workers fewer messages
    stream_interval_tokens: int = Field(default=1, ge=1)
    # Under load, up to this many for requests that do not say, while the event loop's lag (over half-second
    # windows) is above stream_lag_target_ms (router/stream_governor.py); 0 = never more than stream_interval_tokens
    stream_interval_max_tokens: int = Field(default=0, ge=0)
    stream_lag_target_ms: float = Field(default=5.0, gt=0)
    # TLS on the Router and Admin services (PEM paths; "" = plaintext). With tls_client_ca, every client must
    # present a certificate that CA signed (mTLS). metrics_tls: the metrics endpoint too (HTTPS, same files).
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    metrics_tls: bool = False
    # API keys (switchyard/auth.py): a file of keys per service, one per line; "" = no key needed. A call without
    # one of them ends UNAUTHENTICATED (the health service stays open). Re-read when the file changes.
    api_keys_file: str = ""
    admin_api_keys_file: str = ""

    @model_validator(mode="after")
    def _tls_pair(self) -> ServerConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("server.tls_cert and server.tls_key go together: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ValueError("server.tls_client_ca (mTLS) needs server.tls_cert and server.tls_key")
        if self.stream_interval_max_tokens and self.stream_interval_max_tokens < self.stream_interval_tokens:
            raise ValueError("server.stream_interval_max_tokens must be 0 (off) or >= server.stream_interval_tokens")
        if self.metrics_tls and not self.tls_cert:
            raise ValueError("server.metrics_tls serves the metrics with server.tls_cert and server.tls_key: set them")
        return self

    def tls(self) -> ServerTls | None:
        return ServerTls(self.tls_cert, self.tls_key, self.tls_client_ca) if self.tls_cert else None

    @field_validator("log_level")
    @classmethod
    def _known_level(cls, v: str) -> str:
        if v.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"unknown log level {v!r}; expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
        return v.upper()


class WorkersConfig(_Section):
    addresses: tuple[str, ...] = ()  # static host:port list; more can join through Admin.RegisterWorker
    stats_interval_s: float = Field(default=0.2, gt=0)  # Stats poll period, also the health check
    health_interval_s: float = Field(default=1.0, gt=0)  # reconnect period of an unreachable worker
    connect_timeout_s: float = Field(default=5.0, gt=0)  # Info on connect; startup waits this long for each
    rpc_timeout_s: float = Field(default=2.0, gt=0)  # one Stats / Abort call
    unhealthy_after_failures: int = Field(default=2, ge=1)  # consecutive failed Stats polls
    # a Generate stream with no chunk for this long has stalled (a hung engine whose server still answers):
    # the attempt fails, and is retried elsewhere if no token was sent yet; 0 = wait forever
    stream_idle_timeout_s: float = Field(default=120.0, ge=0)
    # ping each worker this often, and drop its connection if a ping gets no answer within keepalive_timeout_s:
    # the requests of a worker gone silent (a partition, a frozen host) fail, and those with no token yet are
    # retried elsewhere; 0 = no pings (they wait for their deadline or stream_idle_timeout_s)
    keepalive_time_s: float = Field(default=KEEPALIVE_TIME_S, ge=0)
    keepalive_timeout_s: float = Field(default=KEEPALIVE_TIMEOUT_S, gt=0)
    # send requests to each worker that serves it over one Session stream (worker.proto), not one Generate call
    # each: the worker sends every chunk ready at once, of all its requests, in one message
    session: bool = True
    # TLS to the workers: tls_ca checks their certificates ("" = the system's roots), tls_cert/tls_key are the
    # router's own when workers require client certificates (mTLS), tls_server_name the name their certificates
    # carry when it differs from the addresses dialled
    tls: bool = False
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_server_name: str = ""

    @model_validator(mode="after")
    def _tls_settings(self) -> WorkersConfig:
        if not self.tls and (self.tls_ca or self.tls_cert or self.tls_key or self.tls_server_name):
            raise ValueError("workers.tls_* is set but workers.tls is false: set workers.tls = true")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("workers.tls_cert and workers.tls_key go together: give both or neither")
        if 0 < self.keepalive_time_s < MIN_KEEPALIVE_TIME_S:
            raise ValueError(f"workers.keepalive_time_s must be 0 (off) or >= {MIN_KEEPALIVE_TIME_S:g}: workers "
                             "answer pings more frequent than that with GOAWAY too_many_pings")
        return self

    def channel_options(self) -> tuple[tuple[str, int], ...]:
        """The gRPC options of the router's channel to each worker: fast reconnects, and these keepalive pings."""
        return channel_options(self.keepalive_time_s, self.keepalive_timeout_s)

    def client_tls(self) -> ClientTls | None:
        return ClientTls(self.tls_ca, self.tls_cert, self.tls_key, self.tls_server_name) if self.tls else None


class RoutingConfig(_Section):
    policy: str = DEFAULT_POLICY  # a key of router.policies.registry.POLICIES
    tick_interval_ms: int = Field(default=100, gt=0)  # Policy.on_tick period
    # the policy's own knobs, its config's fields (e.g. switchyard: externality_weight = 1.0); checked at load
    params: dict[str, Any] = Field(default_factory=dict)


class QueueConfig(_Section):
    max_size: int = Field(default=1024, ge=0)  # requests held across all models; beyond: RESOURCE_EXHAUSTED
    kv_usage_hold_frac: float = Field(default=0.95, gt=0, le=1.0)  # a worker at or above this KV usage is full
    retry_after_ms: int = Field(default=500, ge=0)  # hint sent in trailing metadata when the queue is full


class LimitsConfig(_Section):
    max_tokens: int = Field(default=4096, gt=0)  # cap on SamplingParams.max_tokens


class TokenizerConfig(_Section):
    default: str = ""  # SentencePiece .model path for models not listed; "" = the bundled Mistral-7B one
    models: dict[str, str] = Field(default_factory=dict)  # model name -> .model path


class RetriesConfig(_Section):
    max_attempts: int = Field(default=3, ge=1)  # dispatch attempts per request (1 = never retry)


class PredictorConfig(_Section):
    """Output-length prediction (router/predictor/). A model answers within `timeout_ms` of admission, else the
    running-mean fallback does, so routing never waits longer."""

    model: str = "auto"  # a predictor name under the data dir, a path, "auto" (the default one if trained) or "none"
    threads: int = Field(default=1, ge=1)  # ONNX Runtime intra-op threads of the one predictor thread
    max_batch: int = Field(default=0, ge=0)  # requests per inference call; 0 = auto (1 on CPU, 16 on a GPU)
    max_wait_ms: float = Field(default=0.0, ge=0)  # 0: a batch is what queued while the previous one ran
    timeout_ms: float = Field(default=50.0, gt=0)  # from admission; past it the fallback answers
    prefer_client_hint: bool = True  # a request's predicted_output_tokens_hint beats the model (old behaviour)
    providers: tuple[str, ...] = ()  # ONNX Runtime providers in order; () = CUDA when listed, then CPU
    memo_entries: int = Field(default=100_000, ge=0)  # prompts remembered for exact repeats (LRU); 0 = no memo
    memo_window: int = Field(default=8, ge=1)  # a repeat's answer: the median of its last this many lengths


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    server: ServerConfig = ServerConfig()
    workers: WorkersConfig = WorkersConfig()
    routing: RoutingConfig = RoutingConfig()
    queue: QueueConfig = QueueConfig()
    limits: LimitsConfig = LimitsConfig()
    tokenizer: TokenizerConfig = TokenizerConfig()
    retries: RetriesConfig = RetriesConfig()
    predictor: PredictorConfig = PredictorConfig()

    @field_validator("routing")
    @classmethod
    def _known_policy(cls, v: RoutingConfig) -> RoutingConfig:
        from switchyard.router.policies.registry import POLICIES, SIMULATOR_ONLY, make_policy

        if v.policy not in POLICIES:
            raise ValueError(f"unknown policy {v.policy!r}; known: {', '.join(sorted(POLICIES))}")
        if v.policy in SIMULATOR_ONLY:
            raise ValueError(f"policy {v.policy!r} needs the whole workload in advance (an oracle); it runs only in "
                             "the simulator (`switchyard bench sim`)")
        if v.params:
            make_policy(v.policy, v.params)  # a wrong key or value fails here, at load, not at startup
        return v


SECTIONS: dict[str, type[_Section]] = {
    name: typing.get_type_hints(RouterConfig)[name] for name in RouterConfig.model_fields
}


# ---------------------------------------------------------------------- sources
def _check_keys(source: str, data: Mapping[str, Any]) -> None:
    for section, body in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"{source}: unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(body, Mapping):
            raise ConfigError(f"{source}: [{section}] must be a table")
        fields = SECTIONS[section].model_fields
        for key in body:
            if key not in fields:
                raise ConfigError(
                    f"{source}: unknown key {section}.{key}; known keys of [{section}]: {', '.join(fields)}"
                )


def _parse_str(section: str, key: str, raw: str) -> Any:
    """Turn an environment / CLI string into the field's shape; scalars are left to pydantic's coercion."""
    annotation = typing.get_type_hints(SECTIONS[section])[key]
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        raw = raw.strip()
        if raw.startswith("["):
            return json.loads(raw)
        return [part.strip() for part in raw.split(",") if part.strip()]
    if origin is dict:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{section}.{key} expects a JSON object, got {raw!r}") from e
    return raw


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path}: {e}") from e
    _check_keys(f"config file {path}", data)
    return data


def from_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """`SWITCHYARD_<SECTION>_<KEY>` variables. A variable naming a known section but an unknown key is an error;
    other `SWITCHYARD_*` variables (e.g. SWITCHYARD_NO_EXTENSIONS) belong to other components and are ignored."""
    out: dict[str, dict[str, Any]] = {}
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX) :].lower()
        for section in SECTIONS:
            if rest.startswith(section + "_"):
                key = rest[len(section) + 1 :]
                if key not in SECTIONS[section].model_fields:
                    raise ConfigError(
                        f"environment variable {name}: unknown key {section}.{key}; known keys of [{section}]: "
                        f"{', '.join(SECTIONS[section].model_fields)}"
                    )
                out.setdefault(section, {})[key] = _parse_str(section, key, raw)
                break
    return out


def split_assignment(item: str, flag: str, form: str) -> tuple[str, str, str]:
    """`HEAD.REST=VALUE` -> (head, rest, value), the names stripped; a ConfigError naming `flag` and the expected
    `form` otherwise (the CLI's `--set section.key=value` and the benches' `--param POLICY.KEY=VALUE`)."""
    dotted, sep, raw = item.partition("=")
    head, dot, rest = dotted.strip().partition(".")
    if not sep or not dot:
        raise ConfigError(f"{flag} {item!r}: expected {form}")
    return head, rest, raw


def parse_assignments(items: list[str]) -> dict[str, Any]:
    """CLI `--set section.key=value` items, and `--set section.table.key=value` for one key of a table field
    (its value a string, converted by whoever reads the table: the policy's config for `routing.params`)."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        section, key, raw = split_assignment(item, "--set", "section.key=value")
        key, dot2, sub = key.partition(".")
        _check_keys("--set", {section: {key: None}})
        if dot2:
            if typing.get_origin(typing.get_type_hints(SECTIONS[section])[key]) is not dict:
                raise ConfigError(f"--set {item!r}: {section}.{key} is not a table")
            out.setdefault(section, {}).setdefault(key, {})[sub] = raw
            continue
        out.setdefault(section, {})[key] = _parse_str(section, key, raw)
    return out


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Section-wise merge; a later layer's key replaces an earlier one's (lists are replaced, not appended), but
    tables merge key by key (a `--set routing.params.x=...` keeps the file's other params)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in layers:
        for section, body in layer.items():
            sec = out.setdefault(section, {})
            for key, value in body.items():
                old = sec.get(key)
                sec[key] = {**old, **value} if isinstance(old, Mapping) and isinstance(value, Mapping) else value
    return out


def build(data: Mapping[str, Any]) -> RouterConfig:
    _check_keys("config", data)
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors(include_url=False)
        )
        raise ConfigError(f"invalid configuration: {problems}") from None


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> RouterConfig:
    """Defaults < TOML file < environment < `overrides` (the CLI's, already shaped as {section: {key: value}})."""
    layers: list[Mapping[str, Any]] = []
    if path is not None:
        layers.append(load_toml(path))
    layers.append(from_env(os.environ if environ is None else environ))
    if overrides:
        _check_keys("command line", overrides)
        layers.append(overrides)
    return build(merge(*layers))


def to_toml(config: RouterConfig) -> str:
    """The effective configuration as a TOML file (`switchyard serve --print-config`)."""
    lines: list[str] = []
    for section, body in config.model_dump().items():
        tables = {k: v for k, v in body.items() if isinstance(v, dict)}
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(list(v) if isinstance(v, tuple) else v)}" for k, v in body.items() if k not in tables]
        for key, table in tables.items():
            lines.append(f"[{section}.{key}]")
            lines += [f"{json.dumps(k)} = {json.dumps(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)
