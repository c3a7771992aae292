"""API keys on the router's gRPC services: which clients may call, on top of (or instead of) TLS client certificates.

Why keys when mTLS exists: an operator hands a team a key, not a certificate authority, and revokes it by editing a
file. Each service (Router, Admin) takes its own file, one key per line; a call must carry `authorization: Bearer
<key>` metadata or it ends `UNAUTHENTICATED`. The health service stays open (load balancers' probes carry no key).
The file is re-read when it changes, checked at the next call, so adding or revoking a key takes no restart. Keys
are kept only as SHA-256 digests, so the check's time does not depend on how much of a key matched.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from switchyard.watched import Watched

log = logging.getLogger(__name__)

MIN_KEY_LEN = 16  # a shorter key is guessable; generate one with `openssl rand -hex 24`
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # prefixes served without a key


class AuthError(ValueError):
    """An API keys file is missing, unreadable, empty or holds a key too weak to use."""


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_keys(path: str) -> frozenset[bytes]:
    """The digests of the keys in `path`: one per line, blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise AuthError(f"cannot read the API keys file {path!r}: {getattr(e, 'strerror', None) or e}") from None
    keys = [x.strip() for x in lines if x.strip() and not x.strip().startswith("#")]
    if not keys:
        raise AuthError(f"the API keys file {path!r} holds no key")
    for n, key in enumerate(keys, 1):
        if len(key) < MIN_KEY_LEN or not key.isascii() or not key.isprintable() or " " in key:
            raise AuthError(f"key {n} of {path!r} is not {MIN_KEY_LEN}+ printable ASCII characters without spaces")
    return frozenset(_digest(k) for k in keys)


class ApiKeys:
    """The keys one service accepts, re-read at the next call after their file changes (`Watched`: a file that no
    longer loads keeps the previous keys, with a warning)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._digests = Watched((path,), lambda: read_keys(path), f"the API keys file {path}", (AuthError,))

    def allows(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        self._digests.refresh()
        for k, v in metadata or ():
            if k == "authorization" and isinstance(v, str) and v.startswith("Bearer "):
                return _digest(v[7:]) in self._digests.value
        return False


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Ends a call without a valid key `UNAUTHENTICATED` before it reaches the service; `on_denied(service)` counts it."""

    def __init__(self, keys: ApiKeys, on_denied: Callable[[str], None] = lambda _service: None) -> None:
        self._keys, self._on_denied = keys, on_denied

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method: str = details.method  # type: ignore[attr-defined]
        if handler is None or method.startswith(OPEN_METHODS):
            return handler
        if self._keys.allows(details.invocation_metadata):  # type: ignore[attr-defined]
            return handler
        self._on_denied(method.split("/")[1] if method.count("/") >= 2 else method)
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that only aborts."""

    async def deny(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or unknown API key: send 'authorization: Bearer <key>' metadata")

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
