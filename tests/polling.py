"""Waiting on a condition another process or task brings about: poll it, fail with what was awaited (never a bare
sleep)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def until(
    predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """The predicate's first truthy value; an exception of a type in `ignore` (a server not up yet) counts as
    falsy."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except ignore:
            value = None  # type: ignore[assignment]
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def until_async(
    predicate: Callable[[], T | Awaitable[T]], timeout_s: float = 5.0, what: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """`until` on an event loop: state that tasks on the same loop or another process change, with no
    notification hook. An async predicate (an RPC, or a resend before each look) is awaited."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
        except ignore:
            value = None
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)
