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
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from switchyard.ext.lru_order import EvictionOrder
from switchyard.ext.lru_order_py import victim_term
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
    """Σ PT + n × DT; DT single-request (Alg 2) or, with `marginal`, the batched increment (`decode_marginal_s`)."""
    if n <= 0:
        return 0.0
    f = cost.decode_marginal_s if marginal else cost.decode_s
    return max(0.0, sum_prefill_s) + n * f(sum_decode / n, sum_prompt / n + sum_decode / (2 * n))


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
def count_since(dq: deque[tuple[float, float]], cutoff: float) -> tuple[int, float]:
    """(count, Σ value) of the (t, value) samples with t >= cutoff (the head may hold expired ones)."""
    n, s = len(dq), 0.0
    skipped = 0.0
    for t, v in dq:
        if t >= cutoff:
            break
        n -= 1
        skipped += v
    if n:
        s = sum(v for _, v in dq) - skipped
    return n, s


@dataclass(slots=True)
class NodeStats:
    """The policy's slot on a radix node (`node.stats`)."""

    # per worker: (dispatch t, that request's PT on the worker) for requests through this node in W
    # (N_j of the text's M formula, and Alg 2's Σ PREFILLTIME(missed of l) for eviction_cost="alg2")
    hits: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    # observed output lengths of requests whose key portion is this node (bounded deque, median -> decode)
    decode_tokens: deque[int] = field(default_factory=partial(deque, (), 64))  # positional: no kwargs per node
    # per worker: (first-token t, TTFT s) of requests keyed here, for the queueing-doubling detector (§5.5)
    ttft: dict[str, deque[tuple[float, float]]] = field(default_factory=dict)
    redirect: dict[str, tuple[str, float]] = field(default_factory=dict)  # heavy -> (light, until_s) (§5.4)
    replicas: dict[str, float] = field(default_factory=dict)  # extra worker -> until_s (§5.5)
    _sorted: list[int] = field(default_factory=list)  # decode_tokens, sorted (`add_decode` keeps both)
    _median: float | None = None  # median of decode_tokens, kept until the next add_decode (read per dispatch)

    def add_hit(self, worker: str, now: float, prefill_s: float, window_s: float) -> None:
        dq = self.hits.get(worker)
        if dq is None:
            dq = self.hits[worker] = deque()
        dq.append((now, prefill_s))
        cutoff = now - window_s
        while dq[0][0] < cutoff:
            dq.popleft()

    def add_decode(self, num_tokens: int) -> None:
        dq, srt = self.decode_tokens, self._sorted
        if len(dq) == dq.maxlen:
            del srt[bisect.bisect_left(srt, dq[0])]  # the deque is about to drop its oldest
        dq.append(num_tokens)
        bisect.insort(srt, num_tokens)
        self._median = None

    def median_decode(self) -> float | None:
        """`statistics.median(decode_tokens)`, from the values kept sorted: a hot key node gets a finish between
        most of its dispatches, and sorting its 64 values at each was ~8% of a ToolBench dispatch."""
        srt = self._sorted
        if self._median is None and srt:
            i = len(srt) // 2
            self._median = srt[i] if len(srt) % 2 else (srt[i - 1] + srt[i]) / 2  # statistics.median's formula
        return self._median


def merged_stats(children: Iterable[Any]) -> NodeStats:
    """Stats for a node that a split created: every request through a child also went through it."""
    out = NodeStats()
    for child in children:
        st = child.stats
        if not isinstance(st, NodeStats):
            continue
        for w, dq in st.hits.items():
            cur = out.hits.get(w)
            out.hits[w] = deque(heapq.merge(cur, dq)) if cur else deque(dq)
    return out


def is_overloaded(samples: deque[tuple[float, float]], now: float, window_s: float, factor: float) -> bool:
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
    count, term = count_since(dq, cutoff)
    if not count:
        return None, cutoff, math.inf, cost
    return term, cutoff, dq[len(dq) - count][0], cost


