"""Keepalive pings against the servers we run (real worker and router processes on loopback): a client pinging
every 5 s without a pause (twice the least interval `SERVER_OPTIONS` takes; the router pings every 10 s), with
the router's channel options otherwise, keeps an idle stream open past its fourth ping, where gRPC's default ping
policy (one ping per 5 minutes from a peer it sent no data since, two strikes) closes the connection with GOAWAY
"too_many_pings": with that policy (`SERVER_OPTIONS` without its ping interval) both checks below fail, each on
its own.

The test waits for that time to pass with the streams idle: the idle time is what is under test (a ping can only
be early by the clock), so it is a wait, not a synchronisation.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from switchyard.bench import procs
from switchyard.grpc_options import MIN_PING_INTERVAL_MS, channel_options
from switchyard.router.worker_session import WorkerSession
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc

pytestmark = pytest.mark.e2e

# the default policy's GOAWAY comes with the 4th ping (the 3rd early one); half an interval more for the timers
PING_MS = 2 * MIN_PING_INTERVAL_MS
IDLE_S = 4.5 * PING_MS / 1000
# a steady ping however long the client sends nothing, as the router's Stats polls make its pings (gRPC's client
# stops after two pings without data of its own, which would leave the strikes to a race with the next request)
PINGING = [*channel_options(PING_MS / 1000), ("grpc.http2.max_pings_without_data", 0)]


def request(rid: str) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(
        request_id=rid, prompt_token_ids=list(range(1, 65)),
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )


async def finish_reason(session: WorkerSession, rid: str) -> int:
    reasons = [chunk.finish_reason async for chunk in session.start(request(rid), timeout=30)]
    return reasons[-1]


async def test_idle_streams_outlive_pings_at_the_servers_interval() -> None:
    worker = procs.start("ka-worker", ["worker", "sim", "--port", "0", "--time-scale", "0.01"])
    router = procs.start("ka-router", ["serve", "--port", "0", "--admin-port", "0", "--no-metrics",
                                       "--worker", worker.address])
    with procs.running([worker, router]):
        async with (grpc.aio.insecure_channel(worker.address, options=PINGING) as to_worker,
                    grpc.aio.insecure_channel(router.address, options=PINGING) as to_router):
            session = WorkerSession(worker_pb2_grpc.WorkerStub(to_worker), "worker")
            # the session's stream is open, and idle from here on; so is the Watch after its first answer
            assert await finish_reason(session, "before") == common_pb2.FINISH_REASON_LENGTH
            watch = health_pb2_grpc.HealthStub(to_router).Watch(health_pb2.HealthCheckRequest())
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING

            await asyncio.sleep(IDLE_S)

            assert session.usable, f"the worker closed the idle session: {session.end_code}"
            assert not watch.done(), f"the router closed the idle Watch: {await watch.code()}"
            assert await finish_reason(session, "after") == common_pb2.FINISH_REASON_LENGTH  # the same stream serves
            watch.cancel()
