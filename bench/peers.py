"""Locate and launch the peer routers (smg, vllm-router) in front of simulated workers' HTTP facades.

Binaries: `$SWITCHYARD_SMG` / `$SWITCHYARD_VLLM_ROUTER`, else `.venv-peers/bin/{smg,vllm-router}` (`make peers-env`
installs PyPI smg==1.13.0 and vllm-router==0.1.17 there), else the same names on $PATH. Flags follow
specs/vllm-and-peer-routers.md section 2: always `--host 127.0.0.1` and a distinct `--prometheus-port` (both
routers default Prometheus to port 29000); vllm-router kv_aware gets one `--kv-event-source` (and replay source)
per worker and `--kv-event-block-size` equal to the workers' block size. Readiness is `GET /health` answering
200, polled with a deadline (never a fixed sleep).

Note: smg sets its process title to `smg::router` and vllm-router to `vllm::router`, so find them by pid, not by
command line.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from switchyard.bench import procs

REPO = Path(__file__).resolve().parent.parent
PEERS_VENV = REPO / ".venv-peers"
ENV_VARS = {"smg": "SWITCHYARD_SMG", "vllm-router": "SWITCHYARD_VLLM_ROUTER"}
POLICIES = {"smg": ("cache_aware", "least_load"), "vllm-router": ("cache_aware", "kv_aware")}


def find_binary(name: str) -> str | None:
    """The peer router's executable: env override, then .venv-peers/bin, then $PATH; None if absent."""
    env = os.environ.get(ENV_VARS[name])
    if env:
        return env if os.access(env, os.X_OK) else None
    local = PEERS_VENV / "bin" / name
    if os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def missing_reason() -> str | None:
    """Why the peers mode cannot run here (None when both binaries are present)."""
    absent = [n for n in ENV_VARS if find_binary(n) is None]
    if not absent:
        return None
    return (f"peer router binaries not found: {', '.join(absent)} (run `make peers-env`, or set "
            f"{' / '.join(ENV_VARS[n] for n in absent)})")  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerEndpoints:
    """What a peer router needs to know about one simulated worker (from its READY line)."""

    http: str  # host:port of the HTTP facade
    zmq: str = ""  # KV event PUB endpoint (bound by the worker)
    zmq_replay: str = ""

    @property
    def url(self) -> str:
        return f"http://{self.http}"


@dataclass
class PeerRouter:
    name: str  # "smg" | "vllm-router"
    policy: str
    popen: subprocess.Popen[bytes]
    port: int
    log_path: Path | None = None
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def cpu_seconds(self) -> float:
        """User + system CPU of the router process (the Rust server runs in the launched process itself)."""
        return procs.cpu_seconds(self.pid)

    def stop(self, timeout_s: float = 15.0) -> int:
        return procs.stop_process(self.popen, timeout_s=timeout_s)


def router_argv(
    name: str,
    policy: str,
    workers: Sequence[WorkerEndpoints],
    port: int,
    prometheus_port: int,
    block_size: int = 16,
    model: str = "",
    log_level: str = "warn",
) -> list[str]:
    binary = find_binary(name)
    if binary is None:
        raise FileNotFoundError(missing_reason())
    urls = [w.url for w in workers]
    common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls, "--policy", policy,
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port)]  # fmt: skip
    if name == "smg":
        # smg's log levels: debug|info|warn|error. A short shutdown grace keeps teardown quick.
        return [binary, "launch", *common, "--log-level", log_level, "--shutdown-grace-period-secs", "1"]
    argv = [binary, *common, "--log-level", {"warn": "warning"}.get(log_level, log_level)]
    if policy == "kv_aware":
        for w in workers:
            if not w.zmq:
                raise ValueError(f"kv_aware needs every worker's ZMQ KV event endpoint ({w.url} has none)")
            argv += ["--kv-event-source", f"{w.url}={w.zmq}"]
            if w.zmq_replay:
                argv += ["--kv-event-replay-source", f"{w.url}={w.zmq_replay}"]
        argv += ["--kv-event-block-size", str(block_size)]
        if model:
            argv += ["--kv-event-model", model]
    return argv


def wait_healthy(url: str, popen: subprocess.Popen[bytes] | None = None, timeout_s: float = 30.0) -> None:
    """Poll GET {url}/health until 200 (bounded; raises if the process exits or the deadline passes)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise RuntimeError(f"{url}: the router exited with code {popen.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(delay)  # a poll interval, bounded by the deadline
        delay = min(0.2, delay * 2)
    raise RuntimeError(f"{url} did not answer /health within {timeout_s:g} s")


def wait_smg_workers(
    url: str, n: int, popen: subprocess.Popen[bytes] | None = None, timeout_s: float = 30.0
) -> None:
    """Poll smg's GET /workers until n workers are registered and healthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen is not None and popen.poll() is not None:
            raise RuntimeError(f"{url}: the router exited with code {popen.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/workers", timeout=1.0) as resp:
                ws = json.loads(resp.read()).get("workers", [])
            if sum(bool(w.get("is_healthy")) for w in ws) >= n:
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
            pass
        time.sleep(0.05)  # a poll interval, bounded by the deadline
    raise RuntimeError(f"{url}: {n} workers did not register within {timeout_s:g} s")


def start_router(
    name: str,
    policy: str,
    workers: Sequence[WorkerEndpoints],
    block_size: int = 16,
    model: str = "",
    log_path: Path | None = None,
    log_level: str = "warn",
    timeout_s: float = 30.0,
) -> PeerRouter:
    """Launch a peer router on free loopback ports and wait until it answers /health."""
    port, prom = free_port(), free_port()
    argv = router_argv(name, policy, workers, port, prom, block_size, model, log_level)
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed with the process
    try:
        popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]
    router = PeerRouter(name, policy, popen, port, log_path, argv)
    try:
        wait_healthy(router.url, popen, timeout_s)
        if name == "smg":  # smg answers /health before its registration workflow has added the workers
            wait_smg_workers(router.url, len(workers), popen, timeout_s)
    except Exception:
        router.stop()
        raise
    return router
