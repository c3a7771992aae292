"""Preble E2's windowed bookkeeping (specs/preble.md §4.1, §5.2-5.5): per-worker load history with an
incrementally maintained L, the windowed hit ratio behind DECODERATIO, per-node statistics, the queueing-time
doubling detector, and the simulated LRU eviction behind M. Plain data; `preble_e2` owns the instances.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from switchyard.ext.e2_select import decode_marginal
from switchyard.ext.lru_order import EvictionOrder, LruIndexCore
from switchyard.ext.lru_order_py import victim_term
from switchyard.ext.samples import NodeStats, Samples
from switchyard.router.policies.preble_cost import CostModel, ProfileCost


# ---------------------------------------------------------------------------------------------- L_i (history H)
@dataclass(slots=True)
class HistoryEntry:
    t: float  # dispatch time, s
    request_id: str
    prefill_s: float  # PT_r: PREFILLTIME of r's uncached tokens on this worker at its scheduling time
    prompt_tokens: int
    decode_tokens: int  # predicted at dispatch, replaced by the observed output length on finish
    block_hashes: tuple[int, ...] = ()  # r's prompt (its key node is resolved when needed: splits move it)
    key_memo: Any = None  # `PrebleE2.key_of_record`'s: the key node and the path it was found on


class WorkerHistory:
    """The last requests routed to one worker within H, and L_i = Σ_{r∈H} (PT_r + DT_r) kept incrementally.

    DT_r = DECODETIME(average decode length in H, average context in H), the same for every r (§5.2: "using the
    average request decoding time observed on GPU_i in window H"), so
        L_i = Σ PT_r + |H| × DECODETIME(Σdec/|H|, Σprompt/|H| + Σdec/(2|H|))        [seconds]
    and only the three sums and the count are maintained: O(1) per dispatch, finish and expiry. H is a
    duration (`window_s`) and optionally also a count (`max_requests`, errata E2).

    `on_change`, when set, is called at every change of the entries: the caller drops its memo of L
    (`PrebleE2.load_s`) then, so reading the memo costs one lookup, not a comparison of versions.
    """

    def __init__(self, window_s: float, max_requests: int | None = None) -> None:
        self.window_s = window_s
        self.max_requests = max_requests
        self.entries: deque[HistoryEntry] = deque()
        self.by_id: dict[str, HistoryEntry] = {}
        self.sum_prefill_s = 0.0
        self.sum_prompt_tokens = 0
        self.sum_decode_tokens = 0
        self.on_change: Callable[[], None] | None = None  # called at every change of the entries

    def add(self, e: HistoryEntry) -> None:
        if self.on_change is not None:
            self.on_change()
        self.entries.append(e)
        self.by_id[e.request_id] = e  # a retry on the same worker replaces the lookup (both entries count)
        self.sum_prefill_s += e.prefill_s
        self.sum_prompt_tokens += e.prompt_tokens
        self.sum_decode_tokens += e.decode_tokens
        if self.max_requests is not None:
            while len(self.entries) > self.max_requests:
                self._pop()
        self.expire(e.t)

    def set_decode(self, request_id: str, decode_tokens: int) -> None:
        e = self.by_id.get(request_id)
        if e is not None:
            if self.on_change is not None:
                self.on_change()
            self.sum_decode_tokens += decode_tokens - e.decode_tokens
            e.decode_tokens = decode_tokens

    def _pop(self) -> None:
        if self.on_change is not None:
            self.on_change()
        e = self.entries.popleft()
        if self.by_id.get(e.request_id) is e:
            del self.by_id[e.request_id]
        if not self.entries:  # NOTE: reset exactly, so float drift never outlives an empty window
            self.sum_prefill_s, self.sum_prompt_tokens, self.sum_decode_tokens = 0.0, 0, 0
        else:
            self.sum_prefill_s -= e.prefill_s
            self.sum_prompt_tokens -= e.prompt_tokens
            self.sum_decode_tokens -= e.decode_tokens

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s
        while self.entries and self.entries[0].t < cutoff:
            self._pop()

    def live_sums(self, now: float) -> tuple[int, float, int, int]:
        """(count, Σ PT_r, Σ prompt, Σ decode) over entries within H at `now`, without mutating (select is pure)."""
        n, pre, prompt, dec = len(self.entries), self.sum_prefill_s, self.sum_prompt_tokens, self.sum_decode_tokens
        cutoff = now - self.window_s
        for e in self.entries:  # only the not-yet-expired head is walked (on_tick expires the rest)
            if e.t >= cutoff:
                break
            n, pre, prompt, dec = n - 1, pre - e.prefill_s, prompt - e.prompt_tokens, dec - e.decode_tokens
        return n, pre, prompt, dec

    def load_s(self, now: float, cost: CostModel, marginal: bool = False) -> float:
        return load_from_sums(*self.live_sums(now), cost, marginal)

    def load_pieces(
        self, now: float, cost: CostModel, marginal: bool = False, k: int = 1, cuts: Sequence[float] = ()
    ) -> list[tuple[float, float]]:
        """L's history part now and after each of the next expiries, at most k pieces: [(t_j, L_j)], L_j holding
        while the window's start is at or before t_j (and after t_{j-1}), t_j the oldest dispatch time still in
        the window then, or an earlier time of `cuts` (ascending, all at or after now - H: the caller's other
        breakpoints), inf when neither is left (the last piece). L_0 = `load_s(now)`. Each piece's sums
        subtract the expired head in order, as `live_sums` does at any time in that piece, so L_j is the float
        `load_s` gives there (`PrebleE2.load_s` memoises the pieces, so selects between hooks read L as entries
        expire)."""
        n, pre, prompt, dec = len(self.entries), self.sum_prefill_s, self.sum_prompt_tokens, self.sum_decode_tokens
        cutoff = now - self.window_s
        if k == 1 and not cuts and (not n or self.entries[0].t >= cutoff):
            # every dispatch asks this right after `add` expired the head: nothing to walk, the same piece
            return [(self.entries[0].t if n else math.inf, load_from_sums(n, pre, prompt, dec, cost, marginal))]
        it = iter(self.entries)
        e = next(it, None)
        while e is not None and e.t < cutoff:  # as live_sums
            n, pre, prompt, dec = n - 1, pre - e.prefill_s, prompt - e.prompt_tokens, dec - e.decode_tokens
            e = next(it, None)
        cut_it = iter(cuts)
        c = next(cut_it, math.inf)
        out: list[tuple[float, float]] = []
        while True:
            first = min(e.t if e is not None else math.inf, c)
            out.append((first, load_from_sums(n, pre, prompt, dec, cost, marginal)))
            if first == math.inf or len(out) >= k:
                return out
            while e is not None and e.t <= first:  # the entries dispatched at `first` leave together
                n, pre, prompt, dec = n - 1, pre - e.prefill_s, prompt - e.prompt_tokens, dec - e.decode_tokens
                e = next(it, None)
            while c <= first:
                c = next(cut_it, math.inf)

    def decode_time_s(self, now: float, cost: CostModel, marginal: bool = False) -> float:
        """DT for one request on this worker (the same for every r in H)."""
        n, _, prompt, dec = self.live_sums(now)
        if n <= 0:
            return 0.0
        f = cost.decode_marginal_s if marginal else cost.decode_s
        return f(dec / n, prompt / n + dec / (2 * n))


def load_from_sums(
    n: int, sum_prefill_s: float, sum_prompt: int, sum_decode: int, cost: CostModel, marginal: bool = False
) -> float:
    """Σ PT + n × DT; DT single-request (Alg 2) or, with `marginal`, the batched increment (`decode_marginal_s`,
    priced in C for `ProfileCost`: every dispatch, finish and tick reprices its worker's L)."""
    if n <= 0:
        return 0.0
    tokens, context = sum_decode / n, sum_prompt / n + sum_decode / (2 * n)
    dt = decode_marginal(cost, tokens, context) if marginal else cost.decode_s(tokens, context)
    return max(0.0, sum_prefill_s) + n * dt


class MovedLoad:
    """Load that rebalancing and replication moved within H (§5.4-5.5), per worker: (t, Δ s), + onto the worker,
    − off it. Kept per worker (not one shared list) so that L_i reads only worker i's moves: every LOADCOST reads
    it, and a busy fleet holds hundreds of moves in H.

    NOTE: each worker's last sum is kept with the cutoffs it holds for (moves are made in time order, so those
    since a cutoff are a suffix; the sum stands while the cutoff stays between the one it was taken at and the
    suffix's first move) until a move of that worker is added, expired or dropped. Exact: the same moves in the
    same order. `on_change(worker)`, when set, is called at every change of that worker's moves only, so a
    move onto one worker leaves the other workers' memos of L (`PrebleE2.load_s`) standing.
    """

    __slots__ = ("by_worker", "memo", "on_change", "unordered")

    def __init__(self) -> None:
        self.on_change: Callable[[str], None] | None = None  # called with the worker at every change of its moves
        self.by_worker: dict[str, deque[tuple[float, float]]] = {}
        self.memo: dict[str, tuple[float, float, float]] = {}  # worker -> (cutoff, first move counted t, Σ)
        self.unordered: set[str] = set()  # workers given a move older than their last (never memoised)

    def _changed(self, worker: str) -> None:
        self.memo.pop(worker, None)
        if self.on_change is not None:
            self.on_change(worker)

    def add(self, now: float, worker: str, delta_s: float) -> None:
        self._changed(worker)
        dq = self.by_worker.get(worker)
        if dq is None:
            dq = self.by_worker[worker] = deque()
        elif now < dq[-1][0]:
            self.unordered.add(worker)
        dq.append((now, delta_s))

    def sum_s(self, worker: str, cutoff: float) -> float:
        """Σ Δ s moved onto the worker since `cutoff` (0 when none), summed in the order the moves were made."""
        dq = self.by_worker.get(worker)
        if not dq:
            return 0
        m = self.memo.get(worker)
        if m is not None and m[0] <= cutoff <= m[1]:
            return m[2]
        total = sum(d for t, d in dq if t >= cutoff)
        if worker not in self.unordered:
            first = next((t for t, _ in dq if t >= cutoff), math.inf)
            self.memo[worker] = (cutoff, first, total)
        return total

    def first_t(self, worker: str, cutoff: float) -> float:
        """Time of the worker's oldest move at or after `cutoff` (inf when none)."""
        dq = self.by_worker.get(worker)
        if not dq:
            return math.inf
        m = self.memo.get(worker)  # `sum_s`'s: no move lies in [m[0], m[1]), m[1] the first at or after m[0]
        if m is not None and m[0] <= cutoff <= m[1]:
            return m[1]
        if worker in self.unordered:
            return min((t for t, _ in dq if t >= cutoff), default=math.inf)
        return next((t for t, _ in dq if t >= cutoff), math.inf)  # in time order: the first one past the cutoff

    def expire(self, cutoff: float) -> None:
        for w, dq in list(self.by_worker.items()):
            if dq and dq[0][0] < cutoff:
                self._changed(w)
                while dq and dq[0][0] < cutoff:
                    dq.popleft()
            if not dq:
                del self.by_worker[w]
                self.unordered.discard(w)

    def drop(self, worker: str) -> None:
        self._changed(worker)
        self.by_worker.pop(worker, None)
        self.unordered.discard(worker)


# ---------------------------------------------------------------------------------------------- DECODERATIO
class HitRatioWindow:
    """Windowed prefix hit ratio of one worker: Σ hit tokens / Σ prompt tokens over dispatches in the last
    `window_s` (the code's `hit_trace_window_size` = 30 s, errata E9). Hits are the router's estimate at dispatch."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()
        self.hit = 0
        self.total = 0

    def add(self, now: float, hit_tokens: int, prompt_tokens: int) -> None:
        self.samples.append((now, hit_tokens, prompt_tokens))
        self.hit += hit_tokens
        self.total += prompt_tokens
        self.expire(now)

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s
        while self.samples and self.samples[0][0] < cutoff:
            _, h, p = self.samples.popleft()
            self.hit -= h
            self.total -= p

    def ratio(self, now: float) -> float:
        hit, total, cutoff = self.hit, self.total, now - self.window_s
        for t, h, p in self.samples:
            if t >= cutoff:
                break
            hit, total = hit - h, total - p
        return hit / total if total > 0 else 0.0


# ---------------------------------------------------------------------------------------------- per-node stats
def merged_stats(children: Iterable[Any]) -> NodeStats:
    """Stats for a node that a split created: every request through a child also went through it."""
    out = NodeStats()
    for child in children:
        st = child.stats
        if not isinstance(st, NodeStats):
            continue
        for w, dq in st.hits.items():
            cur = out.hits.get(w)
            out.hits[w] = Samples(heapq.merge(cur, dq)) if cur else Samples(dq)
    return out


def is_overloaded(samples: Samples, now: float, window_s: float, factor: float) -> bool:
    """Queueing time doubles over H: mean TTFT in the window's second half >= factor × the first half's
    (the code's TTFTWindowedOverloadedDetector); False when either half is empty."""
    start, mid = now - window_s, now - window_s / 2
    first = [v for t, v in samples if start <= t < mid]
    second = [v for t, v in samples if t >= mid]
    if not first or not second:
        return False
    return sum(second) / len(second) >= factor * (sum(first) / len(first))


# ---------------------------------------------------------------------------------------------- simulated LRU
def lru_victims(
    worker: str,
    nodes: Iterable[Any],
    need_blocks: int,
    protected: set[int],
) -> list[tuple[Any, int]]:
    """Which (node, blocks) the worker's LRU would evict to free `need_blocks` (§4.2 "simulated LRU eviction").

    Candidates are the worker's resident nodes not on the request's own path (`protected`, by id), leaves
    first (a node becomes a candidate once none of its children holds the worker), oldest `last_access` first;
    a node's tail blocks go first, so a partial take is allowed. Read-only. O(R log R), R = resident nodes.
    """
    resident: dict[int, Any] = {}
    seen: set[int] = set()
    for n in nodes:  # the set holds the deepest stored nodes; their ancestors (split-off parents too) walk up
        while n is not None and id(n) not in seen:
            seen.add(id(n))
            if n.resident.get(worker, 0) > 0:
                resident[id(n)] = n
            n = n.parent
    held_children: dict[int, int] = {}
    for n in resident.values():
        p = n.parent
        if p is not None and id(p) in resident:
            held_children[id(p)] = held_children.get(id(p), 0) + 1
    # ties of last_access break by the node's creation order (`seq`), never by id (a memory address)
    heap = [(n.last_access, n.seq, n) for k, n in resident.items() if not held_children.get(k)]
    heapq.heapify(heap)
    out: list[tuple[Any, int]] = []
    left = need_blocks
    while heap and left > 0:
        _, _, n = heapq.heappop(heap)
        k = id(n)
        if k in protected:
            continue  # about to be reused by this request: never a victim, and its ancestors neither
        take = min(n.resident[worker], left)
        out.append((n, take))
        left -= take
        p = n.parent
        if take == n.resident[worker] and p is not None and id(p) in resident:
            held_children[id(p)] -= 1
            if held_children[id(p)] == 0:
                heapq.heappush(heap, (p.last_access, p.seq, p))
    return out


def eviction_cost_s(
    victims: list[tuple[Any, int]],
    worker: str,
    now: float,
    window_s: float,
    block_size: int,
    cost: CostModel,
    mode: str,
) -> float:
    """M_i over the victims. "text": Σ_j PT_j × N_j (recompute the evicted tokens of j after its context,
    times the requests through j on this worker in W); "alg2": Σ_j Σ_{l through j in W} PREFILLTIME(missed_l)."""
    m = 0.0
    cutoff = now - window_s
    for node, nblocks in victims:
        term = _victim_term(node, nblocks, worker, cutoff, block_size, cost, mode)[0]
        if term is not None:
            m = m + term
    return m


def _victim_term(
    node: Any, nblocks: int, worker: Any, cutoff: float, block_size: int, cost: CostModel, mode: str,
) -> tuple[float | None, float, float, CostModel]:
    """(victim j's term of M for `nblocks` of its blocks, or None when no request through j on `worker` is in W;
    the window starts [lo, hi] between which the term holds; the cost model it was priced with).

    "text": PT_j × N_j (recompute the evicted tokens after j's context and kept blocks, times the requests through
    j on this worker in W); "alg2": Σ PREFILLTIME(missed_l) over those requests. The term holds while the
    window's start stays between `cutoff` and j's first request in W: later ones are counted either way, earlier
    ones neither (`LruIndex.eviction_cost`'s memo; a request through j adds a sample only by a dispatch through
    j, which drops the order and its memo with it).
    """
    if mode != "alg2":
        return victim_term(node, nblocks, worker, cutoff, block_size, cost, NodeStats)
    return _alg2_term(node, nblocks, worker, cutoff, block_size, cost)


def _alg2_term(
    node: Any, nblocks: int, worker: Any, cutoff: float, block_size: int, cost: CostModel,
) -> tuple[float | None, float, float, CostModel]:
    """`_victim_term`'s "alg2" term: Σ PREFILLTIME(missed_l) over the requests through j on `worker` in W."""
    st = node.stats
    dq = st.hits.get(worker) if isinstance(st, NodeStats) else None
    if not dq:
        return None, cutoff, math.inf, cost
    count, term = dq.total_since(cutoff)
    if not count:
        return None, cutoff, math.inf, cost
    return term, cutoff, dq.since(cutoff)[1], cost


# ---------------------------------------------------------------------------------------------- incremental LRU
class LruPricing:
    """What M reads from an LRU index (`LruIndexCore`): `victims` and `eviction_cost`.

    `victims` is read-only: it reads the eviction order (`switchyard.ext.lru_order`), which walks the heap's array in key
    order without copying it (a small frontier heap of array positions; a full copy was O(N), ~100 µs at the
    100k-node preload) and merges in the parents the simulated evictions unlock, so it visits
    O(k + protected + stale) entries for k victims, and returns exactly what `lru_victims` returns over the same
    resident set. The order is kept across the changes that leave its steps as they are or change them in a
    known way (`EvictionOrder`'s docstring lists them: nodes stored or accessed now, the worker evicting the
    first victim, the heap moving under it), and dropped by any other (`touch`, `touch_unmoved`, `_consider`
    ask it), so the selects between two dispatches to a worker share one simulation while its KV events come
    in (on full-size video QA, fresh simulations went from 9,400 to 1,500 of 30,900 Ms).
    Protected nodes (the request's own path, which is ancestor-closed) are skipped; their ancestors are protected
    too, so nothing they would unlock counts. The hooks keep the heap's top live (`_prune`), so few stale entries
    precede the victims.
    """

    __slots__ = ()

    def victims(self, worker: Any, need_blocks: int, protected: set[int]) -> list[tuple[Any, int]]:
        out: list[tuple[Any, int]] = []
        left = need_blocks
        if not self.heap or left <= 0:
            return out
        order = self.order(worker)
        i = 0
        while left > 0:
            step = order.at(i)
            if step is None:
                break
            i += 1
            n, d, k = step
            if k in protected:
                continue
            take = min(d, left)
            out.append((n, take))
            left -= take
        return out

    def eviction_cost(
        self, worker: Any, need_blocks: int, protected: set[int], now: float, window_s: float, block_size: int,
        cost: CostModel, mode: str,
    ) -> float:
        """`eviction_cost_s(self.victims(...), ...)` without listing the victims: the order's `hot_victims` are
        the only ones with requests through them, priced in victim order, so the sum is the same float.
        O(log n + hot + protected) once the order is simulated, instead of O(victims).

        NOTE: first, `cold_blocks`: when the candidates that go before every priced node cover the need, M is 0
        (the same float: the sum below adds nothing then) and no order is simulated. Most Ms are 0 (the victims are
        cold), and a fresh simulation after a dispatch or KV event dropped the order steps over each victim.
        """
        if not self.heap or need_blocks <= 0:
            return 0.0
        if self.cold_blocks(protected) >= need_blocks:  # 0 before the first `advance`
            return 0.0
        order = self.order(worker)
        # each victim's term, kept with the order between selects while it holds; a cost model fitted online
        # (`OnlineFit`) changes in place, so its terms are priced afresh. The order prices "text" terms itself (in
        # C in its Cython build).
        return order.price(need_blocks, protected, now - window_s, block_size, cost, isinstance(cost, ProfileCost),
                           self.term_for(mode))

    @staticmethod
    def term_for(mode: str) -> Callable[..., tuple[float | None, float, float, CostModel]] | None:
        """The victim term `EvictionOrder.price` calls for `mode` (E2's `eviction_cost`), None for its own ("text")."""
        return _alg2_term if mode == "alg2" else None

    def warm(
        self, worker: Any, need_blocks: int, now: float, window_s: float, block_size: int, cost: CostModel,
        mode: str, max_work: int,
    ) -> int:
        """Simulate the order towards `need_blocks` and, once it is there, price its victims with nothing
        protected (`eviction_cost`, for its memo), so a later `eviction_cost` finds both while they hold; within
        `max_work` units, a step simulated or a victim priced each (a later call goes on from the steps taken;
        victims are priced all or none). A cost model fitted online keeps no terms: the order only. Returns the
        units used."""
        if not self.heap or need_blocks <= 0 or self.cold_blocks(set()) >= need_blocks:
            return 0  # M is 0 without an order
        order = self.order(worker)
        before = len(order.steps)  # (no hook runs in between, so nothing leaves the steps)
        if not order.reach(need_blocks, max_work):
            return len(order.steps) - before
        used = len(order.steps) - before
        if isinstance(cost, ProfileCost):
            last = bisect.bisect_left(order.cum, need_blocks + order.cum_base)  # the step that completes the need
            victims = bisect.bisect_right(order.hot, order.base + last)  # the hot ones up to it: what M prices
            if used + victims <= max_work:
                self.eviction_cost(worker, need_blocks, set(), now, window_s, block_size, cost, mode)
                used += victims
        return used

    def order(self, worker: Any) -> Any:
        """The kept eviction order, started afresh when the hooks dropped it."""
        order = self._order
        if order is None:
            order = self._order = EvictionOrder(self, worker, NodeStats)
        return order


class LruIndex(LruPricing, LruIndexCore):
    """One worker's LRU index: `LruIndexCore` (its Cython build where present), kept by E2's hooks, and what M
    reads from it (`LruPricing`)."""

    __slots__ = ()
