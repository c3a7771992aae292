"""Policy name -> constructor. A policy's registry key matches its file name."""

from __future__ import annotations

from collections.abc import Callable

from switchyard.router.policies.base import Policy
from switchyard.router.policies.least_request import LeastRequest
from switchyard.router.policies.power_of_two import PowerOfTwo
from switchyard.router.policies.round_robin import RoundRobin

POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_request": LeastRequest,
    "power_of_two": PowerOfTwo,
}

DEFAULT_POLICY = "least_request"


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
