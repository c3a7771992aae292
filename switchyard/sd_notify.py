"""systemd's service notifications (sd_notify(3)) without libsystemd, for units of `Type=notify`.

`systemctl start` returns once the daemon serves (READY=1), not when its process exists; a stop shows the drain
(STOPPING=1, STATUS=...); with `WatchdogSec=` the event loop sends WATCHDOG=1 at half the timeout, so a loop that
stops turning (a hang, a stuck callback) gets the unit restarted. Outside systemd ($NOTIFY_SOCKET unset) every
call does nothing. Only the main process notifies: the variables are taken out of the environment when read, so
a child (vLLM's engine core, a worker a launcher started) does not inherit them.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import socket
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)


class ServiceNotifier:
    """The service's side of the protocol: `ready`, `status`, `stopping`, and the watchdog's pings."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = _socket_address(env.pop("NOTIFY_SOCKET", ""))
        usec, pid = env.pop("WATCHDOG_USEC", ""), env.pop("WATCHDOG_PID", "")
        # sd_watchdog_enabled(3): the watchdog is this process's only if WATCHDOG_PID, where set, names it
        on = self.address is not None and usec.isdigit() and int(usec) > 0 and pid in ("", str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 2e6 if on else None
        self._sock: socket.socket | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._failed = False

    def send(self, *fields: str) -> bool:
        """One datagram of `KEY=value` lines; False where there is no socket or it fails (logged once)."""
        if self.address is None:
            return False
        try:
            if self._sock is None:
                # non-blocking: a listener that stops reading costs a lost message, never the event loop
                kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                self._sock = socket.socket(socket.AF_UNIX, kind)
            self._sock.sendto("\n".join(fields).encode(), self.address)
            return True
        except OSError as e:
            if not self._failed:
                log.warning("systemd notification to %r failed: %s", self.address, e)
                self._failed = True
            return False

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, status: str) -> None:
        self.send(f"STATUS={status}")

    def stopping(self, status: str) -> None:
        self.send("STOPPING=1", f"STATUS={status}")

    def start_watchdog(self) -> None:
        """Ping from the running event loop itself every half timeout (a callback, not a thread: a thread would
        keep pinging while the loop hangs). systemd kills a unit whose pings stop with SIGABRT: `faulthandler`
        writes every thread's stack to stderr (the journal) first, so the hang's place is on record."""
        if self.watchdog_interval_s is None or self._timer is not None:
            return
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=True)
        self._ping(asyncio.get_running_loop())

    @contextlib.contextmanager
    def keepalive(self) -> Iterator[None]:
        """Around a blocking call the loop makes on purpose and that bounds itself (vLLM's engine teardown joins
        its processes for up to 5 s, then kills them): a thread pings meanwhile, as the loop cannot. systemd
        enforces the watchdog during a stop too. Anything else that blocks the loop is what the watchdog is for."""
        if self.watchdog_interval_s is None:
            yield
            return
        interval_s = self.watchdog_interval_s
        done = threading.Event()

        def ping() -> None:
            while not done.wait(interval_s):
                self.send("WATCHDOG=1")

        self.send("WATCHDOG=1")
        thread = threading.Thread(target=ping, name="sd-notify-keepalive", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    def _ping(self, loop: asyncio.AbstractEventLoop) -> None:
        self.send("WATCHDOG=1")
        assert self.watchdog_interval_s is not None
        self._timer = loop.call_later(self.watchdog_interval_s, self._ping, loop)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _socket_address(value: str) -> str | bytes | None:
    """$NOTIFY_SOCKET as `sendto` takes it: a path, or `@name` for the abstract namespace (a leading NUL)."""
    if value.startswith("@"):
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    return None  # unset, or a vsock address (`vsock:CID:PORT`), which these daemons are never run under
