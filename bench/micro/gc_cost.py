"""What a structure costs the cyclic garbage collector: a full collection walks every tracked object, and in the
daemon it runs on the event loop, so its wall time is a stall of every stream (`switchyard_gc_pause_seconds`)."""

from __future__ import annotations

import gc
import statistics
import time


def full_collection_ms(repeats: int = 3) -> float:
    """Median wall time (ms) of a full collection (`gc.collect()`), after one to settle the generations."""
    gc.collect()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)
