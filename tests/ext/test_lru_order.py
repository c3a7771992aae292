"""The LRU eviction order (E2's M): the Cython build against the reference, step for step, on indexes built
through E2's hooks (dispatches, stored and removed blocks, clears, gc) on random prompts."""

from __future__ import annotations

import gc
import random

import pytest
from ext_testlib import NO_EXTENSIONS
from hook_fuzz import chained, drive, random_prompts

from switchyard.ext import lru_order, lru_order_py
from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.preble_cost import OnlineFit, profile_cost
from switchyard.router.policies.preble_e2 import E2Config, PrebleE2
from switchyard.router.policies.preble_load import NodeStats, _alg2_term
from switchyard.workers.engine.profiles import DEFAULT_PROFILE, PROFILES

try:
    from switchyard.ext import _lru_order_c
except ImportError:  # pragma: no cover - test_c_extension_loaded reports it
    _lru_order_c = None

WORKERS = [WorkerId("w0"), WorkerId("w1"), WorkerId("w2")]


@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
def test_c_extension_loaded() -> None:
    if NO_EXTENSIONS:
        pytest.skip("SWITCHYARD_NO_EXTENSIONS is set")
    assert _lru_order_c is not None, "switchyard.ext._lru_order_c did not build or import"
    assert lru_order.IMPLEMENTATION == "c"
    assert lru_order.EvictionOrder is _lru_order_c.EvictionOrder
    assert lru_order.LruIndexCore is _lru_order_c.LruIndexCore


def _walk(order: object, limit: int = 10_000) -> list[tuple[int, int]]:
    """Every step of the order as (id, blocks), read through `at` as `victims` reads it."""
    out = []
    for i in range(limit):
        step = order.at(i)  # type: ignore[attr-defined]
        if step is None:
            return out
        out.append((step[2], step[1]))
    raise AssertionError("the order did not end")


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(8))
def test_cython_order_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    policy = PrebleE2(E2Config.paper(node_window_s=5.0))
    prompts = random_prompts(rng, 50, labels=60)
    compared = 0
    for _ in drive(policy, rng, prompts, WORKERS, 250, tied_times=True):  # ties go by creation order
        for v, idx in policy.lru.items():
            ref = lru_order_py.EvictionOrder(idx, v, NodeStats)
            fast = _lru_order_c.EvictionOrder(idx, v, NodeStats)
            # read part of the way first (`reach`), as eviction_cost does, then to the end; first with a step
            # budget, as the tick's warm-up does: it stops there, and the next call goes on
            need = rng.choice([1, 4, 20])
            budget = rng.choice([0, 1, 3])
            assert fast.reach(need, budget) == ref.reach(need, budget)
            assert len(fast.steps) == len(ref.steps) <= budget
            assert fast.reach(need) == ref.reach(need)
            assert _walk(fast) == _walk(ref)
            assert (fast.cum, fast.hot, fast.pos) == (ref.cum, ref.hot, ref.pos)
            assert (fast.done, fast.unlocked, fast.local_held) == (ref.done, ref.unlocked, ref.local_held)
            assert (fast.max_key, fast.last_popped) == (ref.max_key, ref.last_popped)  # what `pushed` reads
            compared += len(ref.steps)
    assert compared > 500  # the indexes were not trivially empty


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(6))
def test_cython_kept_order_updates_equal_reference(seed: int) -> None:
    """What the index tells a kept order, done to both builds alike: the first step shrunk or taken out
    (`first_resized`, step numbers and `cum` by offset, the memo's terms of a shrunk node dropped) and the
    array moved (`rebased`, the frontier rebuilt past the largest step key), then the order read further: the
    same steps, tables and offsets."""
    rng = random.Random(seed)
    policy = PrebleE2(E2Config.paper(node_window_s=5.0))
    prompts = random_prompts(rng, 50, labels=60)
    resized = 0
    for _ in drive(policy, rng, prompts, WORKERS, 250, tied_times=True):
        for v, idx in policy.lru.items():
            orders = [lru_order_py.EvictionOrder(idx, v, NodeStats), _lru_order_c.EvictionOrder(idx, v, NodeStats)]
            need = rng.choice([4, 20, 80])
            for o in orders:
                o.reach(need)
                o.price(need, set(), 0.0, 16, profile_cost(DEFAULT_PROFILE))  # a memo to keep or drop
            for _ in range(rng.randint(1, 3)):
                if not orders[0].steps:
                    break
                _, d, k = orders[0].steps[0]
                blocks = rng.choice([0, 0, max(1, d - 1)])
                assert orders[0].first_resized(k, blocks) == orders[1].first_resized(k, blocks) is True
                resized += 1
            if rng.random() < 0.5:
                for o in orders:
                    o.rebased(idx.heap)
            for o in orders:
                o.reach(need + 40)
            ref, fast = orders
            assert [(k, d) for _, d, k in fast.steps] == [(k, d) for _, d, k in ref.steps]
            assert (fast.cum, fast.hot, fast.pos, fast.base, fast.cum_base) == (
                ref.cum, ref.hot, ref.pos, ref.base, ref.cum_base)
            assert (fast.max_key, fast.last_popped, fast.stale, fast.memo, fast.facts) == (
                ref.max_key, ref.last_popped, ref.stale, ref.memo, ref.facts)
            assert fast.hot_victims(need, set()) == ref.hot_victims(need, set())
    assert resized > 200


