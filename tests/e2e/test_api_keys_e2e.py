"""API keys end to end: a router process whose Router and Admin services each take their own keys file, a simulated
worker behind it, and clients with and without keys; revoking a key takes effect without a restart; a key's limits
(calls in flight, calls per second, model tokens per minute) end its excess calls RESOURCE_EXHAUSTED, and an
isolated key shares no prefix cache with other callers."""

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
from polling import until
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


def keyed_router(d: Path, keys_text: str, *worker_args: str) -> Iterator[tuple[procs.Proc, Path]]:
    """A router whose services take the keys in `keys_text` and ADMIN_KEY, in front of one sim worker."""
    keys, admin_keys = d / "router.keys", d / "admin.keys"
    write(keys, keys_text)
    write(admin_keys, f"{ADMIN_KEY}\n")
    worker = procs.start(d.name, ["worker", "sim", "--port", "0", "--worker-id", d.name, *worker_args])
    with procs.running([worker]) as started:
        started.append(procs.start("router", serve_args(keys, admin_keys, "--worker", worker.address)))
        yield started[-1], keys


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[procs.Proc, Path]]:
    yield from keyed_router(tmp_path_factory.mktemp("kw", numbered=False), f"# team a\n{USER_KEY}\n",
                            "--time-scale", "0.01")


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
        assert [s.worker_id for s in c.list_workers()] == ["kw"]
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


def exhausted(call, limit: str) -> bool:  # type: ignore[no-untyped-def]
    try:
        call()
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
        assert (e.details() or "").startswith(f"{limit}: API key"), e.details()
        return True
    return False


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[procs.Proc, Path]]:
    """A router in front of a worker in real time (time scale 1), so a long generation stays in flight."""
    yield from keyed_router(tmp_path_factory.mktemp("lw", numbered=False),
                            f"{USER_KEY} name=team-a max_in_flight=1\n{OTHER_KEY} name=team-b rate=0.001 burst=2\n")


def test_a_key_at_max_in_flight_is_refused_until_a_call_ends(limited: tuple[procs.Proc, Path]) -> None:
    router, _ = limited
    gauge = {"service": "switchyard.v1.Router", "key": "team-a"}
    with client(router, USER_KEY) as c, client(router, OTHER_KEY) as other:
        long = c.generate(MODEL, prompt="a long answer", max_tokens=4000, ignore_eos=True, timeout=120)
        next(long)  # the first chunk: the call holds the key's one slot
        assert metric(router, "switchyard_api_key_in_flight", **gauge) == 1
        assert exhausted(lambda: c.complete(MODEL, prompt="second", max_tokens=1, timeout=30), "max_in_flight")
        assert exhausted(lambda: list(c.generate(MODEL, prompt="third", max_tokens=1, timeout=30)), "max_in_flight")
        assert other.complete(MODEL, prompt="another team", max_tokens=1, timeout=30).usage.completion_tokens == 1
        assert metric(router, "switchyard_api_key_limited_total", limit="max_in_flight", **gauge) == 2
        long.cancel()  # type: ignore[attr-defined]
        until(lambda: metric(router, "switchyard_api_key_in_flight", **gauge) == 0, what="the slot given back")
        assert c.complete(MODEL, prompt="after", max_tokens=1, timeout=30).usage.completion_tokens == 1
        assert metric(router, "switchyard_api_key_calls_total", **gauge) == 2  # the long call and this one
    assert metric(router, "switchyard_requests_total", status="resource_exhausted") == 0  # refused before the router


