"""The stream interval under load: requests that do not choose one get longer chunks while the event loop lags.

Why: relaying a stream costs the router a fixed amount per chunk (one gRPC message in from the worker, one out to
the client: `bench live` measured 9.8 → 3.8 ms of router CPU per 64-token request at 1 → 8 tokens per chunk). When
that work saturates the loop, every request waits for it: TTFT and every chunk's delay grow together. Gathering
tokens at the worker (`stream_interval_tokens`, vLLM's `stream_interval`) cuts the messages without delaying the
first token, and no token is held longer than the worker's hold limit (1 s). So the router raises the interval of
requests that leave it to the router while its loop lags, and lowers it again once the lag is gone. A request that
names its interval keeps it.

The lag is how late a periodic timer fires (`watch_loop_lag`): the time the loop spent on other work before it
could run the timer's callback, which any request's next step waits for too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

LOOP_LAG_PERIOD_S = 0.05  # the probe's timer: 20 samples a second, ~0.25 ms late on an idle loop (uvloop)


class StreamIntervalGovernor:
    """On windows of loop-lag samples: a window whose lag is above the target multiplies the interval by the
    smallest power of two at least lag / target, 2 at least (up to `max_tokens`), so a sudden overload is met in
    one or two windows rather than one doubling per window, each of which lets a backlog build (`bench live`: at
    0.3 cores and 100 req/s, four doublings took 2.2 s and the requests sent meanwhile waited up to 0.75 s);
    `calm_windows` windows in a row below a quarter of the target halve it (down to `base_tokens`);
    in between it holds, so it settles at an interval that keeps the lag under the target instead of swinging
    around it. A window's lag is the mean of its samples less the largest: what a request's next step waits on
    average, where a lone pause (a collection, one long tick) that the loop already recovered from does not count
    but a loop that keeps falling behind, or is throttled every period (a container's CPU limit), does. Pure: time
    comes in with each sample."""

    def __init__(
        self, base_tokens: int, max_tokens: int, target_lag_s: float, window_s: float = 0.5, calm_windows: int = 3
    ) -> None:
        if not 1 <= base_tokens <= max_tokens:
            raise ValueError(f"need 1 <= base_tokens <= max_tokens (got {base_tokens}, {max_tokens})")
        if target_lag_s <= 0 or window_s <= 0 or calm_windows < 1:
            raise ValueError("target_lag_s and window_s must be > 0, calm_windows >= 1")
        self.base_tokens, self.max_tokens = base_tokens, max_tokens
        self.target_lag_s, self.window_s, self.calm_windows = target_lag_s, window_s, calm_windows
        self.interval = base_tokens  # token ids per chunk for a request that does not say
        self.last_lag_s = 0.0  # the last closed window's lag
        self._samples: list[float] = []
        self._window_end: float | None = None
        self._calm = 0

    @property
    def adaptive(self) -> bool:
        return self.max_tokens > self.base_tokens

    def observe(self, lag_s: float, now: float) -> None:
        """One lag sample taken at `now`; a sample past the current window closes it first. A window opens with a
        sample, so none closes empty; after a stall it is judged on what it held, and the stall's own lag comes with
        the sample that opens the next one."""
        if self._window_end is None:
            self._window_end = now + self.window_s
        elif now >= self._window_end:
            self._close_window()
            self._window_end = now + self.window_s
        self._samples.append(lag_s)

    def _close_window(self) -> None:
        samples = self._samples
        lag = (sum(samples) - max(samples)) / (len(samples) - 1) if len(samples) > 1 else samples[0]
        samples.clear()
        self.last_lag_s = lag
        if lag > self.target_lag_s:
            step = 2
            while lag > self.target_lag_s * step and self.interval * step < self.max_tokens:
                step *= 2
            self.interval = min(self.max_tokens, self.interval * step)
            self._calm = 0
        elif lag < self.target_lag_s / 4:
            self._calm += 1
            if self._calm >= self.calm_windows and self.interval > self.base_tokens:
                self.interval = max(self.base_tokens, self.interval // 2)
                self._calm = 0
        else:
            self._calm = 0


async def watch_loop_lag(period_s: float, observe: Callable[[float], None]) -> None:
    """Forever: sleep `period_s` and report how late the loop woke (seconds, >= 0). Run as a task; cancel to stop."""
    while True:
        t0 = time.perf_counter()
        await asyncio.sleep(period_s)
        observe(max(0.0, time.perf_counter() - t0 - period_s))
