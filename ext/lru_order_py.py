"""One worker's LRU index and its eviction order: which resident nodes its LRU would evict, in order (Preble §4.2).

Reference build (obviously correct); `_lru_order_c.pyx` is the Cython build, `lru_order.py` the selector.
`LruIndexCore` is the index the hooks keep (resident nodes, their recorded parents, resident-children counts, a
lazy heap of eviction candidates, the cold mass); `router.policies.preble_load.LruIndex` adds what M reads from
it. `EvictionOrder` reads the index's `heap`, `keyed`, `entries` and `held` and never writes them. `stats_type`
is the class of the per-node statistics whose `hits` (per worker) mark the nodes M prices (`hot`); passed in, as
nothing here imports from `router/`.

`touch_holders` is a dispatch's reconcile of the indexes of a matched path's holders: the index's own
`touch_unmoved` and `touch`, called per (node, worker) here; the Cython build calls the Cython index's in C.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

# an order that lives long takes out many first steps and meets many partial takes: past these, the retired
# nodes go with a fresh order, and the memo starts over
RETIRED_CAP = 1024
MEMO_CAP = 4096


class EvictionOrder:
    """One LruIndex's eviction order from its current state, simulated step by step as far as `victims` reads,
    so selects between two changes of the index share one simulation.

    `victims` with protected nodes is this order with the protected ones skipped: they are an ancestor-closed
    path, so a protected node's eviction here can only unlock a protected parent, and every other node's
    unlock is the same as in the protected simulation. Each step is (node, its resident blocks, id).

    NOTE: the index's heap array is read in place, in key order: `frontier` holds (key, array position) of the
    positions whose parents were taken, so popping it yields the array's entries in heap-key order while
    touching O(k log k) of them for k taken (the heap property: an entry's key is at most its children's).
    The unlocked parents go to `extra`, a heap of (key, node); each step takes the smaller of the two tops.

    The order survives the index's changes that leave its steps as they are, or change them in a known way, so
    the selects between two dispatches to a worker share one simulation while its KV events stream in:
    - a node the simulation has not read (`reached`) may change;
    - a push of a key past every step's (a node stored or accessed now, the common change) joins the walk, and
      so does a push of a parent the simulation already unlocked at that key (`pushed`);
    - the first step's node losing blocks or leaving (the worker evicting what its LRU evicts first) updates the
      steps (`first_resized`);
    - the array moving under the walk (a sift, a pop, a compaction: `rebased`) rebuilds the frontier from it.
    Anything else drops the order (the index's `touch` and `touch_unmoved` decide).
    NOTE: frontier positions are popped in increasing (key, seq, position) order, each after its parent (the
    heap property), so a position at or before the last popped one has been popped: that is how `pushed` tells
    whether the new position's parent already put its children in the frontier. A push that would break the
    increasing order (its key past every step's, before a stale entry already popped) rebuilds the frontier.
    Every live candidate keyed at or before the largest step's key (`max_key`) has been taken or is an unlocked
    parent, so a rebuilt frontier starts past it.
    """

    __slots__ = ("idx", "worker", "stats_type", "steps", "array", "frontier", "extra", "unlocked", "done",
                 "local_held", "cum", "pos", "hot", "memo", "facts", "last_popped", "max_key", "stale", "retired",
                 "base", "cum_base")

    def __init__(self, idx: Any, worker: Any, stats_type: type) -> None:
        self.idx, self.worker, self.stats_type = idx, worker, stats_type
        self.steps: list[tuple[Any, int, int]] = []
        # NOTE: entries with equal (last_access, seq) hold the same node (seq is unique in a tree), so their
        # order among themselves does not matter (`done` skips the second); ties of last_access go by creation
        # order, the same in every run.
        self.array = idx.heap  # read only; the index says when it moved entries (`rebased`)
        self.frontier: list[tuple[float, int, int]] = [(self.array[0][0], self.array[0][1], 0)] if self.array else []
        self.extra: list[tuple[float, int, Any]] = []
        self.unlocked: dict[int, float] = {}  # id -> last_access of a parent this simulation made a candidate
        self.done: set[int] = set()
        self.local_held: dict[int, int] = {}
        # Step numbers count from the order's first step, including those taken out since (`first_resized`):
        # steps[i] is step number base + i, and cum[i] - cum_base its resident blocks with those of the steps
        # before it; taking out the first step is then O(1), not a renumbering.
        self.base = 0
        self.cum_base = 0
        self.cum: list[int] = []
        self.pos: dict[int, int] = {}  # id -> its step number
        # the step numbers whose node had requests through it on this worker when simulated (the only ones M
        # prices): a node gains one only by a dispatch through it, which touches it, and a touch of a node the
        # order has taken drops the order (one it has not reached is read when it is)
        self.hot: list[int] = []
        # the caller's cache of values derived from these steps (E2 keeps its victims' M terms here, by node id):
        # it goes with the order, and a step whose node changes takes its entries with it
        self.memo: dict[Any, Any] = {}
        # the default term's `victim_facts` per victim id, while the window's start stays in their [lo, hi]: a
        # partial take (a new memo key at almost every M) is priced from them without reading the node again
        self.facts: dict[int, tuple[int, float, float, int]] = {}
        self.last_popped: tuple[float, int, int] | None = None  # the frontier's last (key, seq, position)
        self.max_key: tuple[float, int] | None = None  # the largest (key, seq) of the steps
        self.stale = False  # the array moved under the frontier: rebuild it before the next step
        self.retired: list[Any] = []  # nodes of steps taken out (`first_resized`): alive, so their ids stay theirs

    def reached(self, k: int) -> bool:
        """Whether the simulation has read node k's state: taken (`done`), unlocked, or counted a child of it
        (`local_held`). A change to such a node, its residency, parent, key or resident children, changes what
        the steps read; a change to any other node does not."""
        return k in self.done or k in self.unlocked or k in self.local_held

    def pushed(self, entry: tuple[float, int, Any]) -> bool:
        """After the index pushed `entry` onto the array: True when the steps still hold, with the entry joined
        to the walk; False when the order must be dropped: the key does not come after every step's (the
        simulation would have taken it earlier), unless it is a parent the simulation unlocked at that key."""
        la, seq, node = entry
        if self.max_key is not None and (la, seq) <= self.max_key and self.unlocked.get(id(node)) != la:
            return False
        array = self.array
        p = len(array) - 1
        if self.stale:
            return True
        if array[p] is not entry:  # sifted toward the top: positions moved
            self.stale = True
            return True
        if self.last_popped is not None and (la, seq, p) < self.last_popped:
            # past every step's key but not past every popped one's (the walk passed a stale entry keyed after
            # it): popped now it would come after larger keys, and a child of a position popped before it would
            # be taken for unpopped and never joined. The frontier is rebuilt around it (`_rebase`).
            self.stale = True
            return True
        q = (p - 1) // 2
        if p == 0 or (self.last_popped is not None and (array[q][0], array[q][1], q) <= self.last_popped):
            heapq.heappush(self.frontier, (la, seq, p))  # its parent's children are in already
        return True

    def rebased(self, array: list[tuple[float, int, Any]]) -> None:
        """The index moved entries of its array, or replaced it (`array`), with no live candidate added or lost
        other than as `pushed` and the touches allow: the frontier is rebuilt before the next step."""
        self.array = array
        self.stale = True

    def _rebase(self) -> None:
        """The frontier from the array: the positions past `max_key` whose parents are at or before it (those
        at or before it are taken, stale, or unlocked parents, which `extra` holds). O(entries it passes)."""
        array, mk = self.array, self.max_key
        frontier: list[tuple[float, int, int]] = []
        stack = [0] if array else []
        while stack:
            p = stack.pop()
            la, seq, _ = array[p]
            if mk is not None and (la, seq) <= mk:
                stack.extend(c for c in (2 * p + 1, 2 * p + 2) if c < len(array))
            else:
                frontier.append((la, seq, p))
        heapq.heapify(frontier)
        self.frontier = frontier
        # every position popped from here on comes after these: positions at or before max_key are passed
        self.last_popped = None if mk is None else (mk[0], mk[1], len(array))
        self.stale = False

    def first_resized(self, k: int, blocks: int) -> bool:
        """The first step's node (id k) now holds `blocks` resident blocks here, 0 when it left, with its key
        and parent as they were: True, the steps updated (the rest of the order is the same: it was first, so
        every later step saw it taken, and a parent it unlocked is a candidate now either way); False when node
        k is not the first step."""
        steps = self.steps
        if not steps or steps[0][2] != k:
            return False
        n, d0, _ = steps[0]
        if blocks:
            for key in [key for key in self.memo if key[0] == k]:  # its terms change with its resident blocks
                del self.memo[key]
            self.facts.pop(k, None)
            steps[0] = (n, blocks, k)
            self.cum_base += d0 - blocks
            return True
        if len(self.retired) >= RETIRED_CAP:
            return False  # a fresh order forgets them
        self.retired.append(n)  # its id stays in `done` and the memo's keys
        del steps[0]
        del self.cum[0]
        self.cum_base += d0
        del self.pos[k]
        if self.hot and self.hot[0] == self.base:
            del self.hot[0]
        self.base += 1
        return True

    def at(self, i: int) -> tuple[Any, int, int] | None:
        """The i-th node to evict, or None when fewer remain."""
        steps = self.steps
        while len(steps) <= i:
            if not self._step():
                return None
        return steps[i]

    def reach(self, blocks: int, max_steps: int = -1) -> bool:
        """Simulate until the steps hold `blocks` resident blocks; False when the candidates ran out first, or
        when `max_steps` (if >= 0) more steps did not get there (a later call goes on from there)."""
        cum = self.cum
        while not cum or cum[-1] - self.cum_base < blocks:
            if max_steps == 0 or not self._step():
                return False
            max_steps -= 1
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
        steps, cum, pos, base, cum_base = self.steps, self.cum, self.pos, self.base, self.cum_base
        prot_at: list[int] = []
        while True:
            enough = self.reach(need_blocks + sum(steps[i][1] for i in prot_at))
            now_at = sorted(i - base for k in protected if (i := pos.get(k)) is not None)
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
            return cum[i] - cum_base - (prot_cum[j - 1] if j else 0)

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
        for h in self.hot:
            i = h - base
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
        E3; from the victim's `facts`). With `keep`, each term is kept in `memo` under (id, blocks taken) while
        the window's start stays between the two times it holds for and the cost model is the same object (one
        whose answers never change: the caller's to choose; the memo is not keyed by the term, so one order is
        priced with one term). The same float as pricing every victim afresh."""
        m = 0.0
        memo, worker = self.memo, self.worker
        for n, take in self.hot_victims(need_blocks, protected):
            got = memo.get((id(n), take)) if keep else None
            if got is None or not got[1] <= cutoff <= got[2] or got[3] is not cost:
                if term is None:
                    got = term_from(self._facts_of(n, cutoff), take, block_size, cost)
                else:
                    got = term(n, take, worker, cutoff, block_size, cost)
                if keep:
                    if len(memo) >= MEMO_CAP:  # (a long-lived order meets many partial takes)
                        memo.clear()
                    memo[(id(n), take)] = got
            if got[0] is not None:
                m = m + got[0]
        return m

    def _facts_of(self, n: Any, cutoff: float) -> tuple[int, float, float, int]:
        """Victim n's `victim_facts` at `cutoff`, from `facts` while they hold (they do not depend on the cost
        model, so they are kept whatever `price`'s `keep`)."""
        k = id(n)
        got = self.facts.get(k)
        if got is None or not got[1] <= cutoff <= got[2]:
            got = victim_facts(n, self.worker, cutoff, self.stats_type)
            if len(self.facts) >= MEMO_CAP:
                self.facts.clear()
            self.facts[k] = got
        return got

    def _step(self) -> bool:
        idx, unlocked, done = self.idx, self.unlocked, self.done
        keyed, entries = idx.keyed, idx.entries
        if self.stale:
            self._rebase()
        frontier, extra, array = self.frontier, self.extra, self.array
        size = len(array)
        while True:
            # the next entry in key order: the array's (via the frontier) or an unlocked parent's
            if frontier and (not extra or frontier[0] <= extra[0][:2]):
                top = self.last_popped = heapq.heappop(frontier)
                pos = top[2]
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
            key = (la, n.seq)
            if self.max_key is None or key > self.max_key:
                self.max_key = key
            d = n.resident_on(self.worker)
            i = len(self.steps)
            self.steps.append((n, d, k))
            self.cum.append((self.cum[-1] if i else self.cum_base) + d)
            self.pos[k] = self.base + i
            st = n.stats
            if isinstance(st, self.stats_type) and st.hits.get(self.worker):
                self.hot.append(self.base + i)
            p = entries[k][1]
            if p is not None:  # counted resident or not (`reached`: its becoming resident changes this step)
                kp = id(p)
                c = self.local_held.get(kp, idx.held.get(kp, 0)) - 1
                self.local_held[kp] = c
                if c == 0 and kp in entries:  # its last resident child gone: the parent is a candidate
                    unlocked[kp] = p.last_access
                    heapq.heappush(extra, (p.last_access, p.seq, p))
            return True


def victim_facts(node: Any, worker: Any, cutoff: float, stats_type: type) -> tuple[int, float, float, int]:
    """What victim j's "text" term reads of j: (its requests on `worker` since `cutoff`, the window starts [lo, hi]
    between which that count holds, its context and resident blocks), or (0, cutoff, inf, 0) without a request.

    The requests are `stats.hits[worker]` (`Samples`: (t, ...) in time order; the head may hold expired ones).
    The count holds while the window's start stays between `cutoff` and j's first request in the window: later
    ones are counted either way, earlier ones neither."""
    st = node.stats
    dq = st.hits.get(worker) if isinstance(st, stats_type) else None
    if not dq:
        return 0, cutoff, math.inf, 0
    count, first = dq.since(cutoff)
    if not count:
        return 0, cutoff, math.inf, 0
    return count, cutoff, first, node.context_blocks + node.resident_on(worker)


def term_from(
    facts: tuple[int, float, float, int], nblocks: int, block_size: int, cost: Any
) -> tuple[float | None, float, float, Any]:
    """(victim j's "text" term of M for `nblocks` of its blocks, or None when no request through j is in the
    window; the window starts [lo, hi] between which the term holds; the cost model it was priced with), from j's
    `victim_facts`.

    PT_j × N_j: recompute the evicted tokens after j's context and kept blocks (`cost.prefill_s`), times j's
    requests in the window."""
    count, lo, hi, blocks = facts
    if not count:
        return None, lo, hi, cost
    return cost.prefill_s(nblocks * block_size, (blocks - nblocks) * block_size) * count, lo, hi, cost


def victim_term(
    node: Any, nblocks: int, worker: Any, cutoff: float, block_size: int, cost: Any, stats_type: type
) -> tuple[float | None, float, float, Any]:
    """Victim j's "text" term priced afresh (`term_from` its `victim_facts`)."""
    return term_from(victim_facts(node, worker, cutoff, stats_type), nblocks, block_size, cost)


def touch_holders(lru: dict[Any, Any], nodes: list[Any], moved: Any = None) -> None:
    """Reconcile, for each node of `nodes` whose residency and parent did not change, the LRU index (`lru[w]`) of
    every worker w it is resident on: `idx.touch_unmoved(node, id(node), node.parent)` where it is resident and
    attached, else (or when that answers False) `idx.touch(w, node, node.resident)`. Only last_access moved,
    so only those indexes can hold the nodes (`PrebleE2._touch_holders`).

    `moved`, first: the lower half of a split, which kept its identity under a new upper half (its parent now)
    that took over its resident set. Its residency and parent changed, so it gets `idx.touch` on the index of each
    worker that upper half is resident on: an index holds a node only while it is resident there, so no other
    index can hold it (asking the fleet's every index cost 16 cache-cold probes, ~6-8 µs a video-QA split).
    """
    if moved is not None:
        res = moved.resident
        parent = moved.parent
        for w in parent.resident if parent is not None else lru:  # detached: any index may hold it
            idx = lru.get(w)
            if idx is not None:
                idx.touch(w, moved, res)
    for node in nodes:
        res = node.resident
        if not res:
            continue
        k, parent, attached = id(node), node.parent, node.is_attached
        for w, run in res.items():
            idx = lru.get(w)
            if idx is not None and not (run > 0 and attached and idx.touch_unmoved(node, k, parent)):
                idx.touch(w, node, res)


COLD_BUCKETS_PER_S = 1024  # a power of two: t * 1024 is exact, so bucket b < cold_bucket(T) means t < T


def cold_bucket(t: float) -> int:
    """The cold-mass bucket of a time (`LruIndex.cold_blocks`): 1/1024 s wide, so the cold floor stays close to
    the earliest request it must precede (a whole-second bucket lost every candidate keyed in the floor's second,
    the common case when the first dispatches and the preloaded cache share one)."""
    return math.floor(t * COLD_BUCKETS_PER_S)


class LruIndexCore:
    """`lru_victims` without the per-call scan (§4.2: "a per-GPU LRU heap ... so the cost is O(k log N)").

    Per worker it keeps, from the hooks, every node resident on it with the parent it was recorded under, the
    number of its resident children (`held`), and a heap of the current eviction candidates (resident, no
    resident child) keyed by (last_access, node.seq: creation order, so ties do not follow memory addresses);
    entries are lazy: one whose node left the candidates or whose last_access moved is skipped (and the heap is
    compacted in the hooks once stale entries dominate).
    `touch(nodes)` reconciles the given nodes for every tracked worker after any tree change that can alter
    their residency, parent or last_access; the hooks pass every node such a change can reach. The eviction
    order (`victims`, M) is `router.policies.preble_load.LruPricing`'s.

    The index's tables are what the eviction order (`EvictionOrder`) walks, and `touch_holders` and E2's bound
    kernel read: `_lru_order_c.LruIndexCore` is the Cython build of this class, over the same tables.
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
        nearly all of them (`touch_holders`, `PrebleE2._touch_holders`). Every method of this class has its twin
        in `_lru_order_c.LruIndexCore`: a change here goes there too.
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