# ---------------------------------------------------------------------------------------------- outstanding work
class Outstanding:
    """The work this router has dispatched to one worker and not yet seen done (from its own hooks, no lag).

    queued: requests dispatched without a first token yet -> (uncached prompt tokens, PT_r s). Their prefill is
            still ahead of (or running with) any request dispatched now, so Σ PT_r over them is the prefill a new
            request waits behind on an engine that admits in arrival order [inferred].
    decoding: requests past their first token -> context tokens (prompt + predicted output / 2). Every engine
            iteration carries one decode token for each of them; `decode_tokens` / (decode tokens + queued
            prefill tokens) is the decode-token fraction of the work ahead (errata E9, the [inferred] option).
    O(1) per hook; select only reads.
    """

    __slots__ = ("queued", "decoding", "queued_s", "queued_tokens", "decoding_ctx")

    def __init__(self) -> None:
        self.queued: dict[str, tuple[int, float]] = {}
        self.decoding: dict[str, int] = {}
        self.queued_s = 0.0
        self.queued_tokens = 0
        self.decoding_ctx = 0

    def add(self, request_id: str, missed_tokens: int, prefill_s: float) -> None:
        self.drop(request_id)
        self.queued[request_id] = (missed_tokens, prefill_s)
        self.queued_s += prefill_s
        self.queued_tokens += missed_tokens

    def first_token(self, request_id: str, context_tokens: int) -> None:
        q = self.queued.pop(request_id, None)
        if q is None:
            return
        self._unqueue(q)
        self.decoding[request_id] = context_tokens
        self.decoding_ctx += context_tokens

    def drop(self, request_id: str) -> None:
        q = self.queued.pop(request_id, None)
        if q is not None:
            self._unqueue(q)
        c = self.decoding.pop(request_id, None)
        if c is not None:
            self.decoding_ctx -= c

    def _unqueue(self, q: tuple[int, float]) -> None:
        if not self.queued:  # NOTE: exact reset, so float drift never outlives an empty queue
            self.queued_s, self.queued_tokens = 0.0, 0
        else:
            self.queued_tokens -= q[0]
            self.queued_s -= q[1]

    def decode_fraction(self) -> float:
        """Decode tokens / all tokens in the work ahead (1 token per decoding request, the queued prefill);
        0 when idle."""
        d = len(self.decoding)
        total = d + self.queued_tokens
        return d / total if total > 0 else 0.0


# ---------------------------------------------------------------------------------------------- incremental LRU
COLD_BUCKETS_PER_S = 1024  # a power of two: t * 1024 is exact, so bucket b < cold_bucket(T) means t < T


def cold_bucket(t: float) -> int:
    """The cold-mass bucket of a time (`LruIndex.cold_blocks`): 1/1024 s wide, so the cold floor stays close to
    the earliest request it must precede (a whole-second bucket lost every candidate keyed in the floor's second,
    the common case when the first dispatches and the preloaded cache share one)."""
    return math.floor(t * COLD_BUCKETS_PER_S)


