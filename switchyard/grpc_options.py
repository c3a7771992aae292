"""gRPC options shared by every Switchyard channel and server: the router's channels to its workers and every
server a router or a worker runs (the bench relay's too), so that one side's keepalive is what the other accepts.

The router pings each worker every `KEEPALIVE_TIME_S` while a call is open (gRPC sends at most two pings without
sending data in between; the router's Stats polls are that data), to find a dead worker within seconds. A gRPC
server's default ping policy takes at most one ping per 5 minutes from a peer it sent no data since, and answers the
third early one with GOAWAY "too_many_pings", which closes the connection and every call on it. Measured with the
router's channel options before this module: a request sent on a worker Session stream that had been idle for 2
minutes failed with UNAVAILABLE (its ping was the third strike). The daemon's own Stats polls spared its connections
(each answer is data, which clears the strikes); the bench relay and any client of the router holding an idle stream
(a Health Watch, a request queued long) were not. So every server here takes pings down to a quarter of the router's
default interval: a ping counts as early by the server's clock, and one sent on time may arrive a little early.

Servers ping their own clients too (`server_options`): a client or router host that vanishes without a FIN (a
partition, a power cut) would otherwise keep its requests running, or queued, until TCP gives up on it. A router
whose worker vanishes finds out by its own pings (`channel_options`, config workers.keepalive_*).
"""

from __future__ import annotations

import argparse

KEEPALIVE_TIME_S = 10.0  # the router's pings to a worker (workers.keepalive_time_s) ...
KEEPALIVE_TIMEOUT_S = 5.0  # ... and how long one may go unanswered (workers.keepalive_timeout_s)
# the most often a server here takes a client's pings: a quarter of the router's default interval
MIN_PING_INTERVAL_MS = round(KEEPALIVE_TIME_S * 1000) // 4
# the shortest interval the router's config takes: twice that, as a ping sent on time may arrive a little early
MIN_KEEPALIVE_TIME_S = 2 * MIN_PING_INTERVAL_MS / 1000

# NOTE: grpc's default reconnect backoff grows to 120 s; a restarted worker must be seen within about a second.
_RECONNECT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def _ping_options(keepalive_time_s: float, keepalive_timeout_s: float) -> tuple[tuple[str, int], ...]:
    """Ping the peer every `keepalive_time_s` and close the connection (failing its calls) when a ping goes
    unanswered for `keepalive_timeout_s`; 0 s: no options, gRPC's defaults."""
    if keepalive_time_s <= 0:
        return ()
    timeout_ms = max(1, round(keepalive_timeout_s * 1000))
    return (
        ("grpc.keepalive_time_ms", max(1, round(keepalive_time_s * 1000))),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        # NOTE: what closes a connection whose ping goes unanswered (grpcio 1.85); keepalive_timeout_ms alone does
        # not, and this one's default is a minute
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    )


def channel_options(
    keepalive_time_s: float = KEEPALIVE_TIME_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
) -> tuple[tuple[str, int], ...]:
    """A router's channel to a worker (config: workers.keepalive_*); `keepalive_time_s` 0: no pings, so a silent
    worker's requests wait for their deadline or the stream idle timeout."""
    return (*_RECONNECT_OPTIONS, *_ping_options(keepalive_time_s, keepalive_timeout_s))


CHANNEL_OPTIONS = channel_options()

SERVER_KEEPALIVE_TIME_S = 20.0  # a server pings a client it has heard nothing from for this long
SERVER_KEEPALIVE_TIMEOUT_S = 10.0  # and closes the connection (cancelling its calls) if no answer comes in this long

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.so_reuseport", 0),  # gRPC sets SO_REUSEPORT: a second router or worker on a taken port would share it
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_permit_without_calls", 1),  # a client's pings between calls count by the same interval
)


def server_options(
    keepalive_time_s: float = SERVER_KEEPALIVE_TIME_S, keepalive_timeout_s: float = SERVER_KEEPALIVE_TIMEOUT_S
) -> tuple[tuple[str, int], ...]:
    """`SERVER_OPTIONS` and the server's own pings; `keepalive_time_s` 0 leaves gRPC's (every 2 hours)."""
    return (*SERVER_OPTIONS, *_ping_options(keepalive_time_s, keepalive_timeout_s))


def add_keepalive_args(p: argparse.ArgumentParser) -> None:
    """A worker's flags for `server_options` (the router's are config keys: server.keepalive_*)."""
    p.add_argument("--keepalive-time-s", type=float, default=SERVER_KEEPALIVE_TIME_S,
                   help="ping a client (the router) silent this long; 0 = gRPC's 2 hours")
    p.add_argument("--keepalive-timeout-s", type=float, default=SERVER_KEEPALIVE_TIMEOUT_S,
                   help="close its connection, cancelling its requests, if a ping gets no answer in this long")


def server_options_from_args(args: argparse.Namespace) -> tuple[tuple[str, int], ...]:
    if args.keepalive_time_s < 0 or args.keepalive_timeout_s <= 0:
        raise ValueError("--keepalive-time-s must be >= 0 and --keepalive-timeout-s > 0")
    return server_options(args.keepalive_time_s, args.keepalive_timeout_s)