def test_a_key_over_its_rate_is_refused_with_a_retry_time(limited: tuple[procs.Proc, Path]) -> None:
    router, keys = limited
    try:
        write(keys, f"{USER_KEY} name=team-a max_in_flight=1\n{OTHER_KEY} name=team-c rate=0.001 burst=2\n")
        with client(router, OTHER_KEY) as c:  # a fresh bucket (a new name): its burst of 2, then nothing for ~1000 s
            for _ in range(2):
                assert c.complete(MODEL, prompt="x", max_tokens=1, timeout=30).usage.completion_tokens == 1
            with pytest.raises(grpc.RpcError) as e:
                c.complete(MODEL, prompt="x", max_tokens=1, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in" in (e.value.details() or "")
            retry_ms = int(dict(e.value.trailing_metadata())["retry-after-ms"])  # type: ignore[attr-defined]
            assert 900_000 < retry_ms <= 1_000_000  # a token every 1,000 s
        assert metric(router, "switchyard_api_key_limited_total", key="team-c", limit="rate") == 1
    finally:
        write(keys, f"{USER_KEY} name=team-a max_in_flight=1\n{OTHER_KEY} name=team-b rate=0.001 burst=2\n")


def test_a_key_over_its_tokens_per_min_is_refused_until_its_unused_output_returns(
    limited: tuple[procs.Proc, Path],
) -> None:
    router, keys = limited
    team = {"service": "switchyard.v1.Router", "key": "team-d"}
    try:  # a fresh bucket (a new name) of 1,000 tokens a minute: ~17 a second come back
        write(keys, f"{USER_KEY} name=team-a max_in_flight=1\n{OTHER_KEY} name=team-d tokens_per_min=1000\n")
        with client(router, OTHER_KEY) as c:
            with pytest.raises(grpc.RpcError) as e:  # more than a minute's worth never fits: no retry time
                c.complete(MODEL, prompt="x", max_tokens=1000, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "lower max_tokens" in (e.value.details() or "")
            assert "retry-after-ms" not in dict(e.value.trailing_metadata())  # type: ignore[attr-defined]
            long = c.generate(MODEL, prompt="x", max_tokens=900, ignore_eos=True, timeout=120)
            next(long)  # admitted: its prompt + 900 reserved, ~100 left
            with pytest.raises(grpc.RpcError) as e:
                c.complete(MODEL, prompt="x", max_tokens=600, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
            assert (e.value.details() or "").startswith("tokens_per_min: API key 'team-d' is over 1000 tokens/min")
            retry_ms = int(dict(e.value.trailing_metadata())["retry-after-ms"])  # type: ignore[attr-defined]
            assert 0 < retry_ms <= 610 * 60  # the missing tokens at 1,000 a minute
            long.cancel()  # type: ignore[attr-defined]
            until(lambda: metric(router, "switchyard_api_key_tokens_total", **team) > 0, what="the cancelled call settled")
            used = metric(router, "switchyard_api_key_tokens_total", **team)
            assert used < 900  # charged its prompt and the tokens it streamed, not its reservation
            # the unused output came back: the same request now fits, long before the refill alone would allow it
            again = c.generate(MODEL, prompt="x", max_tokens=600, timeout=120)
            assert len(next(again).token_ids) > 0
            again.cancel()  # type: ignore[attr-defined]
        assert metric(router, "switchyard_api_key_limited_total", limit="tokens_per_min", **team) == 2
    finally:
        write(keys, f"{USER_KEY} name=team-a max_in_flight=1\n{OTHER_KEY} name=team-b rate=0.001 burst=2\n")


def test_an_isolated_key_shares_no_prefix_cache(keyed: tuple[procs.Proc, Path]) -> None:
    router, keys = keyed
    prompt = "A long shared system prompt that fills several KV blocks of sixteen tokens each. " * 8
    try:
        write(keys, f"{USER_KEY} name=team-a isolate=true\n{OTHER_KEY} name=team-b\n")

        def cached(key: str, salt: str = "") -> int:
            with client(router, key) as c:
                r = c.complete(MODEL, prompt=prompt, max_tokens=1, cache_salt=salt, timeout=30)
                return r.usage.cached_prompt_tokens

        cached(OTHER_KEY)
        assert cached(OTHER_KEY) > 0  # team-b's second call hits its first's blocks
        assert cached(USER_KEY) == 0  # team-a's first does not
        assert cached(USER_KEY) > 0  # its second hits its own
        with client(router, OTHER_KEY) as c, pytest.raises(grpc.RpcError) as e:  # nobody else names team-a's salt
            c.complete(MODEL, prompt=prompt, max_tokens=1, cache_salt="tenant:team-a:", timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tenant:" in (e.value.details() or "")
    finally:
        write(keys, f"{USER_KEY}\n")


def test_a_keys_limits_hold_across_router_replicas(tmp_path: Path) -> None:
    """Two router replicas with one keys file in front of one worker: a key's call in flight through replica A
    takes its one slot at replica B too, and its reserved tokens leave B's bucket, from the worker's request
    events (no channel between the replicas); when it ends, B gets the slot and the unused tokens back."""
    keys, admin_keys = tmp_path / "router.keys", tmp_path / "admin.keys"
    write(keys, f"{USER_KEY} name=team-a max_in_flight=1\n{OTHER_KEY} name=team-t tokens_per_min=1000\n")
    write(admin_keys, f"{ADMIN_KEY}\n")
    worker = procs.start("rw", ["worker", "sim", "--port", "0", "--worker-id", "rw"])  # real time: calls stay open

    def peer_in_flight(c: RouterClient) -> int:
        return sum(w.peer_in_flight for w in c.list_workers())

    with procs.running([worker]) as started:
        a, b = (procs.start(n, serve_args(keys, admin_keys, "--worker", worker.address)) for n in ("ra", "rb"))
        started += [a, b]
        with client(a, USER_KEY) as ca, client(b, USER_KEY, ADMIN_KEY) as cb, client(a, OTHER_KEY) as ta, \
                client(b, OTHER_KEY) as tb:
            long = ca.generate(MODEL, prompt="a long answer", max_tokens=4000, ignore_eos=True, timeout=120)
            next(long)
            until(lambda: peer_in_flight(cb) == 1, what="replica B hearing of A's call")
            assert metric(b, "switchyard_api_key_peer_in_flight", key="team-a") == 1
            with pytest.raises(grpc.RpcError) as e:
                cb.complete(MODEL, prompt="second", max_tokens=1, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "1 through other router replicas" in (e.value.details() or ""), e.value.details()
            long.cancel()  # type: ignore[attr-defined]
            until(lambda: peer_in_flight(cb) == 0, what="replica B hearing the call ended")
            assert metric(b, "switchyard_api_key_peer_in_flight", key="team-a") == 0
            assert cb.complete(MODEL, prompt="after", max_tokens=1, timeout=30).usage.completion_tokens == 1

            big = ta.generate(MODEL, prompt="x", max_tokens=900, ignore_eos=True, timeout=120)
            next(big)  # its prompt + 900 reserved at A, and at B once it hears of it: ~100 left
            until(lambda: peer_in_flight(cb) == 1, what="replica B hearing of A's call")
            assert exhausted(lambda: tb.complete(MODEL, prompt="x", max_tokens=600, timeout=30), "tokens_per_min")
            big.cancel()  # type: ignore[attr-defined]
            until(lambda: peer_in_flight(cb) == 0, what="replica B hearing the call ended")
            # what A's call did not use came back at B too: long before the refill alone would allow it
            again = tb.generate(MODEL, prompt="x", max_tokens=600, timeout=120)
            assert len(next(again).token_ids) > 0
            again.cancel()  # type: ignore[attr-defined]
        assert metric(b, "switchyard_api_key_limited_total", key="team-a", limit="max_in_flight") == 1
        assert metric(b, "switchyard_api_key_limited_total", key="team-t", limit="tokens_per_min") == 1
