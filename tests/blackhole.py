"""A TCP proxy on loopback that can go silent: after `hole()` it reads what either side sends and drops it, and
closes nothing, as a network partition or a host that vanished without a FIN or RST looks to both ends. This is
the one fault here that needs a stand-in: the real one (a firewall rule dropping packets) needs NET_ADMIN, which a
CI container does not have. The bytes are the real ones until then; only the silence is made."""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class BlackholeProxy:
    """Forwards each connection to `target` ("host:port") on its own pair of threads."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
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
            with self._lock:
                self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), name="blackhole-pump", daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self._holed.is_set():
                    dst.sendall(data)
        except OSError:  # either end closed
            pass
        if not self._holed.is_set():  # a real close passes on as a FIN
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)
