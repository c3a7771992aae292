"""API keys end to end: a router process whose Router and Admin services each take their own keys file, a simulated
worker behind it, and clients with and without keys; revoking a key takes effect without a restart."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_router_e2e import metric

from switchyard.bench import procs
from switchyard.router.client import AsyncRouterClient, RouterClient

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"
USER_KEY, OTHER_KEY, ADMIN_KEY = "u" * 32, "o" * 32, "adm-" + "x" * 28


def write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve_args(keys: Path, admin_keys: Path, *extra: str) -> list[str]:
    return ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0",
            "--set", f"server.api_keys_file={keys}", "--set", f"server.admin_api_keys_file={admin_keys}", *extra]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[procs.Proc, Path]]:
    d = tmp_path_factory.mktemp("keys")
    keys, admin_keys = d / "router.keys", d / "admin.keys"
    write(keys, f"# team a\n{USER_KEY}\n")
    write(admin_keys, f"{ADMIN_KEY}\n")
    worker = procs.start("kw0", ["worker", "sim", "--port", "0", "--worker-id", "kw0", "--time-scale", "0.01"])
    with procs.running([worker]) as started:
        started.append(procs.start("router", serve_args(keys, admin_keys, "--worker", worker.address)))
        yield started[-1], keys


def client(router: procs.Proc, key: str | None, admin_key: str | None = None) -> RouterClient:
    return RouterClient(router.address, admin_address=router.extra["admin"], api_key=key, admin_api_key=admin_key)


def refused(call) -> bool:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED, e
        assert "API key" in (e.details() or "")
        return True
    return False


def test_calls_need_a_key_of_their_service(keyed: tuple[procs.Proc, Path]) -> None:
    router, _ = keyed
    before = metric(router, "switchyard_unauthenticated_total", service="switchyard.v1.Router")
    for key in (None, OTHER_KEY, ADMIN_KEY):  # none, unknown, the Admin service's
        with client(router, key) as c:
            assert refused(lambda c=c: c.complete(MODEL, prompt="hi", max_tokens=1, timeout=30))
            assert refused(lambda c=c: list(c.generate(MODEL, prompt="hi", max_tokens=2, timeout=30)))
    assert metric(router, "switchyard_unauthenticated_total", service="switchyard.v1.Router") == before + 6
    with client(router, USER_KEY) as c:
        assert c.complete(MODEL, prompt="hi", max_tokens=2, ignore_eos=True, timeout=30).usage.completion_tokens == 2
        assert len([ch for ch in c.generate(MODEL, prompt="hi", max_tokens=2, ignore_eos=True, timeout=30)]) >= 1
        assert refused(c.list_workers)  # the user's key is not an admin key
    with client(router, USER_KEY, ADMIN_KEY) as c:
        assert [s.worker_id for s in c.list_workers()] == ["kw0"]
    with grpc.insecure_channel(router.address) as ch:  # probes carry no key
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_async_client_sends_its_key(keyed: tuple[procs.Proc, Path]) -> None:
    router, _ = keyed

    async def go(key: str) -> int:
        async with AsyncRouterClient(router.address, api_key=key) as c:
            return len([ch async for ch in c.generate(MODEL, prompt="async", max_tokens=3, ignore_eos=True,
                                                      timeout=30)])

    assert asyncio.run(go(USER_KEY)) >= 1
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(go(OTHER_KEY))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_revoked_key_is_refused_without_a_restart(keyed: tuple[procs.Proc, Path]) -> None:
    router, keys = keyed
    try:
        write(keys, f"{OTHER_KEY}\n")  # USER_KEY revoked, OTHER_KEY issued
        with client(router, OTHER_KEY) as c:
            assert c.complete(MODEL, prompt="new key", max_tokens=1, timeout=30).usage.completion_tokens == 1
        with client(router, USER_KEY) as c:
            assert refused(lambda: c.complete(MODEL, prompt="old key", max_tokens=1, timeout=30))
    finally:
        write(keys, f"{USER_KEY}\n")


def test_a_bad_keys_file_stops_startup_with_its_name(tmp_path: Path) -> None:
    weak = tmp_path / "weak.keys"
    weak.write_text("secret\n")
    r = subprocess.run([sys.executable, "-m", "switchyard", *serve_args(weak, tmp_path / "missing.keys")],
                       capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert r.returncode == 2 and str(weak) in r.stderr and "16+ printable ASCII" in r.stderr
