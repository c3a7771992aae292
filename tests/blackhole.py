"""A TCP proxy on loopback that can go silent: after `hole()` it reads what either side sends and drops it, and
closes nothing, as a network partition or a host that vanished without a FIN or RST looks to both ends. This is
the one fault here that needs a stand-in: the real one (a firewall rule dropping packets) needs NET_ADMIN, which a
CI container does not have. The bytes are the real ones until then; only the silence is made.

With `h2c=True` (plaintext gRPC) it also reads the HTTP/2 PING frames going through, so a test can time a peer's
keepalive from the ping it sent to the close it made, whatever the ping's phase against the silence."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"  # a client's first bytes on an HTTP/2 connection
PING, ACK = 0x6, 0x1  # frame type, flag


class _Frames:
    """HTTP/2 frames (type, flags, payload) out of one direction's bytes, as they arrive in pieces."""

    def __init__(self, skip: int) -> None:
        self._buf = bytearray()
        self._skip = skip  # the client's preface, not a frame

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buf += data
        if self._skip:
            n = min(self._skip, len(self._buf))
            del self._buf[:n]
            self._skip -= n
        frames = []
        while len(self._buf) >= 9:
            end = 9 + int.from_bytes(self._buf[:3], "big")
            if len(self._buf) < end:
                break
            frames.append((self._buf[3], self._buf[4], bytes(self._buf[9:end])))
            del self._buf[:end]
        return frames


@dataclass
class Connection:
    """One client connection's pings, by the proxy's `time.monotonic()`."""

    pings: dict[bytes, float] = field(default_factory=dict)  # the client's pings: payload -> when it came
    answered: set[bytes] = field(default_factory=set)  # those whose ack got back to the client
    closed_at: float | None = None  # when the client closed it (FIN or RST)

    def first_unanswered_ping(self) -> float | None:
        return min((t for p, t in list(self.pings.items()) if p not in self.answered), default=None)


class BlackholeProxy:
    """Forwards each connection to `target` ("host:port") on its own pair of threads."""

    def __init__(self, target: str, *, h2c: bool = False) -> None:
        host, port = target.rsplit(":", 1)
        self._h2c = h2c
        self.connections: list[Connection] = []  # with `h2c`, in the order they came
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._holed = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="blackhole-accept", daemon=True).start()

    def hole(self) -> None:
        """From now on nothing gets through, either way, on any connection, and nobody is told."""
        self._holed.set()

    def close(self) -> None:
        with self._lock:
            for s in self._sockets:
                s.close()
            self._sockets.clear()

    def __enter__(self) -> BlackholeProxy:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                client.close()
                continue
            conn = Connection() if self._h2c else None
            with self._lock:
                self._sockets += [client, upstream]
                if conn is not None:
                    self.connections.append(conn)
            for src, dst, from_client in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(src, dst, conn, from_client), name="blackhole-pump",
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, conn: Connection | None, from_client: bool) -> None:
        frames = _Frames(skip=len(PREFACE) if from_client else 0)
        try:
            while data := src.recv(65536):
                now, passed = time.monotonic(), not self._holed.is_set()
                if passed:
                    dst.sendall(data)
                for kind, flags, payload in frames.feed(data) if conn is not None else ():
                    if kind == PING and from_client and not flags & ACK:
                        conn.pings.setdefault(payload, now)
                    elif kind == PING and not from_client and flags & ACK and passed:
                        conn.answered.add(payload)
        except OSError:  # either end closed
            pass
        if conn is not None and from_client:
            conn.closed_at = time.monotonic()
        if not self._holed.is_set():  # a real close passes on as a FIN
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
