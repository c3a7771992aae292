"""End to end: real simulated worker processes and a real router process, over loopback gRPC with the client.

Every process is waited on through its READY line; every later wait polls an observable condition (worker
Stats, the router's metrics or admin view) with a bound, never a fixed sleep.
"""

from __future__ import annotations

import signal
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
from polling import until
from prometheus_client.parser import text_string_to_metric_families

from switchyard.bench import procs
from switchyard.router.client import RouterClient, make_request
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from switchyard.workers.sim_worker import SNAPSHOT_BATCH_BLOCKS

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"
FAST = ["--time-scale", "0.01"]
SLOW = ["--time-scale", "1"]  # ~9 ms per decode step: long requests stay in flight while a test acts


def start_worker(name: str, *extra: str) -> procs.Proc:
    return procs.start(name, ["worker", "sim", "--port", "0", "--worker-id", name, *extra])


def start_router(workers: list[procs.Proc], *extra: str) -> procs.Proc:
    args = ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0", "--grace-s", "10"]
    for w in workers:
        args += ["--worker", w.address]
    return procs.start("router", [*args, *extra])


def client_for(router: procs.Proc) -> RouterClient:
    return RouterClient(router.address, admin_address=router.extra["admin"])

def worker_stats(worker: procs.Proc) -> worker_pb2.WorkerStats:
    with grpc.insecure_channel(worker.address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=5)


def is_idle(worker: procs.Proc) -> bool:
    s = worker_stats(worker)
    return s.num_running == 0 and s.num_waiting == 0


def metric(router: procs.Proc, name: str, **labels: str) -> float:
    body = urllib.request.urlopen(f"http://{router.extra['metrics']}/metrics", timeout=5).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.fixture(scope="module")
def fast_workers() -> Iterator[list[procs.Proc]]:
    workers = [start_worker("fw0", *FAST), start_worker("fw1", *FAST)]
    with procs.running(workers):
        yield workers


@pytest.fixture(params=["session", "calls"])
def router_factory(request: pytest.FixtureRequest) -> Iterator[Callable[..., procs.Proc]]:
    """Each test runs twice: requests over one Session stream per worker, and one Generate call each."""
    started: list[procs.Proc] = []
    mode = ["--set", f"workers.session={'true' if request.param == 'session' else 'false'}"]

    def make(workers: list[procs.Proc], *extra: str) -> procs.Proc:
        r = start_router(workers, *mode, *extra)
        started.append(r)
        return r

    make.session = request.param == "session"  # type: ignore[attr-defined]
    yield make
    for r in started:
        r.stop()


@pytest.fixture
def own_workers() -> Iterator[Callable[..., procs.Proc]]:
    started: list[procs.Proc] = []

    def make(name: str, *extra: str) -> procs.Proc:
        w = start_worker(name, *extra)
        started.append(w)
        return w

    yield make
    for w in started:
        w.stop(signal.SIGKILL)


