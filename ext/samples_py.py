"""E2's per-node stats and their samples, which the Cython build keeps out of the cyclic garbage collector's sight.

`Samples`: time-ordered (t, value) samples in a sliding window (`NodeStats.hits`, `NodeStats.ttft`). The reference
is a `deque` of (t, value) tuples with the window queries every reader shares; `_samples_c.Samples` is the same
over a C ring of doubles, invisible to the collector (a 100k-node tree carried ~100k of these deques, and every full
collection walked them on the daemon's event loop).

The contract: `append((t, value))` with t non-decreasing, `popleft()`, `clear()`, `len()`, truth, indexing (also
negative) and iteration yielding (t, value) tuples as a deque does; and
- `trim(cutoff)`: drop the samples before cutoff from the head (the oldest first);
- `since(cutoff)`: (count of samples with t >= cutoff, t of the first of them or inf), walking the head only;
- `total_since(cutoff)`: (that count, Σ value over them), as `sum(all) - sum(head)`, in that order of additions.

`RecentMedian(capacity)`: the last `capacity` integers added and their median (`NodeStats`'s output lengths): `add`,
`median()` (None while empty; `statistics.median`'s value: the middle int, or the mean of the two middle ones),
`len()` and iteration (oldest first).

`NodeStats`: E2's slot on a radix node (`node.stats`), which holds them; its fields and methods below. In the
Cython build it is invisible to the collector too, so a node's stats add nothing to a full collection. What it
holds must therefore never refer back to it, to nodes or to trees (worker names, numbers and the types above).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from functools import partial


class Samples(deque):  # type: ignore[type-arg]
    """See the module docstring."""

    __slots__ = ()

    def trim(self, cutoff: float) -> None:
        while self and self[0][0] < cutoff:
            self.popleft()

    def since(self, cutoff: float) -> tuple[int, float]:
        n = len(self)
        for t, _ in self:
            if t >= cutoff:
                return n, t
            n -= 1
        return 0, math.inf

    def total_since(self, cutoff: float) -> tuple[int, float]:
        n, skipped = len(self), 0.0
        for t, v in self:
            if t >= cutoff:
                break
            n -= 1
            skipped += v
        return n, (sum(v for _, v in self) - skipped) if n else 0.0


class RecentMedian:
    """See the module docstring: the values in arrival order and sorted, so `median` is a lookup (a hot key node
    gets a finish between most of its dispatches, and sorting its 64 values at each was ~8% of a dispatch)."""

    __slots__ = ("_recent", "_sorted", "_median")

    def __init__(self, capacity: int) -> None:
        self._recent: deque[int] = deque((), capacity)
        self._sorted: list[int] = []
        self._median: float | None = None  # kept until the next add

    def add(self, value: int) -> None:
        recent, srt = self._recent, self._sorted
        if len(recent) == recent.maxlen:
            del srt[bisect.bisect_left(srt, recent[0])]  # the deque is about to drop its oldest
        recent.append(value)
        bisect.insort(srt, value)
        self._median = None

    def median(self) -> float | None:
        srt = self._sorted
        if self._median is None and srt:
            i = len(srt) // 2
            self._median = srt[i] if len(srt) % 2 else (srt[i - 1] + srt[i]) / 2  # statistics.median's formula
        return self._median

    def __len__(self) -> int:
        return len(self._recent)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self._recent)


DECODE_SAMPLES = 64  # output lengths a key node keeps for its median (the most recent)


@dataclass(slots=True)
class NodeStats:
    """The policy's slot on a radix node (`node.stats`): see the module docstring."""

    # per worker: (dispatch t, that request's PT on the worker) for requests through this node in W
    # (N_j of the text's M formula, and Alg 2's Σ PREFILLTIME(missed of l) for eviction_cost="alg2")
    hits: dict[str, Samples] = field(default_factory=dict)
    # observed output lengths of requests whose key portion is this node (the last DECODE_SAMPLES; median -> decode)
    decode_tokens: RecentMedian = field(default_factory=partial(RecentMedian, DECODE_SAMPLES))  # no kwargs per node
    # per worker: (first-token t, TTFT s) of requests keyed here, for the queueing-doubling detector (§5.5)
    ttft: dict[str, Samples] = field(default_factory=dict)
    redirect: dict[str, tuple[str, float]] = field(default_factory=dict)  # heavy -> (light, until_s) (§5.4)
    replicas: dict[str, float] = field(default_factory=dict)  # extra worker -> until_s (§5.5)

    def add_hit(self, worker: str, now: float, prefill_s: float, window_s: float) -> None:
        dq = self.hits.get(worker)
        if dq is None:
            dq = self.hits[worker] = Samples()
        dq.append((now, prefill_s))
        dq.trim(now - window_s)

    def add_decode(self, num_tokens: int) -> None:
        self.decode_tokens.add(num_tokens)

    def median_decode(self) -> float | None:
        """`statistics.median(decode_tokens)`, kept until the next `add_decode` (read per dispatch)."""
        return self.decode_tokens.median()
