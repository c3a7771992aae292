"""Waiting on a condition another process brings about: poll it, fail with what was awaited (never a bare sleep)."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