def _path_ids(node: object) -> set[int]:
    """The ids of a node and its ancestors: a request's protected path (ancestor-closed)."""
    out = set()
    while node is not None and getattr(node, "parent", None) is not None:
        out.add(id(node))
        node = node.parent  # type: ignore[attr-defined]
    return out


def _prompts(rng: random.Random, deep: bool) -> list[tuple[int, ...]]:
    """`random_prompts`; `deep`: also every prefix of one 60-block chain, whose dispatches cut it into a path of
    many short nodes (a prefix after a longer one cuts nothing; a longer one after it adds a node)."""
    prompts = random_prompts(rng, 50, labels=60)
    if deep:
        chain = chained([rng.randrange(1_000) for _ in range(60)])
        prompts += [chain[:k] for k in range(1, 61)]
    return prompts


def _protected(rng: random.Random, nodes: list[object], p: float, deep: bool) -> set[int]:
    """A random node's path ids with probability p; `deep`: half of those the deepest node's, so a protected
    path outgrows the Cython build's stack arrays (16 ids)."""
    if not nodes or rng.random() >= p:
        return set()
    if deep and rng.random() < 0.5:
        return max((_path_ids(n) for n in nodes), key=len)
    return _path_ids(rng.choice(nodes))


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
@pytest.mark.parametrize(("seed", "deep"), [(s, False) for s in range(6)] + [(s, True) for s in range(2)])
def test_cython_hot_victims_equal_reference(seed: int, deep: bool) -> None:
    """`hot_victims` (M's priced victims, protected path skipped, partial last take) agrees between the builds,
    and with its definition over the reference's full order: the hot steps among the unprotected victims that
    first reach the need."""
    rng = random.Random(seed)
    policy = PrebleE2(E2Config.paper(node_window_s=5.0))
    prompts = _prompts(rng, deep)
    partial = protected_seen = priced = long_paths = 0
    for _ in drive(policy, rng, prompts, WORKERS, 250, tied_times=True):
        nodes = list(policy.tree.nodes())
        for v, idx in policy.lru.items():
            ref = lru_order_py.EvictionOrder(idx, v, NodeStats)
            fast = _lru_order_c.EvictionOrder(idx, v, NodeStats)
            protected = _protected(rng, nodes, 0.7, deep)
            probe = lru_order_py.EvictionOrder(idx, v, NodeStats)  # a separate order: the two read lazily
            full = _full(probe)
            # a need that ends inside a random hot step (a partial take), at a random count, or past every block
            free = [(d, i in probe.hot) for i, (_, d, k) in enumerate(full) if k not in protected]
            hot = [j for j, (_, h) in enumerate(free) if h]
            cut = rng.choice(hot) if hot else 0
            inside = sum(d for d, _ in free[:cut]) + rng.randint(1, free[cut][0]) if free else 1
            need = rng.choice([inside, inside, rng.randint(1, 80), 10_000])
            long_paths += len(protected) > 16
            got = fast.hot_victims(need, protected)
            assert got == ref.hot_victims(need, protected)
            # the definition, from the whole order: victims in order, protected skipped, until need is met
            want, left = [], need
            for n, d, k in full:
                if left <= 0:
                    break
                if k in protected:
                    protected_seen += 1
                    continue
                take = min(d, left)
                left -= take
                if ref.pos[k] in ref.hot:
                    want.append((n, take))
                    partial += take < d
            assert got == want
            priced += len(want)
    print(priced, partial, protected_seen, long_paths)
    assert priced > 200 and partial >= 3 and protected_seen > 10  # the cases were exercised
    assert long_paths > 10 if deep else long_paths == 0


