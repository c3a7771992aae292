"""End to end under faults: a router and three simulated worker processes serve a closed-loop load (with client
cancels, short deadlines and a small queue) while workers are killed, stopped, drained, deregistered and restarted.

What must hold, whatever the interleaving: every request ends, with a status a client can act on (never UNKNOWN
or INTERNAL); once the faults stop, the fleet is whole again, the router holds no request in flight or queued,
no worker runs or queues an orphaned request, and a new request is served. The fault schedule is fixed; the
interleaving with the load is not, which is the point.
"""

from __future__ import annotations

import random
import signal
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from test_router_e2e import MODEL, client_for, metric, start_router, start_worker, until, worker_stats

from switchyard.router.client import make_request
from switchyard.v1 import router_pb2_grpc

pytestmark = pytest.mark.e2e

WORKER = ["--time-scale", "0.3", "--max-num-seqs", "4", "--num-kv-blocks", "300"]
ALLOWED = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED"}
CLIENTS = 32  # closed loop: more than the fleet's 12 sequences plus the queue's 8, so the queue fills


def one_request(stub: router_pb2_grpc.RouterStub, rng: random.Random, i: int) -> str:
    """One request, possibly cancelled after a few chunks or given a deadline that passes; its final status."""
    req = make_request(MODEL, prompt="shared prefix " * rng.randint(0, 40) + f"q{i} " * rng.randint(1, 30),
                       max_tokens=rng.randint(1, 64), request_id=f"r{i}")
    cancel_after = rng.choice([0, 0, 0, 1, 3])
    call = stub.Generate(req, timeout=rng.choice([60.0, 60.0, 2.0, 0.2, 0.02]))
    try:
        for n, _ in enumerate(call, start=1):
            if n == cancel_after:
                call.cancel()
                return "CANCELLED"
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def test_every_request_ends_and_nothing_leaks_while_workers_fail() -> None:
    workers = {name: start_worker(name, *WORKER) for name in ("c0", "c1", "c2")}
    started = list(workers.values())
    router = start_router(list(workers.values()), "--queue-max-size", "8", "--set", "workers.stream_idle_timeout_s=10")
    stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(router.address))
    outcomes: Counter[str] = Counter()
    lock, done = threading.Lock(), threading.Event()

    def client(k: int) -> None:
        rng, i = random.Random(k), 0
        while not done.is_set():
            status = one_request(stub, rng, k * 1_000_000 + i)
            with lock:
                outcomes[status] += 1
            i += 1

    def ended() -> int:
        with lock:
            return sum(outcomes.values())

    def restart(name: str, sig: int) -> None:
        old = workers[name]
        old.stop(sig)
        workers[name] = start_worker(name, *WORKER, "--port", old.address.rsplit(":", 1)[1])
        started.append(workers[name])

    try:
        with client_for(router) as admin, ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(client, k) for k in range(CLIENTS)]
            faults = [
                lambda: restart("c0", signal.SIGKILL),
                lambda: (admin.drain_worker("c1"), admin.deregister_worker("c1"),
                         admin.register_worker(workers["c1"].address, timeout=10)),
                lambda: restart("c2", signal.SIGTERM),  # drains its in-flight requests, then exits
                lambda: (admin.deregister_worker("c0"), admin.register_worker(workers["c0"].address, timeout=10)),
                lambda: restart("c1", signal.SIGKILL),
            ]
            for fault in faults:  # each one under load: a few hundred requests end between two faults
                target = ended() + 200
                until(lambda t=target: ended() >= t, timeout_s=60, what="requests ending under load")
                fault()
            target = ended() + 200
            until(lambda: ended() >= target, timeout_s=60, what="requests ending after the faults")
            done.set()
            for f in futures:
                f.result(timeout=120)  # every client's last request ended
            assert set(outcomes) <= ALLOWED, outcomes
            assert outcomes["OK"] and outcomes["RESOURCE_EXHAUSTED"] and outcomes["CANCELLED"], outcomes

            until(lambda: sorted((s.worker_id, s.state, s.healthy) for s in admin.list_workers())
                  == [("c0", "ready", True), ("c1", "ready", True), ("c2", "ready", True)],
                  timeout_s=30, what="the fleet whole again")
            until(lambda: all(s.in_flight == 0 for s in admin.list_workers()), what="no request in flight")
            assert metric(router, "switchyard_queue_depth") == 0
            for w in workers.values():  # every cancel and deadline reached the worker as an abort
                until(lambda w=w: (lambda s: s.num_running == s.num_waiting == 0)(worker_stats(w)),
                      what=f"{w.name} idle")
            assert admin.complete(MODEL, prompt="after the faults", max_tokens=4, timeout=30).usage.completion_tokens
    finally:
        done.set()
        for p in [router, *started]:
            p.stop(signal.SIGKILL)
