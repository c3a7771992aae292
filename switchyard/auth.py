"""API keys on the router's gRPC services: which clients may call, on top of (or instead of) TLS client certificates.

Why keys when mTLS exists: an operator hands a team a key, not a certificate authority, and revokes it by editing a
file. Each service (Router, Admin) takes its own file, one key per line; a call must carry `authorization: Bearer
<key>` metadata or it ends `UNAUTHENTICATED`. The health service stays open (load balancers' probes carry no key).
The file is re-read when it changes, checked at the next call, so adding or revoking a key takes no restart. Keys
are kept only as SHA-256 digests, so the check's time does not depend on how much of a key matched.

A key's line may name its holder and limit it (`KeySpec`): one team's burst or runaway script then ends in
`RESOURCE_EXHAUSTED` for that team, not in a queue every other team waits behind; and `isolate` keeps the team's
prompts out of every other caller's prefix cache (a shared cache tells a caller, by its speed, whether someone
else sent the same prefix). Calls and rate count calls; `tokens_per_min` counts what the GPUs do (a 30k-token
prompt is not one call's worth of work), charged by the Router service once a prompt is tokenized.
"""

from __future__ import annotations

import contextvars
import hashlib
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import grpc

from switchyard.watched import Watched

log = logging.getLogger(__name__)

MIN_KEY_LEN = 16  # a shorter key is guessable; generate one with `openssl rand -hex 24`
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes served without a key


