"""TLS end to end: a client, a router and a simulated worker process, each hop over TLS with client certificates
(mTLS) on loopback; the router and the worker refuse what they cannot verify, and a bad file stops startup."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from polling import until
from tls_certs import Pki, replace

from switchyard.bench import procs
from switchyard.router.client import RouterClient
from switchyard.tls import ClientTls, channel
from switchyard.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"


def worker_tls_args(pki: Pki) -> list[str]:
    return ["--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", pki.ca]


def router_args(*extra: str) -> list[str]:
    return ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0", "--grace-s", "5", *extra]


def router_tls_sets(pki: Pki) -> list[str]:
    sets = {
        "server.tls_cert": pki.server_cert, "server.tls_key": pki.server_key, "server.tls_client_ca": pki.ca,
        "workers.tls": "true", "workers.tls_ca": pki.ca,
        "workers.tls_cert": pki.client_cert, "workers.tls_key": pki.client_key,
    }
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


@pytest.fixture(scope="module")
def tls_worker(pki: Pki) -> Iterator[procs.Proc]:
    worker = procs.start("tw0", ["worker", "sim", "--port", "0", "--worker-id", "tw0", "--time-scale", "0.01",
                                 *worker_tls_args(pki)])
    with procs.running([worker]):
        yield worker


@pytest.fixture(scope="module")
def tls_router(pki: Pki, tls_worker: procs.Proc) -> Iterator[procs.Proc]:
    router = procs.start("router", router_args("--worker", tls_worker.address, *router_tls_sets(pki)))
    with procs.running([router]):
        yield router


def client(router: procs.Proc, tls: ClientTls | None) -> RouterClient:
    return RouterClient(router.address, admin_address=router.extra["admin"], tls=tls)


def worker_info(worker: procs.Proc, tls: ClientTls | None) -> worker_pb2.WorkerInfo:
    with channel(worker.address, tls) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10)


def test_a_request_crosses_both_tls_hops(pki: Pki, tls_worker: procs.Proc, tls_router: procs.Proc) -> None:
    tls = ClientTls(pki.ca, pki.client_cert, pki.client_key)
    with client(tls_router, tls) as c:
        (status,) = c.list_workers()  # the admin service, over TLS too
        assert status.worker_id == "tw0" and status.healthy
        resp = c.complete(MODEL, prompt="over TLS", max_tokens=4, ignore_eos=True, timeout=30)
        assert len(resp.token_ids) == 4 and resp.timings.worker_id == "tw0"
    # the name the certificate carries may differ from the address dialled
    with client(tls_router, ClientTls(pki.ca, pki.client_cert, pki.client_key, server_name="localhost")) as c:
        assert c.complete(MODEL, prompt="by name", max_tokens=1, timeout=30).timings.worker_id == "tw0"
    # the worker served the router over TLS with a client certificate, as it serves this one
    assert worker_info(tls_worker, tls).worker_id == "tw0"


REFUSED = {
    "plaintext": lambda p: None,
    "no client certificate": lambda p: ClientTls(p.ca),
    "a client certificate from another CA": lambda p: ClientTls(p.ca, p.other_client_cert, p.other_client_key),
    "a server checked against another CA": lambda p: ClientTls(p.other_ca, p.client_cert, p.client_key),
    "a server expected under another name": lambda p: ClientTls(p.ca, p.client_cert, p.client_key,
                                                                server_name="elsewhere.example"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_verified_is_refused(case: str, pki: Pki, tls_worker: procs.Proc,
                                            tls_router: procs.Proc) -> None:
    tls = REFUSED[case](pki)
    with client(tls_router, tls) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.complete(MODEL, prompt="let me in", max_tokens=1, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:
            c.list_workers()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as e:
        worker_info(tls_worker, tls)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_plaintext_router_gets_an_explicit_error_from_a_tls_worker(tls_worker: procs.Proc) -> None:
    router = procs.start("router", router_args("--set", "workers.connect_timeout_s=2"))
    with procs.running([router]), client(router, None) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.register_worker(tls_worker.address, timeout=30)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "could not be registered" in (e.value.details() or "")
        assert "its TLS setting differs from this router's workers.tls = false" in (e.value.details() or "")
        assert c.list_workers() == []  # nothing left half-registered


def test_a_rotated_certificate_serves_the_next_connection(pki: Pki, tmp_path: Path) -> None:
    cert, key = tmp_path / "server.pem", tmp_path / "server.key"
    replace(cert, pki.server_cert)
    replace(key, pki.server_key)
    router = procs.start("router", router_args("--set", f"server.tls_cert={cert}", "--set", f"server.tls_key={key}"))

    def serves(ca: str) -> bool:
        """A new connection (new credentials: a new handshake) trusting `ca` gets an answer."""
        try:
            with client(router, ClientTls(ca)) as c:
                c.list_workers()
            return True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE
            return False

    with procs.running([router]):
        assert serves(pki.ca) and not serves(pki.other_ca)
        replace(cert, pki.other_server_cert)  # half a rotation: the new certificate with the old key
        assert serves(pki.ca) and not serves(pki.other_ca)  # does not load: the old pair keeps serving
        replace(key, pki.other_server_key)
        assert serves(pki.other_ca) and not serves(pki.ca)  # no restart


def test_a_rotated_router_client_certificate_serves_its_next_join(pki: Pki, tmp_path: Path) -> None:
    cert, key = tmp_path / "client.pem", tmp_path / "client.key"
    replace(cert, pki.client_cert)
    replace(key, pki.client_key)

    def worker(client_ca: str, port: str = "0") -> procs.Proc:
        return procs.start("rw0", ["worker", "sim", "--port", port, "--worker-id", "rw0", "--time-scale", "0.01",
                                   "--tls-cert", pki.server_cert, "--tls-key", pki.server_key,
                                   "--tls-client-ca", client_ca])

    first = worker(pki.ca)
    sets = {"workers.tls": "true", "workers.tls_ca": pki.ca, "workers.tls_cert": str(cert),
            "workers.tls_key": str(key), "workers.health_interval_s": "0.2"}
    router = procs.start("router", router_args("--worker", first.address,
                                               *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))))
    with procs.running([first, router]) as started, client(router, None) as c:
        assert c.complete(MODEL, prompt="before", max_tokens=1, timeout=30).timings.worker_id == "rw0"
        replace(cert, pki.other_client_cert)
        replace(key, pki.other_client_key)
        # the live connection keeps the certificate it was made with
        assert c.complete(MODEL, prompt="during", max_tokens=1, timeout=30).timings.worker_id == "rw0"
        # the worker comes back trusting only the new CA: the router's rejoin needs the rotated files
        first.stop()
        until(lambda: not c.list_workers()[0].healthy, what="the router sees the worker gone")
        started.append(worker(pki.other_ca, port=first.address.rsplit(":", 1)[1]))
        until(lambda: [(s.worker_id, s.healthy) for s in c.list_workers()] == [("rw0", True)], timeout_s=30,
              what="the router rejoins the restarted worker with its rotated client certificate")
        assert c.complete(MODEL, prompt="after", max_tokens=1, timeout=30).timings.worker_id == "rw0"


def serve_fails(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "switchyard", *args], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=120)


def test_a_bad_tls_file_stops_startup_with_its_name(pki: Pki) -> None:
    mismatched = ["--set", f"server.tls_cert={pki.server_cert}", "--set", f"server.tls_key={pki.client_key}"]
    r = serve_fails(*router_args(*mismatched))
    assert r.returncode == 2  # EXIT_CONFIG
    assert "do not load as a pair" in r.stderr and pki.client_key in r.stderr
    r = serve_fails(*router_args("--set", "workers.tls=true", "--set", "workers.tls_ca=/nonexistent/ca.pem"))
    assert r.returncode == 2 and "cannot read the CA file '/nonexistent/ca.pem'" in r.stderr
    r = serve_fails("worker", "sim", "--port", "0", "--tls-cert", pki.server_cert, "--tls-key", pki.client_key)
    assert r.returncode != 0 and "bad TLS configuration" in r.stderr and "do not load as a pair" in r.stderr
    r = serve_fails("worker", "sim", "--port", "0", "--tls-client-ca", pki.ca)
    assert r.returncode != 0 and "--tls-cert and --tls-key go together" in r.stderr
