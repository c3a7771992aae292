"""The router daemon in-process over real loopback gRPC, against scripted in-process fake workers.

Covers the request path (stream, complete, text), retries, mid-stream failure, cancellation, deadlines, the
queue (hold, release, full), admin calls, health/reflection, KV-event ingestion and metrics. Waits are on
conditions (fake-worker notifications or router state), never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest
from factories import make_stats
from fake_worker import FakeWorker, Script
from grpc_health.v1 import health_pb2, health_pb2_grpc
from polling import until_async

from switchyard.auth import KeySpec
from switchyard.router.admission import LONG_INPUT, AdmittedRequest, Sampling
from switchyard.router.api import COMPLETE_STREAM_INTERVAL
from switchyard.router.client import AsyncRouterClient
from switchyard.router.clock import RealClock
from switchyard.router.config import load_config
from switchyard.router.dispatch import DEADLINE_SLACK_S
from switchyard.router.peer_mirror import peer_key
from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.preble_e2 import PrebleE2
from switchyard.router.policies.registry import DEFAULT_POLICY
from switchyard.router.server import RouterDaemon
from switchyard.v1 import common_pb2, worker_pb2
from switchyard.workers.tokenizer import load_tokenizer

TOK = load_tokenizer(None)


@asynccontextmanager
async def stack(fakes: list[FakeWorker], api_key: str | None = None,
                **sections: dict) -> AsyncIterator[tuple[RouterDaemon, AsyncRouterClient]]:  # type: ignore[type-arg]
    addresses = [await w.start() for w in fakes]
    overrides: dict[str, dict] = {  # type: ignore[type-arg]
        # not frozen: this process runs many daemons and must go on collecting their objects
        "server": {"port": 0, "admin_port": 0, "metrics_enabled": False, "grace_s": 1.0, "gc_freeze_at_start": False},
        "workers": {"addresses": addresses, "stats_interval_s": 0.05, "health_interval_s": 0.1, "connect_timeout_s": 2.0},
    }
    for name, body in sections.items():
        overrides.setdefault(name, {}).update(body)
    daemon = RouterDaemon(load_config(environ={}, overrides=overrides))
    bound = await daemon.start()
    client = AsyncRouterClient(f"127.0.0.1:{bound.port}", admin_address=bound.admin, api_key=api_key)
    try:
        yield daemon, client
    finally:
        await client.close()
        await daemon.stop(0.5)
        for w in fakes:
            await w.stop()


def metric(daemon: RouterDaemon, name: str, **labels: str) -> float | None:
    """A sample of the daemon's registry; None while that series does not exist."""
    return daemon.metrics.registry.get_sample_value(name, labels)


def sample(daemon: RouterDaemon, name: str, **labels: str) -> float:
    return metric(daemon, name, **labels) or 0.0


async def test_policy_actions_are_exported() -> None:
    """E2's rebalancing redirects and replicas (`Policy.counters`) reach switchyard_policy_actions_total at the next
    tick: a series per action from the first tick, advanced by what the policy counted since; each tick's duration
    reaches switchyard_policy_tick_seconds."""
    async with stack([FakeWorker("w0")], routing={"policy": "e2", "tick_interval_ms": 10}) as (daemon, _):
        def value(action: str) -> float | None:
            return metric(daemon, "switchyard_policy_actions_total", policy="e2", action=action)

        await until_async(lambda: value("replications") is not None)
        assert value("rebalance_redirects") == value("replications") == 0
        # every tick is timed (the event loop stops while the policy's background work runs)
        assert sample(daemon, "switchyard_policy_tick_seconds_count", policy="e2") >= 1
        # the count a rebalancing pass keeps (causing a real one takes hundreds of requests within E2's window H;
        # bench suite section f and test_skew_rules_spread_a_hot_prefix do that in virtual time)
        daemon.policy.num_redirects += 3  # type: ignore[attr-defined]
        await until_async(lambda: value("rebalance_redirects") == 3)
        daemon.policy.num_redirects += 1  # type: ignore[attr-defined]
        await until_async(lambda: value("rebalance_redirects") == 4)
        assert value("replications") == 0


async def test_policy_state_sizes_are_exported() -> None:
    """What the policy holds (`Policy.state_sizes`: E2's tree nodes and blocks, its block index's bytes, requests
    in flight) reaches switchyard_policy_state at each tick and follows the tree: a request's prompt adds its
    blocks there."""
    async with stack([FakeWorker("w0")], routing={"policy": "e2", "tick_interval_ms": 10}) as (daemon, client):
        def value(quantity: str) -> float | None:
            return metric(daemon, "switchyard_policy_state", policy="e2", quantity=quantity)

        await until_async(lambda: value("tree_blocks") is not None)
        assert value("tree_blocks") == 0 and value("tree_nodes") == 0 and value("in_flight_requests") == 0
        prompt = "a long shared system prompt, " * 20  # several full blocks
        _ = [c async for c in client.generate("m", prompt=prompt, max_tokens=2, request_id="req-s")]
        blocks = daemon.policy.tree.num_blocks  # type: ignore[attr-defined]
        assert blocks >= 2
        await until_async(lambda: value("tree_blocks") == blocks)
        assert value("tree_nodes") == daemon.policy.tree.num_nodes >= 1  # type: ignore[attr-defined]
        if hasattr(daemon.policy.tree, "index_bytes"):  # type: ignore[attr-defined]
            assert value("tree_index_bytes") == daemon.policy.tree.index_bytes >= 1_024 * 16  # type: ignore[attr-defined]


