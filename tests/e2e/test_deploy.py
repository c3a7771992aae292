"""deploy/ as an operator installs it: systemd accepts the units, the units' own command lines (with
deploy/router.toml) start a router and two simulated workers that serve a request, and promtool accepts the scrape
config. Needs `systemd-analyze` and `promtool` (Debian packages `systemd` and `prometheus`; `make test` installs
them), skipped without, which fails the run under CI=true."""

from __future__ import annotations

import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from switchyard.bench import procs
from switchyard.router.client import RouterClient

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
INSTALL = "/opt/switchyard"  # where the units expect the checkout
CONFIG = "/etc/switchyard/router.toml"
MODEL = "mistral-7b-sim"


def tool(name: str, package: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {package!r}; `make test` installs it)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exec_start(unit: Path, instance: str = "") -> list[str]:
    """The unit's command line as systemd runs it for `instance` (%i), the program part dropped: `switchyard ...`."""
    (line,) = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    argv = shlex.split(line.removeprefix("ExecStart=").replace("%i", instance))
    assert argv[0] in (f"{INSTALL}/.venv/bin/switchyard", f"{INSTALL}/.venv-vllm/bin/switchyard"), argv[0]
    return argv[1:]


def test_the_units_are_the_three_services() -> None:
    assert [u.name for u in UNITS] == ["switchyard-router.service", "switchyard-worker-sim@.service",
                                       "switchyard-worker-vllm@.service"]


def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    analyze = tool("systemd-analyze", "systemd")
    if not (ROOT / ".venv-vllm" / "bin" / "switchyard").exists():
        pytest.skip("the vLLM environment is missing (run `make vllm-env`): the vLLM unit runs from it")
    env_file = tmp_path / "worker-vllm-50063.env"
    env_file.write_text("VLLM_ARGS=--model /models/m --enforce-eager\n")
    installed = []
    for unit in UNITS:  # as installed, with this checkout where the units expect /opt/switchyard
        text = unit.read_text().replace(INSTALL, str(ROOT)).replace("/etc/switchyard/worker-vllm-%i.env",
                                                                     str(tmp_path / "worker-vllm-%i.env"))
        name = unit.name.replace("@.", "@50063.")  # a template is checked as one of its instances
        (tmp_path / name).write_text(text)
        installed.append(str(tmp_path / name))
    r = subprocess.run([analyze, "verify", *installed], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr  # an unknown key is only a warning: none either


def test_the_units_command_lines_serve_a_request() -> None:
    ports = [str(free_port()), str(free_port())]
    sim_unit = DEPLOY / "systemd" / "switchyard-worker-sim@.service"
    workers = [procs.start(f"sim-{p}", exec_start(sim_unit, p)) for p in ports]
    serve = exec_start(DEPLOY / "systemd" / "switchyard-router.service")
    serve[serve.index(CONFIG)] = str(DEPLOY / "router.toml")
    # the shipped config as is, but for its ports (this test's free ones)
    serve += ["--port", "0", "--admin-port", "0", "--metrics-port", "0", *(a for p in ports for a in
                                                                          ("--worker", f"127.0.0.1:{p}"))]
    with procs.running(workers) as started:
        started.append(procs.start("router", serve))
        router = started[-1]
        with RouterClient(router.address, admin_address=router.extra["admin"]) as c:
            assert sorted((s.worker_id, s.healthy) for s in c.list_workers()) == [(f"sim-{p}", True) for p in
                                                                                 sorted(ports)]
            resp = c.complete(MODEL, prompt="from the units", max_tokens=3, ignore_eos=True, timeout=30)
            assert len(resp.token_ids) == 3 and resp.timings.worker_id in {f"sim-{p}" for p in ports}


def notifications(sock: socket.socket, until: str) -> list[str]:
    """Messages on the notify socket (a datagram each, its lines joined by "|") up to the first with `until`;
    the watchdog's pings in between are skipped."""
    seen = []
    while True:
        msg = sock.recv(4096).decode().replace("\n", "|")
        if msg != "WATCHDOG=1":
            seen.append(msg)
        if until in msg.split("|"):
            return seen


def test_the_units_are_type_notify_and_their_commands_notify(tmp_path: Path) -> None:
    """Type=notify: `systemctl start` returns once the daemon serves, a stop shows the drain, and WatchdogSec
    restarts a daemon whose event loop stopped. The units' command lines speak the protocol to a socket where
    systemd's manager would listen (real processes; deploy/check-systemd.sh runs them under systemd itself)."""
    for unit in UNITS:
        text = unit.read_text()
        assert "\nType=notify\n" in text and "\nWatchdogSec=" in text, unit.name
    socks = {}
    for name in ("worker", "router"):
        socks[name] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        socks[name].bind(str(tmp_path / name))
        socks[name].settimeout(30.0)
    env = {name: {"NOTIFY_SOCKET": str(tmp_path / name), "WATCHDOG_USEC": "200000"} for name in socks}
    port = str(free_port())
    worker = procs.start(f"sim-{port}", exec_start(DEPLOY / "systemd" / "switchyard-worker-sim@.service", port),
                         env=env["worker"])
    serve = exec_start(DEPLOY / "systemd" / "switchyard-router.service")
    serve[serve.index(CONFIG)] = str(DEPLOY / "router.toml")
    serve += ["--port", "0", "--admin-port", "0", "--metrics-port", "0", "--worker", f"127.0.0.1:{port}"]
    try:
        with procs.running([worker]) as started:
            assert notifications(socks["worker"], "READY=1") == [f"READY=1|STATUS=worker sim-{port} serving on "
                                                                 f"127.0.0.1:{port}"]
            started.append(procs.start("router", serve, env=env["router"]))
            router = started[-1]
            (ready,) = notifications(socks["router"], "READY=1")
            assert ready.startswith(f"READY=1|STATUS=serving on {router.address} ")
            for name in socks:  # the watchdog: pings every 0.1 s, on and on
                assert [socks[name].recv(4096) for _ in range(3)] == [b"WATCHDOG=1"] * 3
            with RouterClient(router.address) as c:
                stream = c.generate(MODEL, prompt="drained", max_tokens=100, ignore_eos=True, timeout=60)
                first = next(stream)
                router.popen.send_signal(signal.SIGTERM)
                assert notifications(socks["router"], "STOPPING=1") == [
                    "STOPPING=1|STATUS=draining 1 requests (grace 30 s)"]
                tokens = len(first.token_ids) + sum(len(ch.token_ids) for ch in stream)
            assert tokens == 100  # the drain the status announced
            assert router.popen.wait(timeout=60) == 0
            worker.popen.send_signal(signal.SIGTERM)
            assert notifications(socks["worker"], "STOPPING=1") == ["STOPPING=1|STATUS=draining 0 requests"]
            assert worker.popen.wait(timeout=60) == 0
    finally:
        for sock in socks.values():
            sock.close()


def test_promtool_accepts_the_scrape_config() -> None:
    promtool = tool("promtool", "prometheus")
    r = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus.yml")], capture_output=True,
                       text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_shipped_router_config_loads() -> None:
    r = subprocess.run([sys.executable, "-m", "switchyard", "serve", "--config", str(DEPLOY / "router.toml"),
                        "--print-config"], capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "127.0.0.1:50061" in r.stdout and "127.0.0.1:50062" in r.stdout
