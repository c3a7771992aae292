"""The eviction order of one worker's LRU index: which resident nodes its LRU would evict, in order (Preble §4.2).

Reference build (obviously correct); `_lru_order_c.pyx` is the Cython build, `lru_order.py` the selector. The
index is `router.policies.preble_load.LruIndex`; `EvictionOrder` reads its `heap`, `keyed`, `entries` and `held`
and never writes them. `stats_type` is the class of the per-node statistics whose `hits` (per worker) mark the
nodes M prices (`hot`); passed in, as nothing here imports from `router/`.

`touch_holders` is a dispatch's reconcile of the indexes of a matched path's holders: the index's own
`touch_unmoved` and `touch`, called per (node, worker) here; the Cython build takes `touch_unmoved`'s common exit
in C.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from typing import Any


class EvictionOrder:
    """One LruIndex's eviction order from its current state, simulated step by step as far as `victims` reads,
    so selects between two changes of the index share one simulation (any change drops it).

    `victims` with protected nodes is this order with the protected ones skipped: they are an ancestor-closed
    path, so a protected node's eviction here can only unlock a protected parent, and every other node's
    unlock is the same as in the protected simulation. Each step is (node, its resident blocks, id).

    NOTE: the index's heap array is read in place, in key order: `frontier` holds (key, array position) of the
    positions whose parents were taken, so popping it yields the array's entries in heap-key order while
    touching O(k log k) of them for k taken (the heap property: an entry's key is at most its children's).
    The unlocked parents go to `extra`, a heap of (key, node); each step takes the smaller of the two tops.
    """

    __slots__ = ("idx", "worker", "stats_type", "steps", "array", "frontier", "extra", "unlocked", "done",
                 "local_held", "cum", "pos", "hot", "memo")

    def __init__(self, idx: Any, worker: Any, stats_type: type) -> None:
        self.idx, self.worker, self.stats_type = idx, worker, stats_type
        self.steps: list[tuple[Any, int, int]] = []
        # NOTE: entries with equal (last_access, seq) hold the same node (seq is unique in a tree), so their
        # order among themselves does not matter (`done` skips the second); ties of last_access go by creation
        # order, the same in every run.
        self.array = idx.heap  # read only; the index drops this order before it mutates the array
        self.frontier: list[tuple[float, int, int]] = [(self.array[0][0], self.array[0][1], 0)] if self.array else []
        self.extra: list[tuple[float, int, Any]] = []
        self.unlocked: dict[int, float] = {}  # id -> last_access of a parent this simulation made a candidate
        self.done: set[int] = set()
        self.local_held: dict[int, int] = {}
        self.cum: list[int] = []  # resident blocks of steps[0..i]
        self.pos: dict[int, int] = {}  # id -> its step
        # steps whose node had requests through it on this worker when simulated (the only ones M prices): a
        # node gains one only by a dispatch through it, which touches it and so drops this order
        self.hot: list[int] = []
        # the caller's cache of values derived from these steps (E2 keeps its victims' M terms here): it goes with
        # the order, so anything that changes a step's node drops it too
        self.memo: dict[Any, Any] = {}

    def at(self, i: int) -> tuple[Any, int, int] | None:
        """The i-th node to evict, or None when fewer remain."""
        steps = self.steps
        while len(steps) <= i:
            if not self._step():
                return None
        return steps[i]

    def reach(self, blocks: int) -> bool:
        """Simulate until the steps hold `blocks` resident blocks; False when the candidates ran out first."""
        cum = self.cum
        while not cum or cum[-1] < blocks:
            if not self._step():
                return False
        return True

    def hot_victims(self, need_blocks: int, protected: set[int]) -> list[tuple[Any, int]]:
        """The victims M prices, in victim order: (node, blocks taken) of the `hot` steps among the victims that
        free `need_blocks` with the `protected` ids (ancestor-closed) skipped; the last victim may be a partial
        take. Simulates as far as needed.

        Protected steps keep their blocks, so the order is simulated until the other steps hold `need_blocks`
        (the protected ones found on the way raise the target until no new one turns up), then a bisection on
        the unprotected block counts finds the last victim: O(log n + hot + protected) once simulated, not
        O(victims) (a large prompt can need hundreds of small cold victims).
        """
        steps, cum, pos = self.steps, self.cum, self.pos
        prot_at: list[int] = []
        while True:
            enough = self.reach(need_blocks + sum(steps[i][1] for i in prot_at))
            now_at = sorted(i for k in protected if (i := pos.get(k)) is not None)
            if now_at == prot_at or not enough:
                prot_at = now_at
                break
            prot_at = now_at
        if not steps:
            return []
        prot_cum: list[int] = []  # blocks of the protected steps up to each of them
        for i in prot_at:
            prot_cum.append((prot_cum[-1] if prot_cum else 0) + steps[i][1])

        def unprotected_upto(i: int) -> int:
            j = bisect.bisect_right(prot_at, i)
            return cum[i] - (prot_cum[j - 1] if j else 0)

        # the first step whose unprotected blocks reach need_blocks (never a protected one), else the last
        lo, hi = 0, len(steps) - 1
        if unprotected_upto(hi) >= need_blocks:
            while lo < hi:
                mid = (lo + hi) // 2
                if unprotected_upto(mid) >= need_blocks:
                    hi = mid
                else:
                    lo = mid + 1
        last = hi
        out: list[tuple[Any, int]] = []
        for i in self.hot:
            if i > last:
                break
            n, d, k = steps[i]
            if k in protected:
                continue
            out.append((n, d if i < last else min(d, need_blocks - (unprotected_upto(i - 1) if i else 0))))
        return out

    def price(
        self, need_blocks: int, protected: set[int], cutoff: float, block_size: int, cost: Any, keep: bool = True,
        term: Callable[..., tuple[float | None, float, float, Any]] | None = None,
    ) -> float:
        """M: Σ over `hot_victims`, in victim order, of each victim's term: `term(node, blocks taken, worker,
        cutoff, block_size, cost)`, by default `victim_term` (the "text" term, E2's default, specs/preble.md errata
        E3). With `keep`, each term is kept in `memo` under (id, blocks taken) while the window's start stays
        between the two times it holds for and the cost model is the same object (one whose answers never change:
        the caller's to choose; the memo is not keyed by the term, so one order is priced with one term). The
        same float as pricing every victim afresh."""
        m = 0.0
        memo, worker, stats_type = self.memo, self.worker, self.stats_type
        for n, take in self.hot_victims(need_blocks, protected):
            got = memo.get((id(n), take)) if keep else None
            if got is None or not got[1] <= cutoff <= got[2] or got[3] is not cost:
                if term is None:
                    got = victim_term(n, take, worker, cutoff, block_size, cost, stats_type)
                else:
                    got = term(n, take, worker, cutoff, block_size, cost)
                if keep:
                    memo[(id(n), take)] = got
            if got[0] is not None:
                m = m + got[0]
        return m

    def _step(self) -> bool:
        idx, unlocked, done = self.idx, self.unlocked, self.done
        keyed, entries = idx.keyed, idx.entries
        frontier, extra, array = self.frontier, self.extra, self.array
        size = len(array)
        while True:
            # the next entry in key order: the array's (via the frontier) or an unlocked parent's
            if frontier and (not extra or frontier[0] <= extra[0][:2]):
                pos = heapq.heappop(frontier)[2]
                c = 2 * pos + 1
                if c < size:
                    e = array[c]
                    heapq.heappush(frontier, (e[0], e[1], c))
                    if c + 1 < size:
                        e = array[c + 1]
                        heapq.heappush(frontier, (e[0], e[1], c + 1))
                la, _, n = array[pos]
            elif extra:
                la, _, n = heapq.heappop(extra)
            else:
                return False
            k = id(n)
            if (keyed.get(k) != la and unlocked.get(k) != la) or k in done:
                continue  # stale (the node left the candidates or was accessed since), or seen already
            done.add(k)
            d = n.resident_on(self.worker)
            i = len(self.steps)
            self.steps.append((n, d, k))
            self.cum.append(self.cum[-1] + d if i else d)
            self.pos[k] = i
            st = n.stats
            if isinstance(st, self.stats_type) and st.hits.get(self.worker):
                self.hot.append(i)
            p = entries[k][1]
            if p is not None and id(p) in entries:  # its last resident child gone: the parent is a candidate
                kp = id(p)
                c = self.local_held.get(kp, idx.held.get(kp, 0)) - 1
                self.local_held[kp] = c
                if c == 0:
                    unlocked[kp] = p.last_access
                    heapq.heappush(extra, (p.last_access, p.seq, p))
            return True


def victim_term(
    node: Any, nblocks: int, worker: Any, cutoff: float, block_size: int, cost: Any, stats_type: type
) -> tuple[float | None, float, float, Any]:
    """(victim j's "text" term of M for `nblocks` of its blocks, or None when no request through j on `worker`
    is in the window; the window starts [lo, hi] between which the term holds; the cost model it was priced with).

    PT_j × N_j: recompute the evicted tokens after j's context and kept blocks (`cost.prefill_s`), times the
    requests through j on this worker since `cutoff` (`stats.hits[worker]`: (t, ...) samples in time order; the
    head may hold expired ones). It holds while the window's start stays between `cutoff` and j's first request
    in the window: later ones are counted either way, earlier ones neither.
    """
    st = node.stats
    dq = st.hits.get(worker) if isinstance(st, stats_type) else None
    if not dq:
        return None, cutoff, math.inf, cost
    count = len(dq)
    for t, _ in dq:
        if t >= cutoff:
            break
        count -= 1
    if not count:
        return None, cutoff, math.inf, cost
    keep = node.resident_on(worker) - nblocks
    term = cost.prefill_s(nblocks * block_size, (node.context_blocks + keep) * block_size) * count
    return term, cutoff, dq[len(dq) - count][0], cost


def touch_holders(lru: dict[Any, Any], nodes: list[Any]) -> None:
    """Reconcile, for each node of `nodes` whose residency and parent did not change, the LRU index (`lru[w]`) of
    every worker w it is resident on: `idx.touch_unmoved(node, id(node), node.parent)` where it is resident and
    attached, else (or when that answers False) `idx.touch(w, node, node.resident)`. Only last_access moved,
    so only those indexes can hold the nodes (`PrebleE2._touch_holders`)."""
    for node in nodes:
        res = node.resident
        if not res:
            continue
        k, parent, attached = id(node), node.parent, node.is_attached
        for w, run in res.items():
            idx = lru.get(w)
            if idx is not None and not (run > 0 and attached and idx.touch_unmoved(node, k, parent)):
                idx.touch(w, node, res)
