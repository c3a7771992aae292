"""TLS for every gRPC hop: the router's API and admin servers, its channels to the workers, the workers' servers and
the client.

Why one module: the router, the workers (also inside vLLM's environment) and the client read the same PEM files
the same way, and a wrong file fails the same way, at startup, with a message that names it: a certificate and a
key that do not match, or a CA file that holds no certificate, would otherwise surface only as a failed handshake
on the first request. Rotated files serve the next handshake and leave live connections as they are: a server's
files are checked before each handshake, the router's own client files before it dials a worker again
(`ClientTls.reload`); `switchyard.watched` holds the rules.
"""

from __future__ import annotations

import argparse
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from switchyard.watched import Watched

ChannelOptions = Sequence[tuple[str, str | int]]
T = TypeVar("T")

log = logging.getLogger(__name__)


class TlsError(ValueError):
    """A TLS file is missing, unreadable, or not what its setting says it is."""


def _no_password() -> bytes:
    raise TlsError("encrypted private keys are not supported (gRPC cannot read them); decrypt the key file")


def read_pem(path: str, what: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TlsError(f"cannot read the {what} {path!r}: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"the {what} {path!r} is not PEM (no '-----BEGIN' line)")
    return data


def _check_pair(cert: str, key: str, ctx: ssl.SSLContext | None = None) -> None:
    """Load the pair into `ctx` (a scratch context when None, only to check it)."""
    ctx = ctx or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_cert_chain(cert, key, password=_no_password)
    except OSError as e:  # ssl.SSLError, or a file gone mid-rotation
        raise TlsError(f"the certificate {cert!r} and key {key!r} do not load as a pair: "
                       f"{getattr(e, 'reason', None) or e}") from None


def _check_ca(ca: str, ctx: ssl.SSLContext | None = None) -> None:
    """Load the CA file into `ctx` (a scratch context when None, only to check it)."""
    ctx = ctx or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca)
    except OSError as e:  # ssl.SSLError, or a file gone mid-rotation
        raise TlsError(f"the CA file {ca!r} holds no usable certificate: {getattr(e, 'reason', None) or e}") from None


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key; with `client_ca`, clients must present a certificate it signed (mTLS).
    The files are watched: a rotated certificate, key or CA serves the next handshake (`Watched`)."""

    cert: str
    key: str
    client_ca: str = ""

    def files(self) -> tuple[str, ...]:
        return (self.cert, self.key, self.client_ca) if self.client_ca else (self.cert, self.key)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        """The files read and checked now (a TlsError names the file)."""
        cert, key = read_pem(self.cert, "certificate"), read_pem(self.key, "private key")
        _check_pair(self.cert, self.key)
        client_ca = None
        if self.client_ca:
            client_ca = read_pem(self.client_ca, "client CA file")
            _check_ca(self.client_ca)
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=client_ca)

    def credentials(self) -> grpc.ServerCredentials:
        """Read and checked now, then reloaded by each handshake that finds a file changed (gRPC calls the fetcher
        on its own thread before each handshake). One per server: gRPC binds a dynamic credentials object to one
        server (a second `add_secure_port` fails)."""
        watched = self._watched(self.configuration)

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            try:
                return watched.value if watched.refresh() else None
            except Exception:  # noqa: BLE001 - raised into gRPC's thread it would fail the handshake, not report
                log.exception("TLS reload failed; the previous certificate stays")
                return None

        return grpc.dynamic_ssl_server_credentials(watched.value, fetch,
                                                   require_client_authentication=bool(self.client_ca))

    def _watched(self, load: Callable[[], T]) -> Watched[T]:
        return Watched(self.files(), load, f"the TLS files of {self.cert}", (TlsError,))

    def ssl_context(self) -> ssl.SSLContext:
        """An HTTPS server's context from the files as they are now (a TlsError names the file)."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        read_pem(self.cert, "certificate")
        read_pem(self.key, "private key")
        _check_pair(self.cert, self.key, ctx)
        if self.client_ca:
            read_pem(self.client_ca, "client CA file")
            _check_ca(self.client_ca, ctx)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def on_hello(self) -> Callable[[ssl.SSLSocket, str | None, ssl.SSLContext], None]:
        """An `sni_callback` that gives an HTTPS server the gRPC servers' reload: OpenSSL calls it at each
        ClientHello, with or without a server name, and the handshake goes on with the context of the files as
        they are now (`SSLSocket.context`, switched before the certificate is sent). The files are read and
        checked here first (a TlsError names a bad one). The base context's verify mode stays (OpenSSL keeps it on
        a switch), so it must be this one's: mTLS or not."""
        watched = self._watched(self.ssl_context)

        def hello(sock: ssl.SSLSocket, _server_name: str | None, _base: ssl.SSLContext) -> None:
            try:
                watched.refresh()
            except Exception:  # noqa: BLE001 - raised here it would fail the handshake, not report
                log.exception("TLS reload failed; the previous certificate stays")
            sock.context = watched.value

        return hello


class _Loaded:
    """A `ClientTls`'s files, once loaded (on first use)."""

    watched: Watched[grpc.ChannelCredentials] | None = None


@dataclass(frozen=True)
class ClientTls:
    """How a client checks a server and, for mTLS, proves itself. `ca` = "": the system's trusted roots.
    `server_name`: the name the server's certificate must carry, when it differs from the address dialled."""

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""
    _loaded: _Loaded = field(default_factory=_Loaded, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TlsError("a client certificate and its key go together: give both or neither")

    def files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.ca, self.cert, self.key) if f)

    @property
    def credentials(self) -> grpc.ChannelCredentials:
        """The files as last loaded: read and checked on first use (a TlsError names the file)."""
        return self._watched().value

    @property
    def generation(self) -> int:
        """Which load `credentials` is: a channel built from an older one predates a rotation."""
        return self._watched().generation

    def reload(self) -> bool:
        """Once loaded, re-read the files if one moved: True when new credentials were loaded (channels built from
        now on use them); files that do not load keep the previous credentials (`Watched`)."""
        watched = self._loaded.watched
        return watched is not None and watched.refresh()

    def _watched(self) -> Watched[grpc.ChannelCredentials]:
        if self._loaded.watched is None:
            self._loaded.watched = Watched(self.files(), self._read, "the TLS client files", (TlsError,))
        return self._loaded.watched

    def _read(self) -> grpc.ChannelCredentials:
        ca = None
        if self.ca:
            ca = read_pem(self.ca, "CA file")
            _check_ca(self.ca)
        cert = key = None
        if self.cert:
            cert, key = read_pem(self.cert, "client certificate"), read_pem(self.key, "client key")
            _check_pair(self.cert, self.key)
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def options(self) -> list[tuple[str, str | int]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_port(server: grpc.Server | grpc.aio.Server, address: str, tls: ServerTls | None) -> int:
    """Bind `address`, with TLS when given; the bound port (0: it failed), as gRPC's own calls."""
    return server.add_secure_port(address, tls.credentials()) if tls is not None else server.add_insecure_port(address)


def aio_channel(address: str, tls: ClientTls | None, options: ChannelOptions = (),
                interceptors: Sequence[grpc.aio.ClientInterceptor] = ()) -> grpc.aio.Channel:
    ics = list(interceptors) or None
    if tls is None:
        return grpc.aio.insecure_channel(address, options=list(options), interceptors=ics)
    return grpc.aio.secure_channel(address, tls.credentials, options=[*options, *tls.options()], interceptors=ics)


def channel(address: str, tls: ClientTls | None, options: ChannelOptions = (),
            interceptors: Sequence[Any] = ()) -> grpc.Channel:
    if tls is None:
        ch = grpc.insecure_channel(address, options=list(options))
    else:
        ch = grpc.secure_channel(address, tls.credentials, options=[*options, *tls.options()])
    return grpc.intercept_channel(ch, *interceptors) if interceptors else ch


def add_server_args(p: argparse.ArgumentParser) -> None:
    """A worker's TLS flags (the router's are config keys: server.tls_*)."""
    p.add_argument("--tls-cert", default="", help="PEM certificate chain: serve gRPC over TLS (with --tls-key)")
    p.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", default="", help="PEM CA: clients (the router) must present a certificate it signed")


def server_tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    if not (args.tls_cert or args.tls_key or args.tls_client_ca):
        return None
    if not (args.tls_cert and args.tls_key):
        raise TlsError("--tls-cert and --tls-key go together (and --tls-client-ca needs them)")
    return ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca)
