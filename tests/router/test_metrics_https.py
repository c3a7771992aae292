"""The metrics endpoint over HTTPS: a real exporter on loopback, scraped with urllib the way Prometheus scrapes it
(its CA, its client certificate), refusing what it cannot verify and serving rotated files without a restart."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from tls_certs import Pki, replace

from switchyard.router.metrics import RouterMetrics
from switchyard.tls import ServerTls, TlsError


@pytest.fixture
def files(pki: Pki, tmp_path: Path) -> tuple[Path, Path]:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    replace(cert, pki.server_cert)
    replace(key, pki.server_key)
    return cert, key


@pytest.fixture
def metrics(pki: Pki, files: tuple[Path, Path]) -> Iterator[tuple[RouterMetrics, int]]:
    m = RouterMetrics()
    port = m.serve("127.0.0.1", 0, ServerTls(str(files[0]), str(files[1]), pki.ca))
    try:
        yield m, port
    finally:
        m.close()


def scrape(port: int, ca: str | None, cert: str | None = None, key: str | None = None, scheme: str = "https") -> str:
    ctx = ssl.create_default_context(cafile=ca) if ca else None
    if ctx is not None and cert:
        ctx.load_cert_chain(cert, key)
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=10, context=ctx) as r:
        return r.read().decode()


def refused(port: int, ca: str | None, cert: str | None = None, key: str | None = None, scheme: str = "https") -> bool:
    try:
        scrape(port, ca, cert, key, scheme)
    except (urllib.error.URLError, ssl.SSLError, ConnectionError):
        return True
    return False


def test_metrics_over_mtls(pki: Pki, metrics: tuple[RouterMetrics, int]) -> None:
    m, port = metrics
    m.requests.labels(model="m", worker="w0", status="ok").inc()
    body = scrape(port, pki.ca, pki.client_cert, pki.client_key)
    assert 'switchyard_requests_total{model="m",status="ok",worker="w0"} 1.0' in body
    assert refused(port, None, scheme="http")  # plain HTTP
    assert refused(port, pki.ca)  # no client certificate
    assert refused(port, pki.ca, pki.other_client_cert, pki.other_client_key)  # another CA's client
    assert refused(port, pki.other_ca, pki.client_cert, pki.client_key)  # a server checked against another CA


def test_rotated_metrics_files_serve_the_next_scrape(pki: Pki, files: tuple[Path, Path],
                                                     metrics: tuple[RouterMetrics, int]) -> None:
    cert, key = files
    _, port = metrics
    client = (pki.client_cert, pki.client_key)
    assert scrape(port, pki.ca, *client) and refused(port, pki.other_ca, *client)
    replace(cert, pki.other_server_cert)  # half a rotation: the new certificate beside the old key
    assert scrape(port, pki.ca, *client) and refused(port, pki.other_ca, *client)
    replace(key, pki.other_server_key)
    assert scrape(port, pki.other_ca, *client) and refused(port, pki.ca, *client)  # no restart


def test_a_bad_metrics_file_is_named(pki: Pki) -> None:
    with pytest.raises(TlsError, match="do not load as a pair"):
        RouterMetrics().serve("127.0.0.1", 0, ServerTls(pki.server_cert, pki.client_key))
