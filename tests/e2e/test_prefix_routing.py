"""End to end: a repeated prefix is routed to the worker that holds it (real router and worker processes), by one
router and by replicas that share the workers.

The router learns residency only from the workers' KV events, so the test first waits (polling the admin view,
with a bound) until the serving worker's blocks reached the router, then checks where the follow-ups go and that
the worker itself reports the prefix-cache hit.
"""

from __future__ import annotations

import random

import grpc
import pytest
from polling import until

from switchyard.bench import procs
from switchyard.router.client import RouterClient, make_request
from switchyard.v1 import worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e

MODEL = "mistral-7b-sim"
BLOCK = 16


def _wait_resident(client: RouterClient, worker_id: str, min_blocks: int) -> None:
    until(lambda: any(w.worker_id == worker_id and w.num_resident_blocks >= min_blocks for w in client.list_workers()),
          what=f"the router to see {min_blocks} resident blocks on {worker_id}")


@pytest.mark.parametrize("policy", ["e2"])
def test_repeated_prefix_goes_to_the_worker_holding_it(policy: str) -> None:
    workers = [
        procs.start(f"w{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--time-scale", "0.01"])
        for i in range(3)
    ]
    args = ["serve", "--port", "0", "--admin-port", "0", "--no-metrics", "--policy", policy]
    for w in workers:
        args += ["--worker", w.address]
    router = procs.start("router", args)
    rng = random.Random(7)
    prefix = [1, *(rng.randrange(3, 32000) for _ in range(40 * BLOCK - 1))]  # 40 full blocks = 640 tokens
    with procs.running([*workers, router]), RouterClient(router.address, admin_address=router.extra["admin"]) as c:
        first = c.complete(request=make_request(MODEL, token_ids=prefix, max_tokens=2, ignore_eos=True))
        holder = first.timings.worker_id
        _wait_resident(c, holder, 40)
        for i in range(6):
            # 640 shared + 64 new tokens: cached (640) > missed (64), so E2 exploits the holder.
            suffix = [rng.randrange(3, 32000) for _ in range(4 * BLOCK)]
            resp = c.complete(request=make_request(MODEL, token_ids=prefix + suffix, max_tokens=2, ignore_eos=True))
            assert resp.timings.worker_id == holder, f"follow-up {i} went to {resp.timings.worker_id}"
            assert resp.usage.cached_prompt_tokens >= 40 * BLOCK  # the worker's own prefix cache hit


@pytest.mark.parametrize("policy", ["e2", "switchyard"])
def test_router_replicas_share_what_the_workers_cache(policy: str) -> None:
    """Workers are the source of truth: two router replicas over the same workers each learn residency from the
    workers' KV events, so a prefix served through one replica is routed to its holder by the other, and a
    replica started afterwards (a restart) rebuilds the same view from the workers' KV snapshot. The workers'
    Stats count every replica's requests (the fleet arrival rate the default policy's B term reads)."""
    workers = [
        procs.start(f"w{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--time-scale", "0.01"])
        for i in range(3)
    ]

    def start_router(name: str) -> procs.Proc:
        args = ["serve", "--port", "0", "--admin-port", "0", "--no-metrics", "--policy", policy]
        for w in workers:
            args += ["--worker", w.address]
        return procs.start(name, args)

    def follow_up(c: RouterClient) -> tuple[str, int]:
        suffix = [rng.randrange(3, 32000) for _ in range(4 * BLOCK)]
        resp = c.complete(request=make_request(MODEL, token_ids=prefix + suffix, max_tokens=2, ignore_eos=True))
        return resp.timings.worker_id, resp.usage.cached_prompt_tokens

    rng = random.Random(11)
    prefix = [1, *(rng.randrange(3, 32000) for _ in range(40 * BLOCK - 1))]
    a, b = start_router("router-a"), start_router("router-b")
    with procs.running([*workers, a, b]):
        with RouterClient(a.address, admin_address=a.extra["admin"]) as ca, \
                RouterClient(b.address, admin_address=b.extra["admin"]) as cb:
            holder = ca.complete(
                request=make_request(MODEL, token_ids=prefix, max_tokens=2, ignore_eos=True)
            ).timings.worker_id
            _wait_resident(cb, holder, 40)  # b never dispatched it: only the holder's KV events can say so
            for _ in range(3):
                assert follow_up(cb) == (holder, 40 * BLOCK)
        c = start_router("router-c")  # a replica that starts after the prefix was cached
        with procs.running([c]), RouterClient(c.address, admin_address=c.extra["admin"]) as cc:
            _wait_resident(cc, holder, 40)  # from the KV snapshot the worker sends each new subscriber
            assert follow_up(cc) == (holder, 40 * BLOCK)
        received = {w.name: _requests_received(w.address) for w in workers}
    assert received == {w.name: (5 if w.name == holder else 0) for w in workers}


