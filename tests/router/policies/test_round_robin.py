"""round_robin in virtual time: rotation in registration order, skipping unroutable workers, and retry exclusion
that does not advance the cursor twice."""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_fleet, make_requests

from switchyard.router.clock import VirtualClock
from switchyard.router.fleet import WorkerState
from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.round_robin import RoundRobin


def route(policy: RoundRobin, fleet, ctx, clock: VirtualClock) -> str:  # type: ignore[no-untyped-def]
    d = policy.select(ctx, fleet, clock.now())
    assert d is not None
    fleet.note_dispatch(d.worker_id)
    policy.on_dispatch(ctx, d, clock.now())
    return d.worker_id


@pytest.mark.parametrize(
    ("n", "down", "expected"),
    [
        (3, set(), ["w0", "w1", "w2", "w0", "w1", "w2"]),  # plain rotation
        (3, {"w1"}, ["w0", "w2", "w0", "w2", "w0", "w2"]),  # unhealthy w1 skipped
        (1, set(), ["w0"] * 6),
    ],
)
def test_rotation(n: int, down: set[str], expected: list[str]) -> None:
    clock, fleet, rr = VirtualClock(), make_fleet(n), RoundRobin()
    for w in down:
        fleet.set_healthy(WorkerId(w), False)
    got = []
    for ctx in make_requests(6):
        clock.advance_to(ctx.arrival_s)
        got.append(route(rr, fleet, ctx, clock))
    assert got == expected


def test_draining_worker_is_skipped() -> None:
    clock, fleet, rr = VirtualClock(), make_fleet(3), RoundRobin()
    fleet.set_state(WorkerId("w0"), WorkerState.DRAINING)
    assert [route(rr, fleet, c, clock) for c in make_requests(4)] == ["w1", "w2", "w1", "w2"]


def test_retry_excludes_the_failed_worker_without_double_counting() -> None:
    clock, fleet, rr = VirtualClock(), make_fleet(3), RoundRobin()
    r0, r1, r2 = make_requests(3)
    assert route(rr, fleet, r0, clock) == "w0"
    assert route(rr, fleet, r1, clock) == "w1"
    # r2 goes to w2, w2 fails before the first token; the retry excludes w2 and wraps to w0
    assert route(rr, fleet, r2, clock) == "w2"
    fleet.note_done(WorkerId("w2"))
    retry = dataclasses.replace(r2, attempt=1, excluded_workers=frozenset({WorkerId("w2")}))
    assert route(rr, fleet, retry, clock) == "w0"
    # the cursor sits at w0 (the last dispatch), so the rotation continues w1, w2: nobody was skipped twice
    nxt = make_requests(5)[3:]
    assert [route(rr, fleet, c, clock) for c in nxt] == ["w1", "w2"]
    # in_flight: w0 has r0 + the retry, w1 has r1 + r3, w2 has r4 (its failed attempt was released)
    assert [fleet.get(WorkerId(w)).in_flight for w in ("w0", "w1", "w2")] == [2, 2, 1]  # type: ignore[union-attr]


def test_select_alone_does_not_advance() -> None:
    fleet, rr = make_fleet(3), RoundRobin()
    ctx = make_requests(1)[0]
    assert [rr.select(ctx, fleet, 0.0).worker_id for _ in range(3)] == ["w0", "w0", "w0"]  # type: ignore[union-attr]


def test_all_excluded_returns_none() -> None:
    fleet, rr = make_fleet(2), RoundRobin()
    ctx = dataclasses.replace(make_requests(1)[0], attempt=2, excluded_workers=frozenset({WorkerId("w0"), WorkerId("w1")}))
    assert rr.select(ctx, fleet, 0.0) is None