class LruIndex:
    """`lru_victims` without the per-call scan (§4.2: "a per-GPU LRU heap ... so the cost is O(k log N)").

    Per worker it keeps, from the hooks, every node resident on it with the parent it was recorded under, the
    number of its resident children (`held`), and a heap of the current eviction candidates (resident, no
    resident child) keyed by (last_access, node.seq: creation order, so ties do not follow memory addresses);
    entries are lazy: one whose node left the candidates or whose last_access moved is skipped (and the heap is
    compacted in the hooks once stale entries dominate).
    `touch(nodes)` reconciles the given nodes for every tracked worker after any tree change that can alter
    their residency, parent or last_access; the hooks pass every node such a change can reach.

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

    __slots__ = ("entries", "held", "heap", "keyed", "_order", "worker", "cand", "bucket_blocks", "floor_b",
                 "below", "ahead", "ahead_set")

    def __init__(self) -> None:
        self.entries: dict[int, tuple[Any, Any]] = {}  # id(node) -> (node, recorded parent or None)
        self.held: dict[int, int] = {}  # id(node) -> resident children recorded under it
        self.heap: list[tuple[float, int, Any]] = []  # (last_access, node.seq, node), lazy
        self.keyed: dict[int, float] = {}  # id -> last_access of its live heap entry
        self._order: EvictionOrder | None = None  # the eviction order, simulated lazily; None after a change
        # The cold mass (`cold_blocks`): per live candidate (`cold_bucket` of its key, resident blocks);
        # per bucket the candidates' blocks; `below` = their sum over the buckets under `floor_b` (`advance`).
        self.worker: Any = None  # the worker this index is for (set by `touch`)
        self.cand: dict[int, tuple[int, int]] = {}
        self.bucket_blocks: dict[int, int] = {}
        self.floor_b: int | None = None
        self.below = 0
        # the buckets at or past the floor that have held mass since it last passed them, each once (a heap and
        # its set): `advance` pops the ones it passes instead of scanning every bucket
        self.ahead: list[int] = []
        self.ahead_set: set[int] = set()

    def _consider(self, node: Any) -> None:
        k = id(node)
        if k in self.entries and not self.held.get(k):
            la = node.last_access
            if self.keyed.get(k) != la:
                self.keyed[k] = la
                entry = (la, node.seq, node)
                heapq.heappush(self.heap, entry)
                order = self._order
                if order is not None and not order.pushed(entry):  # it walks this heap's array in place
                    self._order = None
            new: tuple[int, int] | None = (cold_bucket(la), node.resident_on(self.worker))
        else:
            self.keyed.pop(k, None)
            new = None
        old = self.cand.get(k)
        if old != new:  # a candidate came, went, or its key or resident blocks moved: keep the cold mass
            if old is not None:
                self._add_mass(old[0], -old[1])
                del self.cand[k]
            if new is not None:
                self._add_mass(new[0], new[1])
                self.cand[k] = new

    def _add_mass(self, bucket: int, blocks: int) -> None:
        v = self.bucket_blocks.get(bucket, 0) + blocks
        if v:
            self.bucket_blocks[bucket] = v
        else:
            self.bucket_blocks.pop(bucket, None)
        if self.floor_b is not None and bucket < self.floor_b:
            self.below += blocks
        elif bucket not in self.ahead_set:
            self.ahead_set.add(bucket)
            heapq.heappush(self.ahead, bucket)
            if len(self.ahead) > 2 * len(self.bucket_blocks) + 64:  # emptied buckets dominate (few ticks): drop
                self.ahead = [b for b in self.ahead if b in self.bucket_blocks]  # them; one that fills again
                heapq.heapify(self.ahead)  # is pushed again, so `advance` still passes every bucket with mass
                self.ahead_set = set(self.ahead)

    def advance(self, floor_b: int) -> None:
        """Count the candidates of the buckets before `floor_b` (a `cold_bucket`) in `cold_blocks`; never moves
        back.

        The caller (E2's `on_tick`) passes the floor of a time at or before every request through any node on this
        worker within the node window: a candidate keyed under it is evicted before every node that M prices.
        O(log n) per bucket it passes (`ahead`), not a scan of the buckets per tick (which was half of on_tick).
        """
        fb = self.floor_b
        if fb is not None and floor_b <= fb:
            return
        below = 0 if fb is None else self.below
        ahead, ahead_set, mass = self.ahead, self.ahead_set, self.bucket_blocks
        while ahead and ahead[0] < floor_b:  # every bucket under the new floor with mass is here, once
            b = heapq.heappop(ahead)
            ahead_set.discard(b)
            below += mass.get(b, 0)
        self.below = below
        self.floor_b = floor_b

    def cold_blocks(self, protected: set[int]) -> int:
        """Resident blocks of the live candidates keyed before `floor_b`, protected ones left out: the eviction
        order takes all of them before any node with a request through it on this worker in the window (a
        candidate stays one until taken, and such a node's key, its last_access, is at least that request's
        time), so when they cover a prompt's need its M is 0 without simulating the order.

        NOTE: E2's bound kernel (`ext/e2_select.m_is_zero`) takes this exit in C, reading `heap`, `floor_b`,
        `below` and `cand` by this rule: a change to the rule or to those fields goes there too."""
        fb = self.floor_b
        if fb is None:
            return 0
        n = self.below
        cand = self.cand
        for k in protected:
            c = cand.get(k)
            if c is not None and c[0] < fb:
                n -= c[1]
        return n

    def touch(self, worker: Any, node: Any, resident: dict[Any, int] | None = None, prune: bool = True) -> None:
        """Reconcile one node for `worker` (`resident` = node.resident when the caller already has it); `prune`
        False leaves the heap's stale top to the caller (`touch_all`)."""
        self.worker = worker
        k = id(node)
        res = (node.resident if resident is None else resident).get(worker, 0) > 0 and node.is_attached
        if res and self.touch_unmoved(node, k, node.parent):
            return
        old = self.entries.get(k)
        if old is None and not res:
            return
        parent = node.parent if res else None
        order = self._order
        if order is not None and not (not res and order.first_resized(k, 0)) and (
                order.reached(k) or (old is not None and old[1] is not None and order.reached(id(old[1])))
                or (parent is not None and order.reached(id(parent)))):
            self._order = None  # the steps read this node or a parent whose resident children change
        if old is not None:
            op = old[1]
            if op is not None:
                c = self.held[id(op)] - 1
                if c:
                    self.held[id(op)] = c
                else:
                    del self.held[id(op)]
                self._consider(op)
        if res:
            self.entries[k] = (node, parent)
            if parent is not None:
                self.held[id(parent)] = self.held.get(id(parent), 0) + 1
                self._consider(parent)
        else:
            del self.entries[k]
        self._consider(node)
        if prune:
            self._prune()

    def touch_all(self, worker: Any, nodes: Sequence[Any]) -> None:
        """`touch` each node, pruning the heap's stale top once at the end (stale entries only gather at the top
        meanwhile): an eviction event touches every node of its run, ~23 per event while a preloaded cache of
        small prompts drains, and `_prune` was a third of each touch. (A node still resident under the same
        parent goes through `touch_unmoved`, which prunes as it always did.)"""
        for node in nodes:
            self.touch(worker, node, prune=False)
        if nodes:
            self._prune()

    def touch_unmoved(self, node: Any, k: int, parent: Any) -> bool:
        """`touch` of a node resident and attached here (k = id(node), parent = node.parent) when it is recorded
        under that same parent: True, done; False when `touch` has more to reconcile.

        Only last_access (or the resident count) can have moved then: the eviction order depends on the node only
        once it is a candidate or the simulation has reached it (a shared prefix, touched by every request, is
        neither while its children are resident).
        NOTE: a dispatch touches every holder's index for each node of the prompt's matched path, and this case is
        nearly all of them: `ext/lru_order.touch_holders` (`PrebleE2._touch_holders`) takes it in C, reading
        `entries`, `keyed`, `_order` and `held` by this rule; a change here goes there too.
        """
        old = self.entries.get(k)
        if old is None or old[1] is not parent:
            return False
        keyed = self.keyed
        order = self._order
        if order is not None and (k in order.done or k in order.unlocked) and not (
                keyed.get(k) == node.last_access and order.first_resized(k, node.resident_on(self.worker))):
            self._order = None  # a step read its key or resident blocks (a new key is `pushed`'s to judge)
        if self.held.get(k) and k not in keyed:
            return True  # not a candidate before or after (resident children): heap and keys unchanged
        self._consider(node)
        self._prune()
        return True

    def _prune(self) -> None:
        """Drop stale heap entries: all of them once they dominate, else those on top.

        NOTE: a stale entry keeps its node's earlier (smaller) last_access, so stale entries gather at the top,
        and `victims`, which is read-only and walks the array in key order, would step over every one of them
        on each call. Popping them here keeps the top live. Exact: `victims` skips stale entries anyway, and a
        kept order rebuilds its frontier over the moved array (`rebased`) before its next step.
        """
        heap, keyed = self.heap, self.keyed
        order = self._order
        if len(heap) > 2 * len(keyed) + 64:
            self.heap = [e for e in heap if keyed.get(id(e[2])) == e[0]]
            heapq.heapify(self.heap)
            if order is not None:
                order.rebased(self.heap)
            return
        popped = False
        while heap and keyed.get(id(heap[0][2])) != heap[0][0]:
            heapq.heappop(heap)
            popped = True
        if popped and order is not None:
            order.rebased(heap)

    def victims(self, worker: Any, need_blocks: int, protected: set[int]) -> list[tuple[Any, int]]:
        out: list[tuple[Any, int]] = []
        left = need_blocks
        if not self.heap or left <= 0:
            return out
        order = self._order
        if order is None:
            order = self._order = EvictionOrder(self, worker, NodeStats)
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
        order = self._order
        if order is None:
            order = self._order = EvictionOrder(self, worker, NodeStats)
        # each victim's term, kept with the order between selects while it holds; a cost model fitted online
        # (`OnlineFit`) changes in place, so its terms are priced afresh. The order prices "text" terms itself (in
        # C in its Cython build).
        return order.price(need_blocks, protected, now - window_s, block_size, cost, isinstance(cost, ProfileCost),
                           _alg2_term if mode == "alg2" else None)