def _full(order: object) -> list[tuple[object, int, int]]:
    """Every step of the order."""
    out = []
    while (step := order.at(len(out))) is not None:  # type: ignore[attr-defined]
        out.append(step)
    return out


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
@pytest.mark.parametrize(
    ("seed", "deep", "capped"),
    [(s, False, False) for s in range(4)] + [(s, True, False) for s in range(2)] + [(s, False, True) for s in range(2)],
)
def test_cython_price_equals_reference(seed: int, deep: bool, capped: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`price` (M, each victim's term kept in the order's memo unless told not to; the "text" term by default, from
    the victim's facts kept per node, a caller's term when given): the builds give the same float and keep the
    same memo and facts, call after call, as the window's start moves across the victims' requests and the cost
    model changes; and the float is the terms priced afresh (`victim_term`, or the given one), summed in victim
    order, also where a term not in the memo was priced from facts kept by an earlier call. `capped`: the memo
    and the facts start over at 3 entries (MEMO_CAP), in both builds."""
    rng = random.Random(seed)
    if capped:
        monkeypatch.setattr(lru_order_py, "MEMO_CAP", 3)
    policy = PrebleE2(E2Config.paper(node_window_s=5.0))
    prompts = _prompts(rng, deep)
    fitted = OnlineFit(profile_cost(DEFAULT_PROFILE), min_samples=2)  # no `terms`: its own prefill_s is asked
    for x, y in ((100, 0.02), (900, 0.09), (3000, 0.31)):
        fitted.add_prefill(x, y)
    costs = [profile_cost(name) for name in sorted(PROFILES)[:2]] + [fitted]
    nonzero = kept = from_facts = long_paths = clears = 0
    for _ in drive(policy, rng, prompts, WORKERS, 250, tied_times=True):
        nodes = list(policy.tree.nodes())
        times = sorted({t for n in nodes if isinstance(n.stats, NodeStats) for dq in n.stats.hits.values() for t, _ in dq})
        for v, idx in policy.lru.items():
            ref = lru_order_py.EvictionOrder(idx, v, NodeStats)
            fast = _lru_order_c.EvictionOrder(idx, v, NodeStats)
            if capped:
                fast.memo_cap = 3
            protected = _protected(rng, nodes, 0.5, deep)
            need = rng.choice([4, 20, 80, 10_000])
            term = _alg2_term if rng.random() < 0.25 else None  # a caller's term (one per order, as E2's mode)
            for _ in range(3):
                # a window start at, just before or just after a request's time (a term's bounds), or before all
                cutoff = rng.choice(times) + rng.choice([-1e-3, 0.0, 1e-3]) if times and rng.random() < 0.8 else -1.0
                cost = rng.choice(costs)
                keep = rng.random() < 0.8  # else priced afresh and left out of the memo (a cost fitted online)
                before, facts = dict(ref.memo), dict(ref.facts)
                long_paths += len(protected) > 16
                got = fast.price(need, protected, cutoff, 16, cost, keep, term)
                assert got == ref.price(need, protected, cutoff, 16, cost, keep, term)
                assert (fast.memo, fast.facts) == (ref.memo, ref.facts)
                clears += len(ref.memo) < len(before)
                if not keep:
                    assert ref.memo == before
                want = 0.0
                for n, take in ref.hot_victims(need, protected):
                    if term is None:
                        t = lru_order_py.victim_term(n, take, v, cutoff, 16, cost, NodeStats)[0]
                        was = before.get((id(n), take)) if keep else None
                        f = facts.get(id(n))
                        from_facts += (t is not None and f is not None and f[1] <= cutoff <= f[2]
                                       and (was is None or not was[1] <= cutoff <= was[2] or was[3] is not cost))
                    else:
                        t = term(n, take, v, cutoff, 16, cost)[0]
                    if t is not None:
                        want = want + t
                assert got == want
                nonzero += got > 0
                kept += sum(before.get(k) is x for k, x in ref.memo.items())
    assert nonzero > 50 and kept > 50  # terms were priced, and some came from the memo
    assert from_facts > 10  # and some, not in it, from the facts
    assert long_paths > 10 if deep else long_paths == 0
    assert clears > 10 if capped else clears == 0



def _index_state(policy: PrebleE2) -> dict:  # type: ignore[type-arg]
    """Every LRU index's tables by node creation order (the two policies' nodes are different objects)."""
    seq = {id(n): n.seq for n in policy.tree.nodes()}
    out = {}
    for w, idx in sorted(policy.lru.items()):
        out[w] = (
            sorted((seq.get(k, -1), None if p is None else p.seq) for k, (_, p) in idx.entries.items()),
            sorted((seq.get(k, -1), c) for k, c in idx.held.items()),
            sorted((seq.get(k, -1), la) for k, la in idx.keyed.items()),
            sorted((la, s) for la, s, _ in idx.heap),
            idx._order is None,
        )
    return out


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(6))
def test_cython_touch_holders_equals_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dispatch's reconcile of the holders' indexes (`touch_holders`): the same tables, heaps and dropped
    orders as the reference, with eviction orders simulated part of the way before each step (so dropping
    them is tested), over hook-driven states."""
    from switchyard.router.policies import preble_e2

    calls = {"c": 0, "py": 0}
    moves = {"c": 0, "py": 0}  # calls with a split's lower half

    def counted(impl: str, fn):  # type: ignore[no-untyped-def]
        def run(lru, nodes, moved=None):  # type: ignore[no-untyped-def]
            calls[impl] += 1
            moves[impl] += moved is not None
            return fn(lru, nodes, moved)
        return run

    policies = {impl: PrebleE2(E2Config.paper(node_window_s=5.0)) for impl in ("c", "py")}
    fns = {"c": counted("c", _lru_order_c.touch_holders), "py": counted("py", lru_order_py.touch_holders)}
    drives = {impl: drive(p, random.Random(seed), random_prompts(random.Random(seed), 40, labels=50), WORKERS, 250)
              for impl, p in policies.items()}
    pick = random.Random(seed + 100)
    dropped = 0
    for _ in range(250):
        need = pick.choice([1, 4, 20])
        for impl, p in policies.items():
            for w, idx in sorted(p.lru.items()):  # an order read part of the way, as a select's M leaves it
                idx._order = lru_order.EvictionOrder(idx, w, NodeStats)
                idx._order.reach(need)
            monkeypatch.setattr(preble_e2, "touch_holders", fns[impl])
            next(drives[impl])
        state = _index_state(policies["c"])
        assert state == _index_state(policies["py"])
        dropped += sum(1 for s in state.values() if s[4])
    assert calls["c"] == calls["py"] > 20 and dropped > 0 and moves["c"] == moves["py"] > 0


