"""The router's request queue: bounded, per-model, ordered by a small pure key, released by a hold condition.

Late binding: a request waits here only while its model's hold condition is true (every eligible worker is
saturated), and is bound to a worker when it leaves. The hold condition is a pure function of the fleet view,
re-evaluated by the dispatcher on stats updates, finishes and ticks. No asyncio here: entries carry an opaque
payload (the dispatcher's waiter), so the queue is tested as plain data.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from switchyard.router.policies.base import WorkerView


@dataclass(eq=False, slots=True)
class QueueEntry:
    """One waiting request. Identity-compared: the same request is never queued twice."""

    request_id: str
    model: str
    arrival_s: float  # router clock
    priority: int = 0  # from the request (reserved for ordering policies; FCFS ignores it)
    payload: Any = None  # the dispatcher's waiter; opaque here
    seq: int = 0  # set by the queue: push order, the final tie-break
    removed: bool = False  # lazily deleted from the heap (cancellation is O(1))


class QueueOrder(Protocol):
    """The ordering interface: a sort key per entry, smallest released first. Later: SLO classes, app priority."""

    def key(self, entry: QueueEntry) -> tuple[Any, ...]: ...


class Fcfs:
    """First come, first served by router arrival time (then push order)."""

    def key(self, entry: QueueEntry) -> tuple[Any, ...]:
        return (entry.arrival_s,)


class QueueFull(Exception):
    def __init__(self, max_size: int) -> None:
        super().__init__(f"router queue is full ({max_size} requests waiting)")
        self.max_size = max_size


# ---------------------------------------------------------------------- hold condition
def is_saturated(worker: WorkerView, kv_usage_hold_frac: float) -> bool:
    """A new request sent to `worker` now would wait there: it reports waiting requests, the router replicas'
    requests already fill its batch (in_flight + peer_in_flight >= max_num_seqs: known before the next Stats), or
    its KV cache is nearly full."""
    return (
        worker.num_waiting > 0
        or worker.in_flight + worker.peer_in_flight >= worker.max_num_seqs
        or worker.kv_usage_frac >= kv_usage_hold_frac
    )


def should_hold(eligible: Sequence[WorkerView], kv_usage_hold_frac: float = 0.95) -> bool:
    """Hold while every eligible worker is saturated. With no eligible worker nothing is held: the request is
    released and fails fast with UNAVAILABLE rather than waiting for a worker that may never come."""
    return bool(eligible) and all(is_saturated(w, kv_usage_hold_frac) for w in eligible)


HoldCondition = Callable[[Sequence[WorkerView]], bool]


# ---------------------------------------------------------------------- queue
@dataclass(slots=True)
class _ModelQueue:
    heap: list[tuple[tuple[Any, ...], int, QueueEntry]] = field(default_factory=list)
    size: int = 0  # live (not removed) entries


class RequestQueue:
    """Per-model heaps under one global bound. Per model, not global, so a saturated model does not block
    another model's requests (no head-of-line blocking across models)."""

    def __init__(self, max_size: int, order: QueueOrder | None = None) -> None:
        self.max_size = max_size
        self._order = order or Fcfs()
        self._models: dict[str, _ModelQueue] = {}
        self._size = 0
        self._seq = itertools.count(1)

    def __len__(self) -> int:
        return self._size

    def size(self, model: str) -> int:
        q = self._models.get(model)
        return q.size if q else 0

    def models(self) -> list[str]:
        """Models with at least one waiting request."""
        return [m for m, q in self._models.items() if q.size]

    def push(self, entry: QueueEntry) -> None:
        """Raises QueueFull when `max_size` requests already wait."""
        if self._size >= self.max_size:
            raise QueueFull(self.max_size)
        entry.seq = next(self._seq)
        entry.removed = False
        q = self._models.setdefault(entry.model, _ModelQueue())
        heapq.heappush(q.heap, (self._order.key(entry), entry.seq, entry))
        q.size += 1
        self._size += 1

    def peek(self, model: str) -> QueueEntry | None:
        q = self._models.get(model)
        if q is None:
            return None
        while q.heap and q.heap[0][2].removed:
            heapq.heappop(q.heap)
        return q.heap[0][2] if q.heap else None

    def pop(self, model: str) -> QueueEntry | None:
        entry = self.peek(model)
        if entry is None:
            return None
        q = self._models[model]
        heapq.heappop(q.heap)
        entry.removed = True
        q.size -= 1
        self._size -= 1
        if not q.size:
            del self._models[model]
        return entry

    def remove(self, entry: QueueEntry) -> bool:
        """Cancel a waiting request; False if it already left the queue. O(1): the heap slot is skipped later."""
        q = self._models.get(entry.model)
        if entry.removed or q is None or entry.seq == 0:
            return False
        entry.removed = True
        q.size -= 1
        self._size -= 1
        if not q.size:
            del self._models[entry.model]
        return True

    def release(self, model: str, eligible: Sequence[WorkerView], hold: HoldCondition) -> QueueEntry | None:
        """Pop the head of `model`'s queue unless `hold(eligible)`; the caller binds it before asking again
        (binding changes in_flight, which the next evaluation must see)."""
        if not self.size(model) or hold(eligible):
            return None
        return self.pop(model)