async def test_streaming_generate_end_to_end() -> None:
    w = FakeWorker("w0")
    async with stack([w]) as (daemon, client):
        chunks = [c async for c in client.generate("m", prompt="Hello there, router", max_tokens=5, request_id="req-1")]
        assert [list(c.token_ids) for c in chunks] == [[1000], [1001], [1002], [1003], [1004]]
        final = chunks[-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(TOK.encode("Hello there, router")), 5)
        assert final.timings.worker_id == "w0" and final.timings.attempts == 1
        assert 0 <= final.timings.queue_s <= final.timings.ttft_s <= final.timings.e2e_s
        assert final.timings.route_s > 0
        assert all(c.request_id == "req-1" for c in chunks)
        # token ids only reach the worker, with the BOS the router added
        assert list(w.received[0].prompt_token_ids) == TOK.encode("Hello there, router")
        assert w.received[0].sampling.max_tokens == 5
        assert w.received[0].stream_interval_tokens == 1  # each token as it comes, unless configured or asked
        assert sample(daemon, "switchyard_requests_total", model="m", worker="w0", status="ok") == 1
        assert sample(daemon, "switchyard_ttft_seconds_count", model="m") == 1
        assert sample(daemon, "switchyard_routing_decision_seconds_count", policy=DEFAULT_POLICY) == 1
        await until_async(lambda: daemon.fleet.get(WorkerId("w0")).in_flight == 0)  # type: ignore[union-attr]