# ---------------------------------------------------------------------- request path
def test_streaming_and_complete(fast_workers: list[procs.Proc], router_factory) -> None:  # type: ignore[no-untyped-def]
    router = router_factory(fast_workers, "--policy", "round_robin")
    with client_for(router) as c:
        chunks = list(c.generate(MODEL, prompt="Tell me a story", max_tokens=12, ignore_eos=True, request_id="s1"))
        final = chunks[-1]
        assert sum(len(ch.token_ids) for ch in chunks) == 12
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.completion_tokens == 12 and final.usage.prompt_tokens > 0
        assert final.timings.worker_id in {"fw0", "fw1"} and final.timings.attempts == 1
        assert 0 < final.timings.ttft_s <= final.timings.e2e_s
        assert all(ch.request_id == "s1" for ch in chunks)
        # the request's stream interval: the first token alone, then chunks of at least 5 (the worker gathers them)
        gathered = list(c.generate(MODEL, prompt="Tell me a story", max_tokens=23, ignore_eos=True,
                                   stream_interval_tokens=5))
        assert all(len(ch.token_ids) >= 5 for ch in gathered[1:-1]), [len(ch.token_ids) for ch in gathered]
        assert len(gathered[0].token_ids) < 23 and sum(len(ch.token_ids) for ch in gathered) == 23

        resp = c.complete(MODEL, messages=[("system", "be brief"), ("user", "hi")], max_tokens=8, ignore_eos=True)
        assert len(resp.token_ids) == 8 and resp.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert resp.text  # the worker's text deltas, concatenated

        seen = {c.complete(MODEL, prompt=f"p{i}", max_tokens=2).timings.worker_id for i in range(6)}
        assert seen == {"fw0", "fw1"}  # round_robin alternates

        # KV events reach the router's prefix view: 64 prompt tokens = 4 full blocks of 16 on the serving worker
        served = c.complete(MODEL, token_ids=list(range(500, 564)), max_tokens=1).timings.worker_id
        until(
            lambda: {s.worker_id: s.num_resident_blocks for s in c.list_workers()}[served] >= 4,
            what="prefix view holds the prompt's blocks",
        )
    assert metric(router, "switchyard_requests_total", model=MODEL, status="ok") == 10
    assert metric(router, "switchyard_routing_decision_seconds_count") == 10
    # over sessions, each worker's one stream carried all its requests
    for w in ("fw0", "fw1"):
        assert metric(router, "switchyard_worker_sessions_total", worker=w) == (1 if router_factory.session else 0)


