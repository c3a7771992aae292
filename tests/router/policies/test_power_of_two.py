"""power_of_two: deterministic given (seed, request id, attempt); picks the less loaded of the drawn pair."""

from __future__ import annotations

import dataclasses

from factories import make_fleet, make_requests, make_stats

from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.power_of_two import PowerOfTwo


def test_same_request_same_choice_across_instances() -> None:
    fleet = make_fleet(8)
    ctxs = make_requests(20)
    a = [PowerOfTwo(seed=7).select(c, fleet, 0.0).worker_id for c in ctxs]  # type: ignore[union-attr]
    b = [PowerOfTwo(seed=7).select(c, fleet, 0.0).worker_id for c in ctxs]  # type: ignore[union-attr]
    assert a == b
    assert len(set(a)) > 1  # different request ids draw different pairs


def test_pair_is_two_distinct_workers_and_less_loaded_wins() -> None:
    fleet = make_fleet(4)
    p = PowerOfTwo(seed=0)
    ctx = make_requests(1)[0]
    i, j = p._draw(ctx, 4)
    assert i != j
    a, b = WorkerId(f"w{i}"), WorkerId(f"w{j}")
    # load = in_flight + num_waiting: a gets 2 in flight, b gets 1 waiting -> b (1 < 2)
    fleet.note_dispatch(a)
    fleet.note_dispatch(a)
    fleet.apply_stats(b, make_stats(num_waiting=1), now=0.0)
    assert p.select(ctx, fleet, 0.0).worker_id == b  # type: ignore[union-attr]
    # tie (2 vs 2) goes to the first drawn
    fleet.apply_stats(b, make_stats(num_waiting=2), now=0.0)
    assert p.select(ctx, fleet, 0.0).worker_id == a  # type: ignore[union-attr]


def test_retry_draws_again_and_excludes() -> None:
    fleet, p = make_fleet(2), PowerOfTwo(seed=3)
    ctx = make_requests(1)[0]
    first = p.select(ctx, fleet, 0.0).worker_id  # type: ignore[union-attr]
    retry = dataclasses.replace(ctx, attempt=1, excluded_workers=frozenset({first}))
    d = p.select(retry, fleet, 0.0)
    assert d is not None and d.worker_id != first and d.reason == "only candidate"
