"""The cyclic garbage collector as the router lives with it: every pause measured, long ones logged, and the
objects of startup frozen out of later collections.

Why: a collection stops the event loop, so its pause lands on every stream at once. A full collection walks every
tracked object. A prefix-aware policy kept about eleven per radix node (the node, its stats, their deques, dicts
and tuples): `bench decisions` on videoqa (5,000 requests over 100k preloaded nodes, e2, 16 workers) with the
collector on spent 890 ms of 11.4 s in it, and its six full collections paused 110-171 ms. The Cython nodes and
their stats are untracked now (`ext/README.md`); what E2 still adds is its LRU heaps and the tree's gc buckets
(`gc_full_ms_state` in `bench decisions`), and this watch reports whatever else grows.
What startup loads (modules, tokenizers, the predictor) lives as long as the process, so `gc.freeze` takes it
out of every later walk (a started router, no predictor: ~52k objects, ~15 ms of each full collection).
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

from prometheus_client import Histogram

log = logging.getLogger(__name__)


class GcWatch:
    """`start` freezes what is alive and hooks `gc.callbacks`; `stop` unhooks (the frozen objects stay frozen)."""

    def __init__(self, pauses: Histogram, warn_s: float) -> None:
        self._pauses = pauses
        self._warn_s = warn_s  # 0: never warn
        self._t0 = 0.0

    def start(self, freeze: bool) -> None:
        if freeze:
            gc.collect()  # what is garbage now is not frozen
            gc.freeze()
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        pause = time.perf_counter() - self._t0
        generation = info["generation"]
        self._pauses.labels(str(generation)).observe(pause)
        if self._warn_s and pause >= self._warn_s:
            log.warning(
                "garbage collection of generation %d paused the router %.0f ms (%d objects freed)",
                generation, pause * 1e3, info["collected"],
            )
