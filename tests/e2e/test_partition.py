"""Peers that go silent mid-request (a network partition, a host gone: no FIN, no RST, no answer), on loopback
through `BlackholeProxy`.

- A silent worker loses its requests to the router's keepalive (`workers.keepalive_*`) within its ping interval
  and timeout, and a request that had no token yet is retried on another worker. gRPC closes a connection whose ping goes unanswered
  only after `grpc.http2.ping_timeout_ms` (a minute by default, whatever `grpc.keepalive_timeout_ms` says):
  without it in `channel_options` the request waits out its deadline here.
- A silent client (of the router, or a router as a worker's client) loses its requests to the server's own pings
  (`server_options`), so the worker stops running them; without them, it runs them to their end (over a minute
  here).
"""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from blackhole import BlackholeProxy
from polling import until
from test_router_e2e import FAST, MODEL, client_for, is_idle, metric, start_router, start_worker

from switchyard.bench import procs
from switchyard.grpc_options import KEEPALIVE_TIMEOUT_S, MIN_KEEPALIVE_TIME_S
from switchyard.router.client import RouterClient

pytestmark = pytest.mark.e2e

# the router pings its worker as often as its config takes, and waits a second for the answer (the default is 5)
PING_TIMEOUT_S = 1
ROUTER_PINGING = ["--set", f"workers.keepalive_time_s={MIN_KEEPALIVE_TIME_S}",
                  "--set", f"workers.keepalive_timeout_s={PING_TIMEOUT_S}"]
# the silence is found within a ping interval and its timeout; the deadline leaves room for that, not for the
# minute gRPC waits on an unanswered ping by default
DEADLINE_S = MIN_KEEPALIVE_TIME_S + PING_TIMEOUT_S + 20
# the servers under test ping every second and wait a second for the answer
PINGING = ["--keepalive-time-s", "1", "--keepalive-timeout-s", "1"]
LONG = 4000  # tokens: over a minute at ~18 ms a step (time scale 2), unless the request is cancelled


def test_a_request_on_a_silent_worker_is_retried_elsewhere() -> None:
    # its prompt takes several steps of 16 tokens, each seconds long at 1000x: no token yet when the worker goes silent
    silent = start_worker("silent", "--time-scale", "1000", "--max-num-batched-tokens", "16")
    spare = start_worker("spare", *FAST)
    with procs.running([silent, spare]), BlackholeProxy(silent.address, h2c=True) as proxy:
        router = start_router([], "--worker", proxy.address, *ROUTER_PINGING)
        with procs.running([router]), client_for(router) as c, ThreadPoolExecutor(1) as pool:
            pending = pool.submit(c.complete, MODEL, prompt="partitioned " * 40, max_tokens=4, timeout=DEADLINE_S)
            until(lambda: not is_idle(silent), what="the request on it")
            c.register_worker(spare.address, timeout=10)
            proxy.hole()
            started = time.monotonic()
            resp = pending.result()
            waited = time.monotonic() - started
            assert (resp.timings.worker_id, resp.timings.attempts) == ("spare", 2)
            assert metric(router, "switchyard_retries_total") == 1
            # the router closed its connection to the silent worker on an unanswered ping after the configured
            # timeout, not the default's (the midpoint tells them apart): timed from the ping, as the ping
            # interval's phase against the silence puts the close anywhere from one to six seconds after it
            until(lambda: any(conn.closed_at for conn in proxy.connections), what="the router to close the connection")
            closes = [(conn.first_unanswered_ping(), conn.closed_at) for conn in proxy.connections if conn.closed_at]
            midpoint = (PING_TIMEOUT_S + KEEPALIVE_TIMEOUT_S) / 2
            assert all(ping is not None and closed - ping < midpoint for ping, closed in closes), closes
        silent.stop(signal.SIGKILL)  # its drain would wait for the request it still runs, at 1000x
    print(f"retried after {waited:.1f} s of silence; closed {[round(end - p, 2) for p, end in closes]} s after the ping")


def test_a_silent_router_s_requests_stop_on_the_worker() -> None:
    worker = start_worker("pinging", "--time-scale", "2", *PINGING)
    with procs.running([worker]), BlackholeProxy(worker.address) as proxy:
        router = start_router([], "--worker", proxy.address)  # over its Session stream, the default
        with procs.running([router]), client_for(router) as c:
            call = c.generate(MODEL, prompt="orphan", max_tokens=LONG, ignore_eos=True)
            next(call)  # running
            proxy.hole()  # the router cannot reach the worker to abort it: only the worker's own pings can
            until(lambda: is_idle(worker), timeout_s=15, what="the worker to abort the silent router's request")
            call.cancel()


def test_a_silent_client_s_request_stops_on_the_worker() -> None:
    worker = start_worker("busy", "--time-scale", "2")
    with procs.running([worker]):
        router = start_router([worker], "--set", "server.keepalive_time_s=1", "--set", "server.keepalive_timeout_s=1")
        with procs.running([router]), BlackholeProxy(router.address) as proxy, RouterClient(proxy.address) as c:
            call = c.generate(MODEL, prompt="gone", max_tokens=LONG, ignore_eos=True)
            next(call)
            proxy.hole()
            until(lambda: is_idle(worker), timeout_s=15, what="the router to cancel the silent client's request")
            assert metric(router, "switchyard_cancelled_total") == 1
            call.cancel()
