"""Waiting on a condition another process or task brings about: poll it, fail with what was awaited (never a bare
sleep)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def until(predicate: Callable[[], bool], timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def until_async(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "condition") -> None:
    """`until` on an event loop: state that tasks on the same loop change, with no notification hook."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