def _core_state(policy: PrebleE2) -> dict:  # type: ignore[type-arg]
    """`_index_state` with the rest of each index's tables, the heap in array order (an order walks the array, so
    the two builds must lay it out alike) and the cold mass's bucket heap as it is."""
    seq = {id(n): n.seq for n in policy.tree.nodes()}
    out = _index_state(policy)
    for w, idx in policy.lru.items():
        out[w] += (
            [(la, s) for la, s, _ in idx.heap],
            sorted((seq.get(k, -1), c) for k, c in idx.cand.items()),
            dict(idx.bucket_blocks), idx.floor_b, idx.below, list(idx.ahead), set(idx.ahead_set),
        )
    return out


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(6))
def test_cython_index_core_equals_reference(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """E2's LRU index on the Cython core (`_lru_order_c.LruIndexCore`, with that module's `touch_holders`) and on
    the reference build of both, driven by the same hooks and ticks in lockstep: every table, the heap's array,
    the cold mass and which kept orders are dropped stay equal, and M priced on both is the same float."""
    from hook_fuzz import ReferenceLruIndex

    from switchyard.router.policies import preble_e2
    from switchyard.router.policies.preble_load import LruPricing

    class CythonLruIndex(LruPricing, _lru_order_c.LruIndexCore):  # preble_load.LruIndex, whichever build loaded
        __slots__ = ()

    classes = {"c": CythonLruIndex, "py": ReferenceLruIndex}
    policies = {impl: PrebleE2(E2Config.paper(node_window_s=5.0)) for impl in classes}
    clocks = {impl: [0.0] for impl in classes}
    drives = {impl: drive(p, random.Random(seed), random_prompts(random.Random(seed), 40, labels=50), WORKERS, 300,
                          tied_times=True, clock=clocks[impl])
              for impl, p in policies.items()}
    pick = random.Random(seed + 100)
    cost = profile_cost(DEFAULT_PROFILE)
    dropped = ticks = priced = 0
    for _ in range(300):
        need = pick.choice([1, 4, 20])
        tick = pick.random() < 0.3
        for impl, p in policies.items():
            for w, idx in sorted(p.lru.items()):  # an order read part of the way, as a select's M leaves it
                idx._order = lru_order.EvictionOrder(idx, w, NodeStats)
                idx._order.reach(need)
            monkeypatch.setattr(preble_e2, "LruIndex", classes[impl])
            monkeypatch.setattr(preble_e2, "touch_holders",  # the dispatch's reconcile, of the same build
                                (_lru_order_c if impl == "c" else lru_order_py).touch_holders)
            next(drives[impl])
            if tick:
                p.on_tick(clocks[impl][0])  # the cold floor moves (`advance`)
        assert all(type(idx) is classes[impl] for impl, p in policies.items() for idx in p.lru.values())
        state = _core_state(policies["c"])
        assert state == _core_state(policies["py"])
        dropped += sum(1 for s in state.values() if s[4])
        ticks += tick
        now = clocks["c"][0]
        for w in sorted(policies["c"].lru):
            ms = [p.lru[w].eviction_cost(w, need * 5, set(), now, 5.0, 16, cost, "text") for p in policies.values()]
            assert ms[0] == ms[1]
            priced += ms[0] > 0
    assert dropped > 0 and ticks > 50 and priced > 20


@pytest.mark.c_extension
@pytest.mark.skipif(_lru_order_c is None, reason="Cython extension not built")
def test_cython_heaps_stay_out_of_the_collectors_sight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Cython core's heap list is untracked by the cyclic collector when made and when a compaction rebuilds
    it (a full collection would walk every entry: ~7k per worker at 100k preloaded nodes), and what its entries
    hold stays alive through a collection."""
    import dataclasses

    from factories import make_requests
    from hook_fuzz import chained

    from switchyard.router.policies import preble_e2
    from switchyard.router.policies.base import Decision
    from switchyard.router.policies.preble_load import LruPricing
    from switchyard.workers.engine.kv_events import BlockStored, KvEventBatch

    class CythonLruIndex(LruPricing, _lru_order_c.LruIndexCore):
        __slots__ = ()

    monkeypatch.setattr(preble_e2, "LruIndex", CythonLruIndex)
    policy = PrebleE2(E2Config.paper(node_window_s=1e6))
    w = WORKERS[0]
    prompts = [chained([i, 1, 2]) for i in range(100)]  # 100 distinct resident prompts on w
    for i, hashes in enumerate(prompts):
        policy.on_kv_events(w, KvEventBatch(i + 1, float(i), (BlockStored(hashes, None, (), 16),)))
    idx = policy.lru[w]
    assert isinstance(idx, CythonLruIndex) and not gc.is_tracked(idx.heap)
    heaps = {id(idx.heap)}
    base = make_requests(1, prompt_len=48, shared_prefix=0, max_tokens=4)[0]
    for step in range(600):  # the newest ten touched again and again: their old entries pile up under the top
        ctx = dataclasses.replace(base, request_id=f"r{step}", block_hashes=prompts[90 + step % 10])
        policy.on_dispatch(ctx, Decision(worker_id=w), 100.0 + step)
        assert policy.lru[w] is idx and not gc.is_tracked(idx.heap)
        heaps.add(id(idx.heap))
    assert len(heaps) > 1  # compacted at least once (a new list)
    gc.collect()
    assert sorted(e[2].num_blocks for e in idx.heap if idx.keyed.get(id(e[2])) == e[0]) == [3] * 100
