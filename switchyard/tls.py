"""TLS for every gRPC hop: the router's API and admin servers, its channels to the workers, the workers' servers and
the client.

Why one module: the router, the workers (also inside vLLM's environment) and the client read the same PEM files
the same way, and a wrong file fails the same way, at startup, with a message that names it: a certificate and a
key that do not match, or a CA file that holds no certificate, would otherwise surface only as a failed handshake
on the first request. Rotated files serve the next handshake and leave live connections as they are: a server's
files are checked before each handshake (`_Reloader`), the router's own client files before it dials a worker again
(`ClientTls.reload`).
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import grpc

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
    except ssl.SSLError as e:
        raise TlsError(f"the certificate {cert!r} and key {key!r} do not load as a pair: {e.reason or e}") from None


def _check_ca(ca: str, ctx: ssl.SSLContext | None = None) -> None:
    """Load the CA file into `ctx` (a scratch context when None, only to check it)."""
    ctx = ctx or ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        ctx.load_verify_locations(cafile=ca)
    except ssl.SSLError as e:
        raise TlsError(f"the CA file {ca!r} holds no usable certificate: {e.reason or e}") from None


@dataclass(frozen=True)
class ServerTls:
    """A server's certificate chain and key; with `client_ca`, clients must present a certificate it signed (mTLS).
    The files are watched: a rotated certificate, key or CA serves the next handshake (`_Reloader`)."""

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
        """Read and checked now, then reloaded by each handshake that finds a file changed. One per server: gRPC
        binds a dynamic credentials object to one server (a second `add_secure_port` fails)."""
        reloader = _Reloader(self, self.configuration)
        return grpc.dynamic_ssl_server_credentials(self.configuration(), reloader,
                                                   require_client_authentication=bool(self.client_ca))

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
        ClientHello, with or without a server name, and when the files moved and load as a pair, that handshake
        and the later ones take them (`SSLSocket.context`, switched before the certificate is sent). The base
        context's verify mode stays (OpenSSL keeps it on a switch), so it must be this one's: mTLS or not."""
        reloader = _Reloader(self, self.ssl_context)
        current: list[ssl.SSLContext] = []

        def hello(sock: ssl.SSLSocket, _server_name: str | None, _base: ssl.SSLContext) -> None:
            fresh = reloader()
            if fresh is not None:
                current[:] = [fresh]
            if current:
                sock.context = current[0]

        return hello


def file_stamps(paths: tuple[str, ...]) -> tuple[tuple[int, int, int] | None, ...]:
    """Per file (mtime_ns, size, inode), None for one missing: a rename over it (a rotation) changes the inode."""
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)  # gone for a moment, mid-rotation
        else:
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


class _Reloader(Generic[T]):
    """A server calls it before each TLS handshake (gRPC on its own thread, an HTTPS server from `on_hello`): when
    a file's stamp moved, the files are loaded again (`load`) and what they give serves that handshake on. Why
    check first: a rotation writes two or three files one after the other, and a certificate with the previous key
    would fail every handshake; until the files agree, the previous certificate stays (logged once per state of
    the files)."""

    def __init__(self, tls: ServerTls, load: Callable[[], T]) -> None:
        self._tls, self._load = tls, load
        self._stamp = file_stamps(tls.files())  # taken before the first read: a change during it is read again
        self._logged: tuple[tuple[int, int, int] | None, ...] | None = None

    def __call__(self) -> T | None:
        try:
            stamp = file_stamps(self._tls.files())
            if stamp == self._stamp:
                return None
            try:
                config = self._load()
            except TlsError as e:
                if stamp != self._logged:
                    self._logged = stamp
                    log.warning("TLS files changed but do not load (the previous certificate stays): %s", e)
                return None
            self._stamp = stamp
            log.info("TLS certificate reloaded from %s", self._tls.cert)
            return config
        except Exception:  # noqa: BLE001 - raised into gRPC's thread it would fail the handshake, not report
            log.exception("TLS reload failed; the previous certificate stays")
            return None


class _Loaded:
    """What a `ClientTls` last loaded: its credentials, the files' stamps they were read at, and a count of loads."""

    def __init__(self) -> None:
        self.credentials: grpc.ChannelCredentials | None = None
        self.stamp: tuple[tuple[int, int, int] | None, ...] = ()
        self.generation = 0
        self.logged: tuple[tuple[int, int, int] | None, ...] | None = None


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
        loaded = self._loaded
        if loaded.credentials is None:
            stamp = file_stamps(self.files())  # taken before the read: a change during it is read again
            loaded.credentials, loaded.stamp, loaded.generation = self._read(), stamp, loaded.generation + 1
        return loaded.credentials

    @property
    def generation(self) -> int:
        """Which load `credentials` is: a channel built from an older one predates a rotation."""
        self.credentials  # noqa: B018 - loaded on first use
        return self._loaded.generation

    def reload(self) -> bool:
        """Re-read the files if one moved since the last load: True when new credentials were loaded (channels
        built from now on use them). Files that do not load (a rotation half-written: a new certificate beside
        the old key) keep the previous credentials, with a warning logged once per state of the files."""
        loaded = self._loaded
        if loaded.credentials is None or not self.files():
            return False
        stamp = file_stamps(self.files())
        if stamp == loaded.stamp:
            return False
        try:
            credentials = self._read()
        except TlsError as e:
            if stamp != loaded.logged:
                loaded.logged = stamp
                log.warning("TLS client files changed but do not load (the previous ones stay): %s", e)
            return False
        loaded.credentials, loaded.stamp, loaded.generation = credentials, stamp, loaded.generation + 1
        log.info("TLS client certificate reloaded from %s", self.cert or self.ca)
        return True

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
