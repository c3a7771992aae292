"""least_request in virtual time: fewest router in-flight requests, ties by Stats load, then registration order."""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_fleet, make_requests, make_stats

from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.least_request import LeastRequest


@pytest.mark.parametrize(
    ("in_flight", "stats_load", "expected"),
    [
        ([0, 0, 0], [(0, 0), (0, 0), (0, 0)], "w0"),  # all equal: registration order
        ([2, 1, 3], [(0, 0), (0, 0), (0, 0)], "w1"),  # fewest in flight
        ([1, 1, 2], [(3, 1), (1, 0), (0, 0)], "w1"),  # tie at 1: running+waiting 4 vs 1 -> w1
        ([1, 1, 0], [(0, 0), (0, 0), (9, 9)], "w2"),  # in_flight first: stale stats do not outweigh it
    ],
)
def test_select(in_flight: list[int], stats_load: list[tuple[int, int]], expected: str) -> None:
    fleet = make_fleet(3)
    for i, (n, (running, waiting)) in enumerate(zip(in_flight, stats_load, strict=True)):
        wid = WorkerId(f"w{i}")
        fleet.apply_stats(wid, make_stats(num_running=running, num_waiting=waiting), now=0.0)
        for _ in range(n):
            fleet.note_dispatch(wid)
    d = LeastRequest().select(make_requests(1)[0], fleet, 0.0)
    assert d is not None and d.worker_id == expected


def test_spreads_a_burst_evenly_and_respects_exclusion() -> None:
    fleet, policy = make_fleet(3), LeastRequest()
    got = []
    for ctx in make_requests(6):
        d = policy.select(ctx, fleet, 0.0)
        assert d is not None
        fleet.note_dispatch(d.worker_id)
        got.append(d.worker_id)
    assert got == ["w0", "w1", "w2", "w0", "w1", "w2"]
    retry = dataclasses.replace(make_requests(1)[0], attempt=1, excluded_workers=frozenset({WorkerId("w0")}))
    assert policy.select(retry, fleet, 0.0).worker_id == "w1"  # type: ignore[union-attr]