def test_error_statuses(fast_workers: list[procs.Proc], router_factory) -> None:  # type: ignore[no-untyped-def]
    router = router_factory(fast_workers, "--max-tokens", "100")
    cases = [
        (make_request("no-such-model", prompt="x"), grpc.StatusCode.NOT_FOUND),
        (make_request(MODEL, prompt=""), grpc.StatusCode.INVALID_ARGUMENT),
        (make_request(MODEL, prompt="x", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT),
        (make_request(MODEL, prompt="x", max_tokens=101), grpc.StatusCode.INVALID_ARGUMENT),
        (make_request(MODEL, prompt="x", temperature=-0.5), grpc.StatusCode.INVALID_ARGUMENT),
        (make_request(MODEL, prompt="x", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT),
    ]
    with client_for(router) as c:
        for req, code in cases:
            with pytest.raises(grpc.RpcError) as e:
                c.complete(request=req, timeout=10)
            assert e.value.code() is code, (req, e.value.details())
            assert e.value.details()


def test_prompt_longer_than_max_model_len(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("short", *FAST, "--max-model-len", "64")
    router = router_factory([w])
    with client_for(router) as c, pytest.raises(grpc.RpcError) as e:
        c.complete(MODEL, token_ids=list(range(100, 165)), max_tokens=4)  # 65 > 64
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "max length 64" in e.value.details()


# ---------------------------------------------------------------------- cancellation and deadlines
def test_cancel_mid_stream_aborts_on_the_worker(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("slow", *SLOW)
    router = router_factory([w])
    with client_for(router) as c:
        call = c.generate(MODEL, prompt="long one", max_tokens=2000, ignore_eos=True)
        next(call), next(call)
        assert worker_stats(w).num_running == 1
        call.cancel()
        until(lambda: is_idle(w), what="worker idle after cancel")
        until(lambda: metric(router, "switchyard_cancelled_total", stage="dispatched") == 1, what="cancel metric")


def test_deadline_returns_deadline_exceeded_and_aborts(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("slow", *SLOW)
    router = router_factory([w])
    with client_for(router) as c, pytest.raises(grpc.RpcError) as e:
        c.complete(MODEL, prompt="long one", max_tokens=2000, ignore_eos=True, timeout=0.5)
    assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    until(lambda: is_idle(w), what="worker idle after deadline")
    until(lambda: metric(router, "switchyard_deadline_exceeded_total") == 1, what="deadline metric")


# ---------------------------------------------------------------------- worker failures
def test_worker_killed_before_first_token_is_retried(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w0, w1 = own_workers("k0", *FAST), own_workers("k1", *FAST)
    # slow polls, so the router learns of the death from the failed dispatch, not from Stats
    router = router_factory([w0, w1], "--policy", "round_robin", "--set", "workers.stats_interval_s=30")
    with client_for(router) as c:
        w0.stop(signal.SIGKILL)
        resps = [c.complete(MODEL, prompt=f"q{i}", max_tokens=4, timeout=20) for i in range(2)]
    assert [r.timings.worker_id for r in resps] == ["k1", "k1"]
    # round robin sends one of the two to k0 first: exactly one retry
    assert sorted(r.timings.attempts for r in resps) == [1, 2]
    assert metric(router, "switchyard_retries_total") == 1


def test_a_worker_restarted_between_polls_is_rebuilt_from_its_new_incarnation(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    """A worker that restarts before failed polls reveal it (here the router tolerates 1,000 failures) comes back
    with an empty cache and its KV sequence numbers from 1, and serves a request from another router replica
    before this router's KV stream resubscribes. The router sees the new incarnation in Stats, re-reads Info and
    rebuilds the worker's view from its snapshot. Before, it kept the dead process's blocks and skipped the new
    one's events as replays: their seq were below the last it had applied."""
    w = own_workers("phoenix", *FAST)
    # polls (and the KV stream's retries) once a second: the other replica's request lands between two of them
    router = router_factory([w], "--set", "workers.unhealthy_after_failures=1000", "--set", "workers.stats_interval_s=1")
    with client_for(router) as c:
        def resident() -> int:
            return c.list_workers()[0].num_resident_blocks

        for i in range(4):  # ~19 blocks and several KV batches in the first process
            c.complete(MODEL, prompt=f"the old cache {i} " * 100, max_tokens=2, timeout=20)
        until(lambda: resident() >= 15, what="the first process's blocks in the router's view")
        w.stop(signal.SIGKILL)
        again = own_workers("phoenix", *FAST, "--port", w.address.rsplit(":", 1)[1])  # same address, new process
        with grpc.insecure_channel(again.address) as ch:  # another router replica's request: 80 tokens, 5 blocks
            request = worker_pb2.WorkerGenerateRequest(
                request_id="other-replica", prompt_token_ids=list(range(1000, 1080)),
                sampling=common_pb2.SamplingParams(max_tokens=2),
            )
            assert len(list(worker_pb2_grpc.WorkerStub(ch).Generate(request, timeout=20))) >= 1
        until(lambda: 4 <= resident() <= 6 and c.list_workers()[0].healthy, timeout_s=15,
              what="the view rebuilt from the new process")


def test_a_router_started_after_the_cache_filled_gets_all_of_it_in_several_batches(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    """A worker whose cache holds more blocks than one snapshot batch sends a router that subscribes later several
    batches, numbered only on the last; the router ends with every block in its view. With every batch numbered,
    it took the later ones for replays and dropped them; as one message, a full cache of unique prompts (4.25 MiB)
    was past gRPC's default 4 MiB receive limit."""
    w = own_workers("hoard", *FAST)
    shared = list(range(5000, 5512))  # 32 blocks that every prompt starts with, then 96 of its own
    with grpc.insecure_channel(w.address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)
        for i in range(48):
            request = worker_pb2.WorkerGenerateRequest(
                request_id=f"fill-{i}",
                prompt_token_ids=shared + [(i * 1536 + k) % 30000 + 1 for k in range(1536)],
                sampling=common_pb2.SamplingParams(max_tokens=1),
            )
            assert len(list(stub.Generate(request, timeout=20))) >= 1
    expected = 32 + 48 * 96
    assert expected > SNAPSHOT_BATCH_BLOCKS
    router = router_factory([w])
    with client_for(router) as c:
        until(lambda: c.list_workers()[0].num_resident_blocks == expected, timeout_s=20,
              what=f"all {expected} blocks in the view of a router that subscribed after they were cached")


def test_worker_killed_mid_stream_ends_with_unavailable(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("doomed", *SLOW)
    router = router_factory([w])
    received = 0
    with client_for(router) as c, pytest.raises(grpc.RpcError) as e:
        for chunk in c.generate(MODEL, prompt="x", max_tokens=2000, ignore_eos=True, timeout=30):
            received += len(chunk.token_ids)
            if received >= 3:
                w.stop(signal.SIGKILL)
    assert e.value.code() is grpc.StatusCode.UNAVAILABLE
    assert f"after {received} tokens were delivered" in e.value.details()


def test_no_healthy_worker_is_unavailable(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("lonely", *FAST)
    router = router_factory([w])
    with client_for(router) as c:
        w.stop(signal.SIGKILL)
        until(lambda: not c.list_workers()[0].healthy, what="router marks the worker unhealthy")
        with pytest.raises(grpc.RpcError) as e:
            c.complete(MODEL, prompt="x", max_tokens=2, timeout=10)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE


# ---------------------------------------------------------------------- admin and queue
def test_admin_list_register_drain_deregister(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    a, b = own_workers("a", *FAST), own_workers("b", *FAST)
    router = router_factory([a])
    with client_for(router) as c:
        assert [(s.worker_id, s.state, s.healthy) for s in c.list_workers()] == [("a", "ready", True)]
        status = c.register_worker(b.address, timeout=10)
        assert (status.worker_id, status.address, status.model, status.state) == ("b", b.address, MODEL, "ready")
        assert c.drain_worker("a").state == "draining"
        served = {c.complete(MODEL, prompt=f"d{i}", max_tokens=2).timings.worker_id for i in range(4)}
        assert served == {"b"}
        assert c.deregister_worker("b").state == "removed"
        assert {s.worker_id: s.state for s in c.list_workers()} == {"a": "draining"}
        with pytest.raises(grpc.RpcError) as e:
            c.complete(MODEL, prompt="x", max_tokens=2)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE


def test_queue_full_is_resource_exhausted_with_retry_hint(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("one-seat", *SLOW, "--max-num-seqs", "1")
    router = router_factory([w], "--queue-max-size", "1", "--set", "queue.retry_after_ms=750")
    with client_for(router) as c:
        running = c.generate(MODEL, prompt="first", max_tokens=2000, ignore_eos=True)
        next(running)  # dispatched: in_flight 1 = max_num_seqs 1, so the worker is saturated
        queued = c.generate(MODEL, prompt="second", max_tokens=3, ignore_eos=True)
        until(lambda: metric(router, "switchyard_queue_depth", model=MODEL) == 1, what="second request queued")
        with pytest.raises(grpc.RpcError) as e:
            c.complete(MODEL, prompt="third", max_tokens=3)
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "750") in tuple(e.value.trailing_metadata())
        running.cancel()  # frees the seat: the queued request is released and completes
        chunks = list(queued)
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].timings.queue_s > 0
    assert metric(router, "switchyard_queue_rejected_total") == 1


# ---------------------------------------------------------------------- lifecycle
def test_sigterm_drains_in_flight_then_exits_zero(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("steady", *SLOW)
    router = router_factory([w])
    with client_for(router) as c:
        call = c.generate(MODEL, prompt="finish me", max_tokens=60, ignore_eos=True, timeout=30)
        got = len(next(call).token_ids)
        router.popen.send_signal(signal.SIGTERM)
        for chunk in call:
            got += len(chunk.token_ids)
    assert got == 60  # the in-flight stream completed during the grace period
    assert router.popen.wait(timeout=20) == 0


def test_second_sigint_forces_exit(own_workers, router_factory) -> None:  # type: ignore[no-untyped-def]
    w = own_workers("endless", *SLOW)
    router = router_factory([w])
    with client_for(router) as c:
        call = c.generate(MODEL, prompt="never finishes in time", max_tokens=2000, ignore_eos=True, timeout=60)
        next(call)
        router.popen.send_signal(signal.SIGINT)  # graceful: would wait up to grace_s=10 for this stream
        # NOT_SERVING, then new RPCs are refused (UNAVAILABLE) while the stream drains
        until(lambda: _health(router) in ("NOT_SERVING", "UNAVAILABLE"), what="router stops serving")
        router.popen.send_signal(signal.SIGINT)  # forced
        assert router.popen.wait(timeout=10) == 130
        with pytest.raises(grpc.RpcError):
            list(call)
    until(lambda: is_idle(w), what="worker idle after the forced stop")


def _health(router: procs.Proc) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(router.address) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
