"""How the router packs queued requests into Session messages (`router/worker_session.frame_length`)."""

from __future__ import annotations

import pytest

from switchyard.router.worker_session import frame_length


@pytest.mark.parametrize(
    ("sizes", "budget", "expected"),
    [
        ([], 100, 0),
        ([10, 20, 30], 100, 3),  # all fit
        ([40, 60, 1], 100, 2),  # exactly the budget
        ([40, 61, 1], 100, 1),  # the next one would pass it: it waits for the next message
        ([150, 1], 100, 1),  # one request over the budget still goes (alone)
    ],
)
def test_a_message_takes_what_fits_in_its_budget_and_at_least_one(sizes: list[int], budget: int, expected: int) -> None:
    assert frame_length(sizes, budget) == expected