class AuthError(ValueError):
    """An API keys file is missing, unreadable, empty or holds a key too weak to use."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


FIELDS = ("name", "max_in_flight", "rate", "burst", "tokens_per_min", "isolate")
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
ISOLATED_SALT_PREFIX = "tenant:"  # what an isolated key's cache salts start with; refused from every other caller


@dataclass(frozen=True, slots=True)
class KeySpec:
    """One key's line: `<key> [name=N] [max_in_flight=N] [rate=R] [burst=B] [tokens_per_min=T] [isolate=true]`.

    `name` labels its metrics and logs (default `sha256:` and 8 hex digits of its digest, stable across reorderings
    of the file and no help to a guesser); `max_in_flight` caps its concurrent calls, `rate` its calls per second
    (a token bucket of `burst` calls, default max(1, ceil(rate))), `tokens_per_min` its model tokens (prompt plus
    output: `KeyLimits.reserve_tokens`); 0 = no limit. `isolate` prefixes its requests' cache salt with
    `tenant:<name>:`, so they share prefix-cache blocks only with each other.
    """

    name: str
    max_in_flight: int = 0
    rate: float = 0.0
    burst: int = 0
    isolate: bool = False
    tokens_per_min: int = 0


def _spec(fields: list[str], digest: bytes, where: str) -> KeySpec:
    got: dict[str, str] = {}
    for f in fields:
        k, eq, v = f.partition("=")
        if not eq or k not in FIELDS or k in got:
            raise AuthError(f"{where}: {f!r} is not one of name=, max_in_flight=, rate=, burst=, tokens_per_min=, "
                            "isolate= (each once)")
        got[k] = v
    name = got.get("name", f"sha256:{digest.hex()[:8]}")
    if "name" in got and not NAME_RE.fullmatch(name):
        raise AuthError(f"{where}: name {name!r} is not 1-64 letters, digits, '_', '.', '-'")
    try:
        max_in_flight = int(got.get("max_in_flight", "0"))
        rate = float(got.get("rate", "0"))
        burst = int(got.get("burst", "0"))
        tokens_per_min = int(got.get("tokens_per_min", "0"))
    except ValueError as e:
        raise AuthError(f"{where}: {e}") from None
    if max_in_flight < 0 or burst < 0 or tokens_per_min < 0 or not (math.isfinite(rate) and rate >= 0):
        raise AuthError(f"{where}: max_in_flight, rate, burst and tokens_per_min must be >= 0 (0 = no limit)")
    if burst and not rate:
        raise AuthError(f"{where}: burst= needs rate=")
    isolate = got.get("isolate", "false").lower()
    if isolate not in ("true", "false"):
        raise AuthError(f"{where}: isolate must be true or false, got {isolate!r}")
    return KeySpec(name, max_in_flight, rate, burst or (max(1, math.ceil(rate)) if rate else 0), isolate == "true",
                   tokens_per_min)


def parse_line(words: list[str], where: str) -> tuple[bytes, KeySpec]:
    """One line of a keys file, split on whitespace: (the key's digest, its spec); AuthError naming `where`."""
    key, *fields = words
    if len(key) < MIN_KEY_LEN or not key.isascii() or not key.isprintable():
        raise AuthError(f"{where} is not {MIN_KEY_LEN}+ printable ASCII characters without spaces")
    if key.partition("=")[0] in FIELDS:  # (a base64 key may hold '=')
        raise AuthError(f"{where} starts with a field, not a key")
    digest = _digest(key)
    return digest, _spec(fields, digest, where)


def read_keys(path: str) -> dict[bytes, KeySpec]:
    """The keys in `path` by digest: one per line (`KeySpec`), blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AuthError(f"cannot read the API keys file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    out: dict[bytes, KeySpec] = {}
    names: set[str] = set()
    rows = [x.split() for x in lines if x.strip() and not x.strip().startswith("#")]
    if not rows:
        raise AuthError(f"the API keys file {path!r} holds no key")
    for n, row in enumerate(rows, 1):
        digest, spec = parse_line(row, f"key {n} of {path!r}")
        if digest in out or spec.name in names:
            raise AuthError(f"key {n} of {path!r} repeats a key or the name {spec.name!r}")
        out[digest] = spec
        names.add(spec.name)
    return out


class ApiKeys:
    """The keys one service accepts, re-read at the next call after their file changes (`Watched`: a file that no
    longer loads keeps the previous keys, with a warning)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._specs = Watched((path,), lambda: read_keys(path), f"the API keys file {path}", (AuthError,))
        self._names: tuple[dict[bytes, KeySpec], dict[str, KeySpec]] | None = None  # (specs, by name) of the last read

    def named(self, name: str) -> KeySpec | None:
        """The key called `name` (`KeySpec.name`, unique in a file), None for none: how another router replica's
        request (`RequestAdmitted.tenant`) finds its key's limits."""
        self._specs.refresh()
        specs = self._specs.value
        if self._names is None or self._names[0] is not specs:
            self._names = (specs, {s.name: s for s in specs.values()})
        return self._names[1].get(name)

    def find(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> KeySpec | None:
        """The caller's key (its `authorization: Bearer` metadata), None for a missing or unknown one."""
        self._specs.refresh()
        for k, v in metadata or ():
            if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
                return self._specs.value.get(_digest(v[7:]))
        return None


# The key of the call being served (set by ApiKeyInterceptor around the service's handler), None without keys.
calling_key: contextvars.ContextVar[KeySpec | None] = contextvars.ContextVar("calling_key", default=None)


def cache_salt_for(salt: str, key: KeySpec | None) -> str:
    """The cache salt a request of `key` is served with; ValueError for a salt only an isolated key may use."""
    if key is not None and key.isolate:
        return f"{ISOLATED_SALT_PREFIX}{key.name}:{salt}"
    if salt.startswith(ISOLATED_SALT_PREFIX):
        raise ValueError(f"cache_salt may not start with {ISOLATED_SALT_PREFIX!r} (kept for isolated API keys)")
    return salt


class Refusal(NamedTuple):
    """Why a key's call may not start: `limit` (max_in_flight, rate, tokens_per_min), the status message, and for
    the rate and tokens the milliseconds until the call would pass (sent as the `retry-after-ms` trailer, as a full
    queue's is; none where no wait will do)."""

    limit: str
    message: str
    retry_after_ms: int | None = None


class KeyLimits:
    """Each key's calls in flight and its two token buckets (calls per second, model tokens per minute), by name
    (so they survive a reload of the file), counting the other router replicas' requests too (`note_peer_call`).

    Pure: the clock is injected (the buckets' only input beside the calls)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._peer_in_flight: dict[str, int] = {}  # the other replicas' requests of the key open on the workers
        self._buckets: dict[str, tuple[float, float]] = {}  # name -> (tokens, when)
        self._model_tokens: dict[str, tuple[float, float]] = {}  # name -> (model tokens left, when)

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    def peer_in_flight(self, name: str) -> int:
        return self._peer_in_flight.get(name, 0)

    def acquire(self, key: KeySpec) -> Refusal | None:
        """Take one call for `key`: None when it may start (`release` it at its end), else why not."""
        own = self._in_flight.get(key.name, 0)
        peers = self._peer_in_flight.get(key.name, 0)
        if key.max_in_flight and own + peers >= key.max_in_flight:
            where = f" ({peers} through other router replicas)" if peers else ""
            return Refusal("max_in_flight", f"max_in_flight: API key {key.name!r} has {own + peers} calls in flight"
                                            f"{where}, its limit")
        if key.rate:
            tokens, now = self._fill(self._buckets, key.name, float(key.burst), key.rate)
            if tokens < 1.0:
                self._buckets[key.name] = (tokens, now)
                wait_s = (1.0 - tokens) / key.rate
                return Refusal("rate", f"rate: API key {key.name!r} is over {key.rate:g} calls/s (burst {key.burst}); "
                                       f"retry in {wait_s:.3f} s", math.ceil(wait_s * 1000))
            self._buckets[key.name] = (tokens - 1.0, now)
        self._in_flight[key.name] = own + 1
        return None

    def tokens_left(self, key: KeySpec) -> float:
        """The model tokens `key` may reserve now (inf without a `tokens_per_min`)."""
        return self._refill(key)[0] if key.tokens_per_min else math.inf

    def _refill(self, key: KeySpec) -> tuple[float, float]:
        """(model tokens in key's bucket now, now): a minute's worth at most, refilled continuously."""
        return self._fill(self._model_tokens, key.name, float(key.tokens_per_min), key.tokens_per_min / 60.0)

    def _fill(self, buckets: dict[str, tuple[float, float]], name: str, cap: float,
              per_s: float) -> tuple[float, float]:
        """(what `name`'s bucket of `buckets` holds now, now): full when new, refilled at `per_s` up to `cap`."""
        now = self._clock()
        left, at = buckets.get(name, (cap, now))
        return min(cap, left + (now - at) * per_s), now

    def reserve_tokens(self, key: KeySpec, tokens: int) -> Refusal | None:
        """Take `tokens` model tokens (a request's prompt plus its max_tokens) from key's bucket: None when they
        were there (`refund_tokens` what the request did not use), else why not, with the wait until they
        would be. A request larger than a minute's worth never passes, and says so."""
        if not key.tokens_per_min:
            return None
        if tokens > key.tokens_per_min:
            return Refusal("tokens_per_min", f"tokens_per_min: API key {key.name!r} may use {key.tokens_per_min} tokens "
                                             f"a minute; this request needs {tokens} (prompt + max_tokens): lower "
                                             "max_tokens or split the prompt")
        left, now = self._refill(key)
        if left < tokens:
            self._model_tokens[key.name] = (left, now)
            wait_s = (tokens - left) * 60.0 / key.tokens_per_min
            return Refusal("tokens_per_min", f"tokens_per_min: API key {key.name!r} is over {key.tokens_per_min} "
                                             f"tokens/min ({tokens} asked, {left:.0f} left); retry in {wait_s:.3f} s",
                           math.ceil(wait_s * 1000))
        self._model_tokens[key.name] = (left - tokens, now)
        return None

    def refund_tokens(self, key: KeySpec, tokens: int) -> None:
        """Give back reserved tokens a request did not use (its output stopped short of max_tokens, or it never
        ran); the bucket never holds more than a minute's worth."""
        if key.tokens_per_min and tokens > 0:
            left, now = self._refill(key)
            self._model_tokens[key.name] = (min(float(key.tokens_per_min), left + tokens), now)

    def release(self, key: KeySpec) -> None:
        _count_down(self._in_flight, key.name)

    # Another router replica's request of the key, as a worker reported it (`switchyard.router.peer_keys`). Every
    # replica hears of every other's requests, one event lag late, so each one's buckets and counts track the key's
    # use across the replicas. What it took is taken here too, even past empty (down to minus the bucket's size): a
    # replica that let a call through on a token another replica had just spent refuses until the key is back within
    # its limit.

    def note_peer_call(self, key: KeySpec, tokens: int, charge: bool = True) -> None:
        """Another replica started a request of `key` that reserved `tokens` model tokens (0: no quota): one call
        in flight until `note_peer_end`, and where `charge`, one from the rate bucket and `tokens` from the tokens
        bucket (not for a request counted before, re-announced)."""
        self._peer_in_flight[key.name] = self._peer_in_flight.get(key.name, 0) + 1
        if not charge:
            return
        if key.rate:
            left, now = self._fill(self._buckets, key.name, float(key.burst), key.rate)
            self._buckets[key.name] = (max(-float(key.burst), left - 1.0), now)
        if key.tokens_per_min and tokens > 0:
            left, now = self._refill(key)
            self._model_tokens[key.name] = (max(-float(key.tokens_per_min), left - tokens), now)

    def note_peer_end(self, key: KeySpec, refund_tokens: int) -> None:
        """That request ended: its call leaves the count, and what it reserved but did not use goes back."""
        _count_down(self._peer_in_flight, key.name)
        self.refund_tokens(key, refund_tokens)


@dataclass(slots=True)
class TokenCharge:
    """A request's reservation against its API key's `tokens_per_min` (prompt + max_tokens), and what it used:
    its prompt once it ran (a chunk came back), and each output token. What a request reserved and did not use
    goes back to the key when it ends (`KeyLimits.refund_tokens`, `note_peer_end`), whichever replica served it."""

    key: KeySpec
    prompt: int
    reserved: int
    ran: bool = False
    output: int = 0

    def seen(self, num_tokens: int) -> None:
        """A chunk of `num_tokens` output tokens came back (the prompt was computed)."""
        self.ran = True
        self.output += num_tokens

    @property
    def used(self) -> int:
        return (self.prompt if self.ran else 0) + self.output


def _count_down(counts: dict[str, int], name: str) -> None:
    n = counts.get(name, 0) - 1
    if n > 0:
        counts[name] = n
    else:
        counts.pop(name, None)


class KeyEvents(Protocol):
    """What the interceptor reports (the router counts them in its metrics)."""

    def unauthenticated(self, service: str) -> None: ...
    def started(self, key: str) -> None: ...
    def limited(self, key: str, limit: str) -> None: ...
    def ended(self, key: str) -> None: ...
    def tokens(self, key: str, n: int) -> None: ...  # model tokens a request of the key used (tokens_per_min keys)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call without a valid key `UNAUTHENTICATED` and one over its key's limits `RESOURCE_EXHAUSTED`, before
    it reaches the service; runs the others with `calling_key` set to their key."""

    def __init__(self, keys: ApiKeys, events: KeyEvents, limits: KeyLimits | None = None) -> None:
        self._keys, self._events, self._limits = keys, events, limits or KeyLimits()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(OPEN_METHODS):
            return handler
        key = self._keys.find(details.invocation_metadata)  # type: ignore[attr-defined]
        if key is None:
            self._events.unauthenticated(method.split("/")[1] if method.count("/") >= 2 else method)
            return _ending(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "missing or unknown API key: send 'authorization: Bearer <key>' metadata")
        if not (handler.unary_unary or handler.unary_stream):
            return handler  # a streaming request (server reflection): keyed, neither limited nor isolated
        return self._as_key(handler, key)

    def _as_key(self, handler: grpc.RpcMethodHandler, key: KeySpec) -> grpc.RpcMethodHandler:
        """`handler` (an async servicer method: the Router's and Admin's all are) run with `calling_key` set to
        `key`, inside one of the key's slots (`KeyLimits`), or ended `RESOURCE_EXHAUSTED` without one.

        NOTE: the slot is taken when the handler starts, not at interception, and given back in its `finally`
        (grpc.aio cancels the handler's task when the call is cancelled): a call cancelled between the two never
        holds one."""
        limits, events = self._limits, self._events
        codecs = {"request_deserializer": handler.request_deserializer,
                  "response_serializer": handler.response_serializer}

        async def enter(context: grpc.aio.ServicerContext) -> None:
            refusal = limits.acquire(key)
            if refusal is not None:
                events.limited(key.name, refusal.limit)
                if refusal.retry_after_ms is not None:
                    context.set_trailing_metadata((("retry-after-ms", str(refusal.retry_after_ms)),))
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal.message)
            calling_key.set(key)
            events.started(key.name)

        def end() -> None:
            limits.release(key)
            events.ended(key.name)

        if handler.unary_unary:
            inner_uu = handler.unary_unary

            async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                await enter(context)
                try:
                    return await inner_uu(request, context)
                finally:
                    end()
            return grpc.unary_unary_rpc_method_handler(unary, **codecs)
        inner_us = handler.unary_stream

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await enter(context)
            try:
                async for item in inner_us(request, context):
                    yield item
            finally:
                end()
        return grpc.unary_stream_rpc_method_handler(stream, **codecs)


def _ending(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts with `code`."""

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    codecs = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **codecs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny, **codecs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **codecs)
    return grpc.stream_stream_rpc_method_handler(deny, **codecs)


# ---------------------------------------------------------------------------------------------- the client's side
class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


class _SyncDetails(_CallDetails, grpc.ClientCallDetails):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):

    def __init__(self, key: str) -> None:
        self._md = ("authorization", f"Bearer {key}")

    def _with_key(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _SyncDetails(d.method, d.timeout, [*(d.metadata or ()), self._md], d.credentials,  # type: ignore[attr-defined]
                            getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_key(client_call_details), request)


class _AioKey:
    def __init__(self, key: str) -> None:
        self._md = ("authorization", f"Bearer {key}")

    def _with_key(self, d: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        return d._replace(metadata=grpc.aio.Metadata(*(d.metadata or ()), self._md))


class _AioUnaryKey(_AioKey, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_key(client_call_details), request)


class _AioStreamKey(_AioKey, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):  # type: ignore[no-untyped-def]
        return await continuation(self._with_key(client_call_details), request)


def bearer_key(key: str | None) -> list[Any]:
    """Interceptors that add `authorization: Bearer <key>` to every call of a blocking channel; none without a key."""
    return [_BearerKey(key)] if key else []


def aio_bearer_key(key: str | None) -> list[grpc.aio.ClientInterceptor]:
    """The same for an asyncio channel. Two objects: an asyncio channel files an interceptor under the first call
    type it implements only."""
    return [_AioUnaryKey(key), _AioStreamKey(key)] if key else []
