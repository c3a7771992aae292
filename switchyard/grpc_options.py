"""gRPC options shared by every Switchyard channel and server: the router's channels to its workers and every
server a router or a worker runs (the bench relay's too), so that one side's keepalive is what the other accepts.

The router pings each worker every `KEEPALIVE_TIME_MS` while a call is open (gRPC sends at most two pings without
sending data in between; the router's Stats polls are that data), to find a dead worker within seconds. A gRPC
server's default ping policy takes at most one ping per 5 minutes from a peer it sent no data since, and answers the
third early one with GOAWAY "too_many_pings", which closes the connection and every call on it. Measured with the
router's channel options before this module: a request sent on a worker Session stream that had been idle for 2
minutes failed with UNAVAILABLE (its ping was the third strike). The daemon's own Stats polls spared its connections
(each answer is data, which clears the strikes); the bench relay and any client of the router holding an idle stream
(a Health Watch, a request queued long) were not. So every server here takes pings down to a quarter of the router's
interval: a ping counts as early by the server's clock, and one sent on time may arrive a little early.
"""

from __future__ import annotations

KEEPALIVE_TIME_MS = 10_000
MIN_PING_INTERVAL_MS = KEEPALIVE_TIME_MS // 4  # the most often a server here takes a client's pings

# NOTE: grpc's default reconnect backoff grows to 120 s; a restarted worker must be seen within about a second.
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", 5_000),
)

SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.so_reuseport", 0),  # gRPC sets SO_REUSEPORT: a second router or worker on a taken port would share it
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_permit_without_calls", 1),  # a client's pings between calls count by the same interval
)