def _requests_received(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.WorkerStub(ch).Stats(worker_pb2.StatsRequest(), timeout=10).num_requests_received


def _wait_peer(client: RouterClient, n: int = 1, timeout_s: float = 10.0) -> str:
    """The worker on which this replica counts `n` requests another replica sent (from the workers' events)."""
    got = until(lambda: [w.worker_id for w in client.list_workers() if w.peer_in_flight >= n], timeout_s,
                "the replica to learn of the other replica's request")
    return got[0]


def _in_flight_on(client: RouterClient) -> str:
    return next(w.worker_id for w in client.list_workers() if w.in_flight)


def test_router_replicas_learn_each_others_requests_from_the_workers() -> None:
    """A request in flight through one replica is known to the others before any of its blocks is cached: the
    worker streams its admission to every KV event subscriber. So replica B sends a follow-up sharing a prefix that
    replica A's request is still prefilling to the same worker (which then serves it from its cache), and a replica
    started later learns the open requests from the worker's snapshot. Slow workers (time scale 20: a 640-token
    prefill takes ~1 s) keep the prefix uncached while B routes."""
    workers = [
        procs.start(f"w{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--time-scale", "20"])
        for i in range(3)
    ]

    def start_router(name: str) -> procs.Proc:
        args = ["serve", "--port", "0", "--admin-port", "0", "--no-metrics", "--policy", "e2"]
        for w in workers:
            args += ["--worker", w.address]
        return procs.start(name, args)

    rng = random.Random(13)
    prefix = [1, *(rng.randrange(3, 32000) for _ in range(40 * BLOCK - 1))]
    a, b = start_router("router-a"), start_router("router-b")
    with procs.running([*workers, a, b]), RouterClient(a.address, admin_address=a.extra["admin"]) as ca, \
            RouterClient(b.address, admin_address=b.extra["admin"]) as cb:
        # B's own long request: without A's requests in its view, B would send the follow-up elsewhere than A did
        busy = cb.generate(request=make_request(MODEL, token_ids=[1, *range(100, 400)], max_tokens=3000,
                                                ignore_eos=True))
        _wait_peer(ca)  # A knows of it too (it steers A's prefix away from B's busy worker)
        first = ca.generate(request=make_request(MODEL, token_ids=prefix, max_tokens=1, ignore_eos=True))
        holder = _wait_peer(cb)  # B learned of A's request from the worker, before its first token
        assert holder == _in_flight_on(ca)
        suffix = [rng.randrange(3, 32000) for _ in range(4 * BLOCK)]
        resp = cb.complete(request=make_request(MODEL, token_ids=prefix + suffix, max_tokens=1, ignore_eos=True))
        assert resp.timings.worker_id == holder
        assert resp.usage.cached_prompt_tokens >= 40 * BLOCK  # prefilled once, by A's request
        assert list(first)[-1].finish_reason  # A's request ended normally
        c = start_router("router-c")  # starts while B's long request is open
        with procs.running([c]), RouterClient(c.address, admin_address=c.extra["admin"]) as cc:
            assert _wait_peer(cc) == _in_flight_on(cb)  # from the snapshot each new subscriber gets
        busy.cancel()
