"""A real Prometheus server scrapes the router's metrics port, over plain HTTP and over mTLS, and its query API
returns what the router did.

Needs the `prometheus` binary (Debian package `prometheus`; `make test` installs it). Skipped without it,
which fails the run under CI=true.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from polling import until
from tls_certs import Pki

from switchyard.bench import procs
from switchyard.router.client import RouterClient, make_request
from switchyard.tls import ClientTls

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _query(port: int, expr: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.fixture
def worker() -> Iterator[procs.Proc]:
    w = procs.start("w0", ["worker", "sim", "--port", "0", "--worker-id", "w0", "--time-scale", "0.01"])
    with procs.running([w]):
        yield w


@pytest.mark.parametrize("tls", [False, True], ids=["http", "mtls"])
def test_prometheus_scrapes_router_metrics(tls: bool, worker: procs.Proc, pki: Pki, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian package 'prometheus'; `make test` installs it)")
    sets = {"server.metrics_tls": "true", "server.tls_cert": pki.server_cert, "server.tls_key": pki.server_key,
            "server.tls_client_ca": pki.ca} if tls else {}
    router = procs.start("router", ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0",
                                    "--worker", worker.address,
                                    *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))])
    client_tls = ClientTls(pki.ca, pki.client_cert, pki.client_key) if tls else None
    with procs.running([router]), RouterClient(router.address, admin_address=router.extra["admin"],
                                               tls=client_tls) as client:
        for i in range(3):
            resp = client.complete(request=make_request(MODEL, prompt=f"hello {i}", max_tokens=4, ignore_eos=True))
            assert resp.usage.completion_tokens == 4
        scrape_with_prometheus(binary, router, pki if tls else None, tmp_path)


def scrape_with_prometheus(binary: str, router: procs.Proc, pki: Pki | None, tmp_path: Path) -> None:
    scheme = ""
    if pki is not None:  # as an operator configures it: HTTPS, the router's CA, Prometheus's client certificate
        scheme = ("    scheme: https\n    tls_config:\n"
                  f"      ca_file: {pki.ca}\n      cert_file: {pki.client_cert}\n      key_file: {pki.client_key}\n")
    port = _free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n"
        "scrape_configs:\n  - job_name: switchyard\n" + scheme +
        f"    static_configs:\n      - targets: ['{router.extra['metrics']}']\n"
    )
    prom = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # The target is up once Prometheus has scraped it successfully.
        until(lambda: any(r["value"][1] == "1" for r in _query(port, 'up{job="switchyard"}')), 60, "a scrape",
              ignore=(OSError,))
        ok = until(lambda: _query(port, 'switchyard_requests_total{status="ok"}'), 30, "request counter",
                   ignore=(OSError,))
        assert sum(float(r["value"][1]) for r in ok) == 3
        assert ok[0]["metric"]["model"] == MODEL
        ttft = _query(port, "switchyard_ttft_seconds_count")
        assert sum(float(r["value"][1]) for r in ttft) == 3
        route = _query(port, "switchyard_routing_decision_seconds_count")
        assert sum(float(r["value"][1]) for r in route) >= 3
    finally:
        prom.terminate()
        prom.wait(timeout=30)
