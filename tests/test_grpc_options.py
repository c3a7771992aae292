"""The keepalive options of the servers and of the router's channels: what each setting turns into, and the flags'
checks (the pings themselves are tested end to end in tests/e2e/test_partition.py and test_keepalive.py)."""

from __future__ import annotations

import argparse

import pytest

from switchyard.grpc_options import (
    CHANNEL_OPTIONS,
    MIN_PING_INTERVAL_MS,
    SERVER_OPTIONS,
    add_keepalive_args,
    channel_options,
    server_options,
    server_options_from_args,
)
from switchyard.router.config import RouterConfig


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_keepalive_args(p)
    return p.parse_args(list(argv))


def test_the_servers_pings_and_the_timeout_that_closes_the_connection() -> None:
    options = dict(server_options(1.5, 0.25))
    assert options.items() >= dict(SERVER_OPTIONS).items()
    assert (options["grpc.keepalive_time_ms"], options["grpc.keepalive_timeout_ms"]) == (1500, 250)
    assert options["grpc.http2.ping_timeout_ms"] == 250  # gRPC's own is a minute, whatever keepalive_timeout_ms says


def test_the_router_s_channels_ping_as_configured_and_reconnect_fast() -> None:
    options = dict(channel_options(7, 0.5))
    assert (options["grpc.keepalive_time_ms"], options["grpc.http2.ping_timeout_ms"]) == (7000, 500)
    assert options["grpc.max_reconnect_backoff_ms"] == 1000  # gRPC's own grows to 2 minutes
    assert "grpc.keepalive_time_ms" not in dict(channel_options(0, 5))
    workers = RouterConfig().workers
    assert workers.channel_options() == CHANNEL_OPTIONS == channel_options(workers.keepalive_time_s, workers.keepalive_timeout_s)


def test_the_shortest_router_ping_interval_is_one_the_workers_take() -> None:
    shortest = RouterConfig.model_validate({"workers": {"keepalive_time_s": 5}}).workers
    # a ping sent on time may arrive a little early: twice the workers' limit leaves room for that
    assert dict(shortest.channel_options())["grpc.keepalive_time_ms"] >= 2 * MIN_PING_INTERVAL_MS


def test_zero_leaves_grpc_s_pings() -> None:
    assert server_options(0, 10) == SERVER_OPTIONS
    assert server_options_from_args(parse("--keepalive-time-s", "0")) == SERVER_OPTIONS


def test_the_workers_flags_default_to_the_router_s_settings() -> None:
    router = RouterConfig().server
    assert server_options_from_args(parse()) == server_options(router.keepalive_time_s, router.keepalive_timeout_s)


@pytest.mark.parametrize("argv", [["--keepalive-time-s", "-1"], ["--keepalive-timeout-s", "0"]])
def test_bad_flags_are_refused(argv: list[str]) -> None:
    with pytest.raises(ValueError, match="--keepalive-time-s must be >= 0 and --keepalive-timeout-s > 0"):
        server_options_from_args(parse(*argv))
