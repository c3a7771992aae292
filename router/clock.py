"""Injected clocks: policies and queues read time only through these, so they run live and in virtual time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class RealClock:
    """Monotonic seconds (time.monotonic)."""

    def now(self) -> float:
        return time.monotonic()


class VirtualClock:
    """Simulation time, advanced by the discrete-event loop."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s

    def now(self) -> float:
        return self._now

    def advance_to(self, t_s: float) -> None:
        if t_s < self._now:
            raise ValueError(f"virtual time cannot go back: {t_s} < {self._now}")
        self._now = t_s
