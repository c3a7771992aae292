"""Start and stop the real processes a live run needs: simulated workers and the router, on loopback.

Each process prints `READY host:port ...` on stdout once it serves; we wait for that line (never a sleep).
Used by `bench live`, `demo` and the end-to-end tests.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[str]
    address: str = ""  # host:port from the READY line
    extra: dict[str, str] = field(default_factory=dict)  # other key=value pairs on the READY line

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        return stop_process(self.popen, sig, timeout_s)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (from /proc), for CPU-per-request figures."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_process(popen: subprocess.Popen[str], sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
    """Signal, wait up to `timeout_s`, then kill; returns the exit code."""
    if popen.poll() is None:
        popen.send_signal(sig)
        try:
            popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
    return popen.returncode


def start(name: str, args: Sequence[str], timeout_s: float = 60.0, env: dict[str, str] | None = None) -> Proc:
    """Run `python -m switchyard <args>` and wait for its READY line; stderr is inherited (logs)."""
    popen = subprocess.Popen(
        [sys.executable, "-m", "switchyard", *args],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert popen.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(popen.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or popen.poll() is not None:
            popen.kill()
            raise RuntimeError(f"{name} did not become ready (exit code {popen.poll()})")
        if not sel.select(timeout=remaining):
            continue
        line = popen.stdout.readline()
        if line.startswith("READY "):
            parts = line.split()
            extra = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
            sel.close()
            return Proc(name=name, popen=popen, address=parts[1], extra=extra)


@contextlib.contextmanager
def running(procs: list[Proc]) -> Iterator[list[Proc]]:
    """Stop every process on exit, in reverse start order."""
    try:
        yield procs
    finally:
        for p in reversed(procs):
            p.stop()
