"""systemd's notification protocol as `ServiceNotifier` speaks it, read from a real AF_UNIX datagram socket (what
systemd's manager listens on), by path and in the abstract namespace."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from switchyard.sd_notify import ServiceNotifier


@pytest.fixture
def listener(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(5.0)
    yield sock, path
    sock.close()


def fields(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_ready_status_and_stopping_reach_the_socket(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    n = ServiceNotifier({"NOTIFY_SOCKET": path})
    assert n.address == path
    n.ready("serving on 127.0.0.1:50051")
    assert fields(sock) == ["READY=1", "STATUS=serving on 127.0.0.1:50051"]
    n.status("busy")
    assert fields(sock) == ["STATUS=busy"]
    n.stopping("draining 3 requests")
    assert fields(sock) == ["STOPPING=1", "STATUS=draining 3 requests"]
    n.close()


def test_an_abstract_socket_name_is_reached_too() -> None:
    name = f"switchyard-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(5.0)
        n = ServiceNotifier({"NOTIFY_SOCKET": "@" + name})
        n.ready("up")
        assert fields(sock) == ["READY=1", "STATUS=up"]
        n.close()


def test_outside_systemd_nothing_is_sent_and_nothing_fails() -> None:
    n = ServiceNotifier({})
    assert n.address is None and n.watchdog_interval_s is None
    assert not n.send("READY=1")
    n.ready("up")
    n.stopping("down")
    n.close()


def test_a_vanished_socket_is_logged_not_raised(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    n = ServiceNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert not n.send("READY=1")
    assert not n.send("STATUS=again")
    assert sum("systemd notification" in r.message for r in caplog.records) == 1  # once, not per message
    n.close()


def test_the_variables_leave_the_environment_so_children_cannot_notify(listener: tuple[socket.socket, str]) -> None:
    _, path = listener
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid()), "PATH": "/bin"}
    n = ServiceNotifier(env)
    assert env == {"PATH": "/bin"}
    assert n.address == path and n.watchdog_interval_s == 15.0  # half the timeout, as sd_watchdog_enabled(3) advises
    n.close()


@pytest.mark.parametrize(("usec", "pid", "on"), [("30000000", "", True), ("30000000", "1", False), ("0", "", False),
                                                  ("", "", False), ("soon", "", False)])
def test_the_watchdog_is_this_process_only_where_systemd_says_so(usec: str, pid: str, on: bool) -> None:
    n = ServiceNotifier({"NOTIFY_SOCKET": "/run/x", "WATCHDOG_USEC": usec, "WATCHDOG_PID": pid})
    assert (n.watchdog_interval_s is not None) is on  # pid 1 is never this test process


async def test_the_watchdog_pings_from_the_event_loop(listener: tuple[socket.socket, str]) -> None:
    sock, path = listener
    sock.setblocking(False)
    n = ServiceNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})  # a ping every 10 ms
    loop = asyncio.get_running_loop()
    n.start_watchdog()
    for _ in range(3):
        assert (await asyncio.wait_for(loop.sock_recv(sock, 4096), 5.0)) == b"WATCHDOG=1"
    # a loop that does not turn does not ping (a thread would go on): block it for ten intervals
    while True:  # what was sent before the block
        try:
            sock.recv(4096)
        except BlockingIOError:
            break
    time.sleep(0.1)  # the hang under test, not a wait for something
    queued = 0
    while True:
        try:
            sock.recv(4096)
            queued += 1
        except BlockingIOError:
            break
    assert queued == 0  # the loop has not turned since the drain: nothing can have pinged
    assert (await asyncio.wait_for(loop.sock_recv(sock, 4096), 5.0)) == b"WATCHDOG=1"  # and it goes on once it does
    n.close()


def test_a_listener_that_stops_reading_costs_messages_not_a_blocked_loop(
    listener: tuple[socket.socket, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, path = listener  # bound, never read: its queue fills
    n = ServiceNotifier({"NOTIFY_SOCKET": path})
    sent = [n.send("WATCHDOG=1") for _ in range(5000)]  # a blocking socket would hang on the first full queue
    assert sent[0] and not sent[-1]
    assert sum("systemd notification" in r.message for r in caplog.records) == 1
    n.close()


def test_keepalive_pings_while_the_loop_is_blocked_on_purpose_and_stops_after(
    listener: tuple[socket.socket, str],
) -> None:
    """vLLM's engine teardown blocks the worker's loop for up to 5 s, and systemd watches a stopping unit too: a
    thread pings meanwhile, and no longer once the call is over."""
    sock, path = listener
    n = ServiceNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "20000"})  # a ping every 10 ms
    with n.keepalive():  # this block is the blocked loop: nothing else here can ping
        assert [fields(sock) for _ in range(4)] == [["WATCHDOG=1"]] * 4
    assert not any(t.name == "sd-notify-keepalive" for t in threading.enumerate())  # joined: nothing more comes
    n.close()


def test_keepalive_outside_systemd_starts_no_thread() -> None:
    before = threading.active_count()
    with ServiceNotifier({}).keepalive():
        assert threading.active_count() == before


HUNG_DAEMON = """
import asyncio, sys, time
from switchyard.sd_notify import ServiceNotifier

def stuck_callback():
    print("hung", flush=True)
    time.sleep(60)  # the hang systemd's watchdog ends with SIGABRT

async def main():
    ServiceNotifier().start_watchdog()
    asyncio.get_running_loop().call_soon(stuck_callback)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def test_a_watchdog_kill_leaves_the_hung_stack_in_the_log(listener: tuple[socket.socket, str]) -> None:
    """systemd ends a unit whose pings stopped with SIGABRT: the daemon's stderr (the journal) then shows where its
    loop hung, not only that it was killed."""
    _, path = listener
    env = {**os.environ, "NOTIFY_SOCKET": path, "WATCHDOG_USEC": "60000000"}
    proc = subprocess.Popen([sys.executable, "-c", HUNG_DAEMON], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "hung\n"
    proc.send_signal(signal.SIGABRT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in err and "in stuck_callback" in err