async def test_a_worker_advertising_a_session_it_does_not_serve_gets_generate_calls() -> None:
    """A worker whose Info says it serves Session but answers UNIMPLEMENTED (a faulty build; this fake is one): the
    request on that stream fails over (here, with no other worker, UNAVAILABLE, never a hang), and the router sends
    that worker Generate calls from then on. A worker that does not advertise it only ever gets calls."""
    w = FakeWorker("w0", advertises_session=True)
    async with stack([w]) as (daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            _ = [c async for c in client.generate("m", prompt="a", max_tokens=2)]
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        async def served() -> bool:
            try:
                return len([c async for c in client.generate("m", prompt="b", max_tokens=2)]) == 2
            except grpc.aio.AioRpcError:
                return False  # the failed stream's probe may still hold the worker out of the routable set

        await until_async(served)
        assert [r.prompt_token_ids for r in w.received][-1] == TOK.encode("b")  # through a Generate call
        assert sample(daemon, "switchyard_worker_sessions_total", worker="w0") == 1
    plain = FakeWorker("w1")
    async with stack([plain], workers={"session": True}) as (daemon, client):
        assert len([c async for c in client.generate("m", prompt="a", max_tokens=2)]) == 2
        assert sample(daemon, "switchyard_worker_sessions_total", worker="w1") == 0


async def test_complete_relays_the_workers_text() -> None:
    # Workers detokenize (and apply stop strings, as vLLM does); the router relays their text deltas unchanged.
    w = FakeWorker("w0")
    async with stack([w]) as (_daemon, client):
        resp = await client.complete("m", messages=[("user", "hi")], max_tokens=6)
        assert list(resp.token_ids) == [1000, 1001, 1002, 1003, 1004, 1005]
        assert resp.text == "<1000><1001><1002><1003><1004><1005>"
        assert resp.finish_reason == common_pb2.FINISH_REASON_LENGTH and resp.timings.worker_id == "w0"
        assert list(w.received[0].prompt_token_ids) == TOK.apply_chat_template([_msg("user", "hi")])


async def test_the_stream_interval_reaches_the_worker() -> None:
    """Generate asks the worker for the request's stream interval, else the router's default; Complete for as few
    chunks as the worker's hold limit allows (nobody reads them before the end)."""
    w = FakeWorker("w0")
    async with stack([w], server={"stream_interval_tokens": 4}) as (_daemon, client):
        assert len([c async for c in client.generate("m", prompt="a", max_tokens=2)]) == 2
        assert len([c async for c in client.generate("m", prompt="b", max_tokens=2, stream_interval_tokens=16)]) == 2
        assert len((await client.complete("m", prompt="c", max_tokens=2)).token_ids) == 2
    assert [r.stream_interval_tokens for r in w.received] == [4, 16, COMPLETE_STREAM_INTERVAL]


async def test_the_stream_interval_rises_while_the_event_loop_lags() -> None:
    """server.stream_interval_max_tokens: while the event loop's lag is above the target,
    Generate requests that do not choose an interval ask the worker for longer chunks, and one that names its
    interval keeps it; once the loop is calm again the interval falls back to the base. The lag is real: a task on
    the daemon's loop that computes for 20 ms at a time (the probe's timer waits for it)."""
    w = FakeWorker("w0")
    server = {"stream_interval_max_tokens": 2, "stream_lag_target_ms": 5.0}
    async with stack([w], server=server) as (daemon, client):
        governor = daemon.stream_governor
        assert governor.interval == 1 and sample(daemon, "switchyard_stream_interval_tokens") == 1
        await until_async(lambda: sample(daemon, "switchyard_event_loop_lag_seconds_count") >= 3)
        assert sample(daemon, "switchyard_event_loop_lag_seconds_sum") < 0.005 * 3  # idle: well under the target
        busy = True

        async def hog() -> None:
            while busy:
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < 0.02:
                    pass
                await asyncio.sleep(0)

        task = asyncio.create_task(hog())
        try:
            await until_async(lambda: governor.interval == 2, timeout_s=15, what="the interval at its cap")
            assert sample(daemon, "switchyard_stream_interval_tokens") == 2
            assert governor.last_lag_s > 0.005
            assert len([c async for c in client.generate("m", prompt="a", max_tokens=2)]) == 2
            assert len([c async for c in client.generate("m", prompt="b", max_tokens=2, stream_interval_tokens=1)]) == 2
        finally:
            busy = False
            await task
        await until_async(lambda: governor.interval == 1, timeout_s=20, what="the interval back at its base")
        assert sample(daemon, "switchyard_stream_interval_tokens") == 1
        assert len([c async for c in client.generate("m", prompt="c", max_tokens=2)]) == 2
    assert [r.stream_interval_tokens for r in w.received] == [2, 1, 1]


async def test_without_a_cap_the_stream_interval_stays_put_under_lag() -> None:
    """The default (stream_interval_max_tokens = 0): the loop's lag is measured, the interval never moves."""
    w = FakeWorker("w0")
    async with stack([w], server={"stream_interval_tokens": 2}) as (daemon, client):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.3:  # one 300 ms stall of the daemon's loop
            pass
        await until_async(lambda: metric(daemon, "switchyard_event_loop_lag_seconds_bucket", le="0.25") is not None
                          and sample(daemon, "switchyard_event_loop_lag_seconds_count")
                          > sample(daemon, "switchyard_event_loop_lag_seconds_bucket", le="0.25"))
        assert not daemon.stream_governor.adaptive
        assert len([c async for c in client.generate("m", prompt="a", max_tokens=2)]) == 2
    assert [r.stream_interval_tokens for r in w.received] == [2]


def _msg(role: str, content: str):  # type: ignore[no-untyped-def]
    from switchyard.workers.tokenizer import ChatMessage

    return ChatMessage(role, content)


async def test_worker_failing_before_first_token_is_retried_elsewhere() -> None:
    dead, ok = FakeWorker("w0", script=Script(fail_before_first=True)), FakeWorker("w1")
    async with stack([dead, ok], routing={"policy": "round_robin"}) as (daemon, client):
        # the fleet's order depends on which Info answered first; within two round-robin requests one starts on w0
        resps = [await client.complete("m", prompt="retry me", max_tokens=3) for _ in range(2)]
        assert [r.timings.worker_id for r in resps] == ["w1", "w1"]
        retried = [r for r in resps if r.timings.attempts == 2]
        assert len(retried) >= 1 and all(r.timings.attempts in (1, 2) for r in resps)
        assert [r.request_id for r in dead.received] == [r.request_id for r in retried]
        assert sample(daemon, "switchyard_retries_total", model="m", reason="unavailable") == len(retried)
        assert daemon.fleet.get(WorkerId("w0")).in_flight == 0  # type: ignore[union-attr]


async def test_retries_are_bounded() -> None:
    workers = [FakeWorker(f"w{i}", script=Script(fail_before_first=True)) for i in range(3)]
    async with stack(workers, retries={"max_attempts": 2}) as (_daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=3)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "failed on 2 attempt(s)" in e.value.details()
        assert sum(len(w.received) for w in workers) == 2


async def test_worker_failing_mid_stream_ends_with_unavailable_and_the_token_count() -> None:
    w = FakeWorker("w0", script=Script(fail_after_tokens=3))
    async with stack([w]) as (_daemon, client):
        got: list[int] = []
        with pytest.raises(grpc.aio.AioRpcError) as e:
            async for c in client.generate("m", prompt="x", max_tokens=10):
                got.extend(c.token_ids)
        assert got == [1000, 1001, 1002]
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "after 3 tokens were delivered" in e.value.details()
        assert len(w.received) == 1  # never retried once tokens went out


async def test_a_token_quota_is_charged_what_each_request_used(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A `tokens_per_min` key's reservation (prompt + max_tokens) settled on each way a request ends: a natural
    stop short of max_tokens, a worker failing mid-stream, and one failing before any token (the faults come
    from the fake worker: they cannot be caused on demand otherwise)."""
    key = "k" * 32
    (tmp_path / "keys").write_text(f"{key} name=team tokens_per_min=600\n")  # 10 tokens a second come back
    spec = KeySpec("team", tokens_per_min=600)
    w = FakeWorker("w0")
    async with stack([w], api_key=key, server={"api_keys_file": str(tmp_path / "keys")},
                     retries={"max_attempts": 1}) as (daemon, client):
        def used() -> float:
            return sample(daemon, "switchyard_api_key_tokens_total", service="switchyard.v1.Router", key="team")

        w.script = Script(stop_after=2)
        r = await client.complete("m", prompt="x", max_tokens=150)
        prompt = r.usage.prompt_tokens
        assert r.usage.completion_tokens == 2 and used() == prompt + 2
        w.script = Script(fail_after_tokens=3)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=150)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and used() == 2 * prompt + 5
        w.script = Script(fail_before_first=True)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=150)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and used() == 2 * prompt + 5  # it never ran
        # every unused token came back (reserved: 3 x (prompt + 150); kept: the first two's use, plus the refill)
        assert 600 - (2 * prompt + 5) <= daemon.key_limits.tokens_left(spec) <= 600


async def test_worker_errors_that_are_the_requests_fault_pass_through() -> None:
    w = FakeWorker("w0", script=Script(status=grpc.StatusCode.INVALID_ARGUMENT))
    async with stack([w]) as (_daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=3)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "scripted failure" in e.value.details()


async def test_a_stalled_worker_stream_fails_its_attempt() -> None:
    """A worker whose server answers but whose stream goes silent (a hung engine): after
    `stream_idle_timeout_s` without a chunk the attempt fails. Before the first token it is retried on another
    worker; after one, the request ends UNAVAILABLE. Before, such a request waited forever."""
    stuck, fine = FakeWorker("w0", script=Script(hold_after=0)), FakeWorker("w1")
    workers = {"stream_idle_timeout_s": 0.3}
    async with stack([stuck, fine], routing={"policy": "round_robin"}, workers=workers) as (daemon, client):
        resps = [await client.complete("m", prompt="x", max_tokens=3, request_id=f"s{i}") for i in range(2)]
        assert [r.timings.worker_id for r in resps] == ["w1", "w1"]
        retried = sum(r.timings.attempts == 2 for r in resps)  # round robin sent it to w0 first
        assert retried >= 1 and all(r.timings.attempts <= 2 for r in resps)
        await stuck.wait_for(lambda: len(stuck.cancelled) == retried)
        assert sample(daemon, "switchyard_retries_total", model="m", reason="stalled") == retried
    mute = FakeWorker("w0", script=Script(hold_after=1))
    async with stack([mute], workers=workers) as (daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=5, request_id="s3")
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "after 1 tokens were delivered" in e.value.details() and "no chunk for 0.3 s" in e.value.details()
        await until_async(lambda: daemon.dispatcher.num_active == 0 and daemon.fleet.get(WorkerId("w0")).in_flight == 0)  # type: ignore[union-attr]


async def test_client_cancel_aborts_on_the_worker() -> None:
    w = FakeWorker("w0", script=Script(hold_after=2))
    async with stack([w]) as (daemon, client):
        call = client.generate_call("m", prompt="x", max_tokens=10, request_id="c1")
        assert [c.token_ids[0] async for c in _take(call, 2)] == [1000, 1001]
        call.cancel()
        await w.wait_for(lambda: "c1" in w.aborted and "c1" in w.cancelled)
        await until_async(lambda: daemon.fleet.get(WorkerId("w0")).in_flight == 0)  # type: ignore[union-attr]
        await until_async(lambda: sample(daemon, "switchyard_cancelled_total", model="m", stage="dispatched") == 1)


async def _take(call, n: int):  # type: ignore[no-untyped-def]
    it = call.__aiter__()
    for _ in range(n):
        yield await it.__anext__()


async def test_deadline_while_dispatched_aborts_on_the_worker() -> None:
    w = FakeWorker("w0", script=Script(hold_after=1))
    async with stack([w]) as (daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=10, request_id="d1", timeout=0.3)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await w.wait_for(lambda: "d1" in w.cancelled)
        await until_async(lambda: sample(daemon, "switchyard_deadline_exceeded_total", model="m", stage="dispatched") == 1)
        await until_async(lambda: daemon.fleet.get(WorkerId("w0")).in_flight == 0)  # type: ignore[union-attr]


class _ShiftedClock:
    """The router's monotonic clock, moved forward on demand: the one fake in this file's deadline tests. A client
    cancel (RST_STREAM) that arrives a few ms before the router's own deadline happens in the field, but not on
    demand; moving the clock the dispatcher reads stands it in, and leaves the worker call's real timeout as set."""

    def __init__(self) -> None:
        self.offset = 0.0

    def now(self) -> float:
        return RealClock().now() + self.offset


async def test_a_cancel_just_before_the_deadline_counts_as_the_deadline() -> None:
    """A cancel within DEADLINE_SLACK_S of the request's deadline is the deadline passing (the client's own deadline
    fires a hop before the router's); one well before it is the client giving up."""
    w = FakeWorker("w0", script=Script(hold_after=1))
    async with stack([w]) as (daemon, _):
        clock = _ShiftedClock()
        daemon.dispatcher._clock = clock
        assert 0.02 < DEADLINE_SLACK_S < 0.5
        for rid, before_deadline_s in (("near", 0.02), ("early", 0.5)):
            req = AdmittedRequest(
                request_id=rid, model="m", prompt_token_ids=(5, 6, 7), block_hashes=(), sampling=Sampling(max_tokens=4),
                arrival_s=clock.now(),
            )
            chunks = daemon.dispatcher.generate(req, time_remaining_s=30.0)
            task = asyncio.create_task(anext(chunks))  # type: ignore[arg-type]
            await w.wait_for(lambda rid=rid: rid in w.active)  # type: ignore[misc]
            clock.offset += 30.0 - before_deadline_s
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await w.wait_for(lambda rid=rid: rid in w.cancelled)  # type: ignore[misc]
        assert sample(daemon, "switchyard_deadline_exceeded_total", model="m", stage="dispatched") == 1
        assert sample(daemon, "switchyard_cancelled_total", model="m", stage="dispatched") == 1
        statuses = {s.labels["status"]: s.value for m in daemon.metrics.registry.collect()
                    if m.name == "switchyard_requests" for s in m.samples if s.name.endswith("_total")}
        assert statuses == {"deadline_exceeded": 1, "cancelled": 1}


async def test_queue_holds_releases_and_rejects_when_full() -> None:
    # max_num_seqs=1: one in flight saturates the worker; queue max_size=1
    w = FakeWorker("w0", max_num_seqs=1, script=Script(hold_after=0))
    async with stack([w], queue={"max_size": 1, "retry_after_ms": 250}) as (daemon, client):
        first = asyncio.create_task(client.complete("m", prompt="a", max_tokens=2, request_id="q1"))
        await w.wait_for(lambda: "q1" in w.active)
        second = asyncio.create_task(client.complete("m", prompt="b", max_tokens=2, request_id="q2"))
        await until_async(lambda: len(daemon.queue) == 1)
        assert [r.request_id for r in w.received] == ["q1"]  # q2 is held in the router, not sent
        call = client._stub.Complete(_req("q3"), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call
        assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ("retry-after-ms", "250") in tuple(await call.trailing_metadata())
        w.gate.set()  # q1 finishes -> capacity frees -> q2 released (late binding)
        r1, r2 = await first, await second
        assert (r1.timings.queue_s, r2.timings.worker_id) == (pytest.approx(r1.timings.queue_s), "w0")
        assert r2.timings.queue_s > 0
        assert sample(daemon, "switchyard_queue_rejected_total", model="m") == 1


def _req(rid: str):  # type: ignore[no-untyped-def]
    from switchyard.router.client import make_request

    return make_request("m", prompt="c", max_tokens=2, request_id=rid)


async def test_cancel_and_deadline_remove_from_the_queue() -> None:
    w = FakeWorker("w0", max_num_seqs=1, script=Script(hold_after=0))
    async with stack([w], queue={"max_size": 4}) as (daemon, client):
        first = asyncio.create_task(client.complete("m", prompt="a", max_tokens=2, request_id="q1"))
        await w.wait_for(lambda: "q1" in w.active)
        waiting = client.generate_call("m", prompt="b", max_tokens=2, request_id="q2")
        await until_async(lambda: len(daemon.queue) == 1)
        waiting.cancel()
        await until_async(lambda: len(daemon.queue) == 0)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="c", max_tokens=2, request_id="q3", timeout=0.2)
        assert e.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        await until_async(lambda: len(daemon.queue) == 0)
        await until_async(lambda: sample(daemon, "switchyard_deadline_exceeded_total", model="m", stage="queued") == 1)
        assert sample(daemon, "switchyard_cancelled_total", model="m", stage="queued") == 1
        w.gate.set()
        await first
        assert [r.request_id for r in w.received] == ["q1"]  # neither q2 nor q3 ever reached the worker


async def test_a_cancel_that_meets_the_release_in_one_loop_iteration_is_not_sent() -> None:
    """The pump binds a queued request with a deadline, and its client cancels before the request's task runs
    again: the cancel wins, the slot is freed, and nothing reaches the worker (3.11's asyncio.wait_for returned the
    decision and swallowed the cancel, so the cancelled request was sent)."""
    w = FakeWorker("w0")
    w.num_waiting = 1  # the worker reports a queue: the router holds
    async with stack([w]) as (daemon, _):
        rec = daemon.fleet.get(WorkerId("w0"))
        assert rec is not None
        await until_async(lambda: rec.num_waiting == 1)
        req = AdmittedRequest(
            request_id="x1", model="m", prompt_token_ids=(5, 6, 7), block_hashes=(), sampling=Sampling(max_tokens=2),
            arrival_s=daemon.clock.now(),
        )
        chunks = daemon.dispatcher.generate(req, time_remaining_s=30.0)
        task = asyncio.create_task(anext(chunks))  # type: ignore[arg-type]
        await until_async(lambda: len(daemon.queue) == 1)
        daemon.fleet.apply_stats(rec.worker_id, make_stats(), daemon.clock.now())  # room, as a Stats poll reports
        daemon.dispatcher.pump()  # binds x1 (in_flight 1) and resolves its waiter ...
        assert rec.in_flight == 1
        task.cancel()  # ... and the client's cancel arrives before the task resumes
        with pytest.raises(asyncio.CancelledError):
            await task
        assert rec.in_flight == 0 and daemon.dispatcher.num_active == 0
        assert sample(daemon, "switchyard_cancelled_total", model="m", stage="dispatched") == 1
        assert w.received == []


async def test_a_policy_that_raises_fails_its_own_request_with_internal_and_nothing_else() -> None:
    """A policy bug (here: scripted raises) ends the request it hit with INTERNAL and frees its slot; the requests
    queued behind it are still released, and the periodic ticks go on. Before, a raise in the pump left its request
    waiting forever, a raise in on_dispatch kept the worker's slot, and a raise in on_tick stopped the ticks (and
    with them the pump's safety net)."""
    w = FakeWorker("w0", max_num_seqs=8)
    w.num_waiting = 1  # the router holds until the worker reports room
    async with stack([w], routing={"policy": "round_robin", "tick_interval_ms": 10}) as (daemon, client):
        policy, rec = daemon.policy, daemon.fleet.get(WorkerId("w0"))
        assert rec is not None
        select, on_dispatch, ticks = policy.select, policy.on_dispatch, [0]

        def failing_select(ctx, fleet, now):  # type: ignore[no-untyped-def]
            if ctx.request_id == "bad-select":
                raise RuntimeError("scripted select failure")
            return select(ctx, fleet, now)

        def failing_on_dispatch(ctx, decision, now):  # type: ignore[no-untyped-def]
            if ctx.request_id == "bad-dispatch":
                raise RuntimeError("scripted on_dispatch failure")
            on_dispatch(ctx, decision, now)

        def failing_tick(now: float) -> None:
            ticks[0] += 1
            raise RuntimeError("scripted on_tick failure")

        policy.select, policy.on_dispatch, policy.on_tick = failing_select, failing_on_dispatch, failing_tick  # type: ignore[method-assign]
        await until_async(lambda: rec.num_waiting == 1)
        bad = asyncio.create_task(client.complete("m", prompt="a", max_tokens=1, request_id="bad-select"))
        await until_async(lambda: len(daemon.queue) == 1)
        good = asyncio.create_task(client.complete("m", prompt="b", max_tokens=1, request_id="good"))
        await until_async(lambda: len(daemon.queue) == 2)
        w.num_waiting = 0  # the next Stats poll releases both, the failing one first
        async with asyncio.timeout(5):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await bad
            assert (await good).timings.worker_id == "w0"
        assert e.value.code() is grpc.StatusCode.INTERNAL
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="c", max_tokens=1, request_id="bad-dispatch")  # the fast path
        assert e.value.code() is grpc.StatusCode.INTERNAL
        await until_async(lambda: daemon.dispatcher.num_active == 0)
        assert rec.in_flight == 0
        await until_async(lambda: ticks[0] >= 3)


async def test_a_long_prompt_is_tokenized_off_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long prompt's tokenization (~0.3 s for 100k tokens) runs in a thread, so the router serves other requests
    meanwhile: here the long prompt's encode is held until a short request has finished. On the event loop, the
    short request could not finish while the encode held the loop."""
    long_text, release, held = "word " * 2000, threading.Event(), threading.Event()  # 10k chars (> LONG_INPUT)
    encode = TOK.encode

    def held_encode(text: str, add_bos: bool = True) -> list[int]:
        if len(text) > LONG_INPUT:
            held.set()
            release.wait(timeout=5)  # bounded: without the thread, this holds the loop for 5 s and the test fails
        return encode(text, add_bos)

    monkeypatch.setattr(TOK, "encode", held_encode)
    async with stack([FakeWorker("w0", max_model_len=4096)]) as (_daemon, client):
        long = asyncio.create_task(client.complete("m", prompt=long_text, max_tokens=1, request_id="long"))
        await until_async(held.is_set)
        short = await client.complete("m", prompt="short", max_tokens=1, request_id="short")
        assert not release.is_set() and not long.done()  # served while the long prompt was still tokenizing
        release.set()
        assert (await long).usage.prompt_tokens == len(encode(long_text)) and short.usage.completion_tokens == 1


async def test_stats_waiting_holds_until_the_worker_reports_room() -> None:
    w = FakeWorker("w0", max_num_seqs=8)
    w.num_waiting = 2
    async with stack([w]) as (daemon, client):
        await until_async(lambda: daemon.fleet.get(WorkerId("w0")).num_waiting == 2)  # type: ignore[union-attr]
        task = asyncio.create_task(client.complete("m", prompt="x", max_tokens=1, request_id="h1"))
        await until_async(lambda: len(daemon.queue) == 1)
        w.num_waiting = 0  # the next Stats poll releases it
        resp = await task
        assert resp.timings.queue_s > 0


async def test_errors_over_grpc() -> None:
    async with stack([FakeWorker("w0", max_model_len=16)], limits={"max_tokens": 50}) as (_daemon, client):
        cases = [
            ({"model": "nope", "prompt": "x"}, grpc.StatusCode.NOT_FOUND),
            ({"model": "m", "prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"model": "m", "prompt": "x", "max_tokens": 0}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"model": "m", "prompt": "x", "max_tokens": 51}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"model": "m", "prompt": "x", "temperature": -1.0}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"model": "m", "prompt": "x", "top_p": 0.0}, grpc.StatusCode.INVALID_ARGUMENT),
            ({"model": "m", "token_ids": list(range(10, 27))}, grpc.StatusCode.INVALID_ARGUMENT),  # 17 > 16
        ]
        for kw, code in cases:
            kw.setdefault("max_tokens", 4)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.complete(**kw)
            assert e.value.code() is code, kw
            with pytest.raises(grpc.aio.AioRpcError) as e:
                _ = [c async for c in client.generate(**kw)]
            assert e.value.code() is code, kw


async def test_made_up_model_names_do_not_grow_the_metric_series() -> None:
    """A client picks the model label: requests for models no worker serves are counted under model="", so made-up
    names cannot grow the series without bound; a served model keeps its own label."""
    async with stack([FakeWorker("w0")], server={"metrics_enabled": False}) as (daemon, client):
        for i in range(5):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.complete(f"made-up-{i}", prompt="x", max_tokens=1)
            assert e.value.code() is grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError):
            await client.complete("m", prompt="", max_tokens=1)  # INVALID_ARGUMENT for a served model
        assert sample(daemon, "switchyard_requests_total", model="", worker="", status="not_found") == 5
        assert sample(daemon, "switchyard_requests_total", model="m", worker="", status="invalid_argument") == 1
        models = {s.labels["model"] for m in daemon.metrics.registry.collect() if m.name == "switchyard_requests"
                  for s in m.samples}
        assert models == {"", "m"}


async def test_no_healthy_worker_is_unavailable() -> None:
    w = FakeWorker("w0")
    async with stack([w]) as (daemon, client):
        await w.stop()
        await until_async(lambda: not daemon.fleet.get(WorkerId("w0")).healthy)  # type: ignore[union-attr]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=2)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "no healthy worker" in e.value.details()
        [status] = await client.list_workers()
        assert (status.state, status.healthy) == ("unhealthy", False)


async def test_admin_list_drain_deregister_register() -> None:
    w0, w1, w2 = FakeWorker("w0"), FakeWorker("w1"), FakeWorker("w2")
    await w2.start()
    async with stack([w0, w1], routing={"policy": "round_robin"}) as (daemon, client):
        listed = {s.worker_id: s for s in await client.list_workers()}
        assert set(listed) == {"w0", "w1"}
        assert (listed["w0"].state, listed["w0"].model, listed["w0"].healthy) == ("ready", "m", True)
        assert listed["w1"].address == w1.address

        assert (await client.drain_worker("w0")).state == "draining"
        got = [(await client.complete("m", prompt="x", max_tokens=1)).timings.worker_id for _ in range(3)]
        assert got == ["w1", "w1", "w1"]

        assert (await client.deregister_worker("w1")).state == "removed"
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="x", max_tokens=1)
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE  # w0 draining, w1 gone

        status = await client.register_worker(w2.address)
        assert (status.worker_id, status.state) == ("w2", "ready")
        assert (await client.complete("m", prompt="x", max_tokens=1)).timings.worker_id == "w2"
        assert {s.worker_id for s in await client.list_workers()} == {"w0", "w2"}

        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.drain_worker("nope")
        assert e.value.code() is grpc.StatusCode.NOT_FOUND
    await w2.stop()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"model": ""}, "reports no model"),
        ({"block_size": 0}, "block_size=0"),
        ({"max_model_len": 0}, "max_model_len=0"),
        ({"kv_blocks_total": 0}, "kv_capacity_blocks=0"),
    ],
)
async def test_register_rejects_a_worker_whose_info_cannot_be_served(fields: dict, message: str) -> None:
    """A worker that leaves a field of its Info unset (proto zero) is refused at join with the field named; before,
    a block_size of 0 joined, and every request to its model then failed inside admission's hashing."""
    bad = FakeWorker("wx", **fields)
    await bad.start()
    async with stack([FakeWorker("w0")], workers={"connect_timeout_s": 0.3}) as (_daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.register_worker(bad.address)
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and message in e.value.details()
        assert [s.worker_id for s in await client.list_workers()] == ["w0"]
    await bad.stop()


async def test_register_refuses_a_worker_past_the_policys_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """E2's radix tree holds state for at most 256 workers (`Policy.max_workers`); past that its hooks would raise
    for that worker's KV events and dispatches. The registry refuses the worker past the limit instead, naming it,
    and takes one once another has left. (The limit is lowered to 1 here: 257 workers make the same test slow.)"""
    monkeypatch.setattr(PrebleE2, "max_workers", 1)
    extra = FakeWorker("w1")
    await extra.start()
    try:
        async with stack([FakeWorker("w0")], routing={"policy": "e2"}, workers={"connect_timeout_s": 0.3}) as (
            _daemon, client,
        ):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.register_worker(extra.address)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "holds state for at most 1 workers and 1 are registered" in e.value.details()
            assert [s.worker_id for s in await client.list_workers()] == ["w0"]
            await client.deregister_worker("w0")
            assert (await client.register_worker(extra.address)).worker_id == "w1"
    finally:
        await extra.stop()


async def test_deregistering_a_worker_while_it_registers_ends_the_register_call() -> None:
    """RegisterWorker waits for the first connect attempt; a DeregisterWorker of that address meanwhile ends it with
    ABORTED. Before, the deregistration cancelled the attempt that would have woken it, and the call hung."""
    async with stack([FakeWorker("w0")], workers={"connect_timeout_s": 30.0}) as (daemon, client):
        address = "127.0.0.1:1"  # nothing listens: Info waits for a connection up to connect_timeout_s
        register = asyncio.create_task(client.register_worker(address))
        await until_async(lambda: any(s.address == address for s in daemon.registry.statuses()))
        assert (await client.deregister_worker(address)).state == "removed"
        async with asyncio.timeout(5):
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await register
        assert e.value.code() is grpc.StatusCode.ABORTED and "deregistered" in e.value.details()
        assert [s.worker_id for s in await client.list_workers()] == ["w0"]


async def test_register_rejects_mismatched_tokenizer_and_unreachable_address() -> None:
    bad = FakeWorker("wx", tokenizer_id="sentencepiece:other.model:000")
    await bad.start()
    async with stack([FakeWorker("w0")], workers={"connect_timeout_s": 0.3}) as (_daemon, client):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.register_worker(bad.address)
        assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION and "tokenizer mismatch" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.register_worker("127.0.0.1:1")
        assert e.value.code() is grpc.StatusCode.UNAVAILABLE
        assert [s.worker_id for s in await client.list_workers()] == ["w0"]
    await bad.stop()


async def test_register_accepts_the_same_tokenizer_under_another_file_name() -> None:
    """A model directory's `tokenizer.model` and the router's copy of it under another name are one tokenizer: the
    contents' digest decides, not the name (a vLLM worker serving the tiny Llama beside the router's default)."""
    digest = TOK.tokenizer_id.rpartition(":")[2]
    renamed = FakeWorker("wr", tokenizer_id=f"sentencepiece:tokenizer.model:{digest}")
    await renamed.start()
    async with stack([FakeWorker("w0")]) as (_daemon, client):
        status = await client.register_worker(renamed.address)
        assert (status.worker_id, status.healthy) == ("wr", True)
    await renamed.stop()


async def test_kv_events_feed_the_prefix_view() -> None:
    w = FakeWorker("w0", block_size=4)
    async with stack([w]) as (daemon, client):
        await until_async(lambda: len(w._kv_queues) == 1)  # the router subscribed
        ids = list(range(100, 112))  # 12 tokens = 3 blocks of 4
        await client.complete("m", token_ids=ids, max_tokens=1)
        spec = daemon.registry.spec("m")
        assert spec is not None and spec.block_size == 4
        from switchyard.router.admission import block_hashes

        hashes = block_hashes(ids, spec, "", "")
        await until_async(lambda: daemon.fleet.cached_prefix_blocks("m", hashes) == {"w0": 3})
        [status] = await client.list_workers()
        assert status.num_resident_blocks == 3
        await until_async(lambda: sample(daemon, "switchyard_worker_prefix_cache_hit_ratio", worker="w0") == 0.25)
        # the stream's own metrics: one subscription, the batch that stored the 3 blocks, its lag
        assert sample(daemon, "switchyard_kv_streams_total", worker="w0") == 1
        assert sample(daemon, "switchyard_kv_event_batches_total", worker="w0") >= 1
        assert sample(daemon, "switchyard_kv_event_blocks_total", worker="w0", kind="stored") == 3
        assert sample(daemon, "switchyard_kv_event_blocks_total", worker="w0", kind="removed") == 0
        assert sample(daemon, "switchyard_kv_event_lag_seconds_count") == sample(
            daemon, "switchyard_kv_event_batches_total", worker="w0")
        await client.deregister_worker("w0")  # a gone worker's series go with it
        assert metric(daemon, "switchyard_kv_event_batches_total", worker="w0") is None
        assert metric(daemon, "switchyard_kv_event_blocks_total", worker="w0", kind="stored") is None


def _admitted(rid: str, origin: str) -> worker_pb2.KvEventBatch:
    batch = worker_pb2.KvEventBatch()
    ev = batch.requests.add(request_id=rid, origin=origin)
    ev.admitted.CopyFrom(worker_pb2.RequestAdmitted(block_hashes=[11, 12], num_prompt_tokens=9, max_tokens=4))
    return batch


async def test_the_workers_request_events_show_the_other_replicas_requests() -> None:
    """A worker's request events reach the policy for requests another replica sent (the dispatcher names this one
    in each worker request, so its own are skipped); a snapshot lists every open request, so what a gap in the
    stream left behind is dropped; a lost worker's mirrored requests end."""
    w = FakeWorker("w0", block_size=4)
    async with stack([w], routing={"policy": "e2"}) as (daemon, client):
        await until_async(lambda: len(w._kv_queues) == 1)
        mirror = daemon.registry.mirror
        await client.complete("m", token_ids=list(range(100, 112)), max_tokens=1)
        assert w.received[-1].origin == daemon.registry.origin != ""
        w.push_kv(_admitted("r1", "replica-a"))
        w.push_kv(_admitted("r2", daemon.registry.origin))  # ours: the dispatcher told the policy already
        await until_async(lambda: sample(daemon, "switchyard_kv_event_batches_total", worker="w0") >= 3)
        [status] = await client.list_workers()
        assert (status.peer_in_flight, set(mirror.live)) == (1, {peer_key("replica-a", "r1")})
        assert sample(daemon, "switchyard_worker_peer_in_flight", worker="w0") == 1
        assert peer_key("replica-a", "r1") in daemon.policy.in_flight  # type: ignore[attr-defined]
        snapshot = _admitted("r3", "replica-a")
        snapshot.snapshot = True  # r1 ended unseen (a gap): only r3 is open
        w.push_kv(snapshot)
        await until_async(lambda: set(mirror.live) == {peer_key("replica-a", "r3")})
        assert peer_key("replica-a", "r1") not in daemon.policy.in_flight  # type: ignore[attr-defined]
        await client.deregister_worker("w0")
        assert len(mirror) == 0
        assert metric(daemon, "switchyard_worker_peer_in_flight", worker="w0") is None


async def test_collector_pauses_are_measured_and_long_ones_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Every garbage collection while the daemon runs lands in switchyard_gc_pause_seconds by generation, and one
    at or over server.gc_warn_ms is logged; what startup loaded is frozen out of later collections."""
    async with stack([FakeWorker("w0")], server={"gc_warn_ms": 0.001, "gc_freeze_at_start": True}) as (daemon, _):
        assert gc.get_freeze_count() > 0
        before = sample(daemon, "switchyard_gc_pause_seconds_count", generation="2")
        gc.collect()
        assert sample(daemon, "switchyard_gc_pause_seconds_count", generation="2") == before + 1
        assert "garbage collection of generation 2 paused the router" in caplog.text
    gc.unfreeze()  # this test process runs many daemons: do not keep their objects out of its own collections


async def test_health_and_reflection_on_the_public_port() -> None:
    async with stack([FakeWorker("w0")]) as (daemon, client):
        stub = health_pb2_grpc.HealthStub(client._channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="switchyard.v1.Router"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        refl = reflection_pb2_grpc.ServerReflectionStub(client._channel)
        names: list[str] = []
        async for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
            names += [s.name for s in r.list_services_response.service]
        assert "switchyard.v1.Router" in names and "grpc.health.v1.Health" in names
        await daemon.health.enter_graceful_shutdown()
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=""))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_duplicate_request_id_in_flight_is_rejected() -> None:
    w = FakeWorker("w0", script=Script(hold_after=0))
    async with stack([w]) as (_daemon, client):
        first = asyncio.create_task(client.complete("m", prompt="a", max_tokens=1, request_id="dup"))
        await w.wait_for(lambda: "dup" in w.active)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.complete("m", prompt="a", max_tokens=1, request_id="dup")
        assert e.value.code() is grpc.StatusCode.ALREADY_EXISTS
        w.gate.set()
        await first


def test_the_registry_polls_as_often_as_the_policy_s_peer_polls() -> None:
    """llm-d's EPP scrapes load every 50 ms: a daemon routing with llmd_scorer polls its workers' Stats at that
    period (the simulator models the same cap), another policy at `workers.stats_interval_s`; a faster configured
    period stays."""
    def period(policy: str, configured: float) -> float:
        config = load_config(environ={}, overrides={"routing": {"policy": policy},
                                                    "workers": {"stats_interval_s": configured}})
        return RouterDaemon(config).registry.poll_interval_s

    assert period("llmd_scorer", 0.2) == 0.05 and period("llmd_scorer", 0.01) == 0.01
    assert period(DEFAULT_POLICY, 0.2) == 0.2 and period("smg_cache_aware", 0.5) == 0.5
