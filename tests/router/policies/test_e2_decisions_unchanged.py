"""E2's select shortcuts against the straightforward code they replace: each shortcut must give exactly (bit for
bit) what the plain version gives, so no decision changes.

A replay of the `bench decisions` model (bench/micro/decisions.py: KV events, first tokens, finishes, Stats and
ticks in virtual time) with small KV caches, so evictions, eviction pricing, rebalancing redirects and
replication all happen, runs a `PrebleE2` subclass that recomputes every shortcut the plain way at every select.
Unit tests cover the per-worker moved-load table and the cost model's memo.
"""

from __future__ import annotations

import builtins
import dataclasses
import logging
import math
import random
import re
from collections import deque
from typing import Any

import pytest
from hook_fuzz import ReferenceLruIndex

import switchyard.bench.micro.decisions as bench
from switchyard.bench.sim import SimConfig, Simulator
from switchyard.bench.workloads import WorkloadSpec, make_workload
from switchyard.ext import e2_select, e2_select_py, lru_order, lru_order_py, radix, radix_py
from switchyard.ext.e2_select import Priced
from switchyard.router.policies import preble_e2, preble_load, registry
from switchyard.router.policies.base import Decision, FleetView, RoutingContext, WorkerId, WorkerView
from switchyard.router.policies.preble_cost import ProfileCost
from switchyard.router.policies.preble_e2 import Cost, E2Config, PrebleE2
from switchyard.router.policies.preble_load import (
    HistoryEntry,
    LruIndex,
    LruPricing,
    MovedLoad,
    NodeStats,
    eviction_cost_s,
    load_from_sums,
    lru_victims,
)
from switchyard.workers.engine.perf_model import pairs_for_prompt
from switchyard.workers.engine.profiles import PROFILES, get_profile

IMPLS = ["py", pytest.param("c", marks=pytest.mark.c_extension)] if radix.IMPLEMENTATION == "c" else ["py"]


class CheckedE2(PrebleE2):
    """PrebleE2 that asserts, at every select, that each shortcut equals the plain computation (L unmemoised,
    victims by the full scan of `lru_victims`)."""

    checks: dict[str, int]

    def __init__(self, config: E2Config | None = None) -> None:
        super().__init__(config)
        self.checks = {"select": 0, "fused": 0, "off_path": 0, "match": 0, "exploit_set": 0, "argmin": 0,
                       "loadcosts": 0, "pruned": 0, "m": 0}
        self.costed: list[int] = []  # the blocks `LruPricing.eviction_cost` was asked to evict, as patched below

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        """The build's select (the Cython build's fused `select_e2`) equals the steps below, each checked against
        the plain code, and asks its Ms (`_evict_s`, fused in C) for the same blocks in the same order; every 10th
        select also with a worker excluded and the DEBUG line on (the fused select's calls back into the policy),
        where the lines logged must be the same too."""
        self.checks["select"] += 1
        needs = self.recent_needs  # what each M was asked to evict (the fused select prices M in C)
        before = list(needs)
        needs.clear()
        self.costed.clear()
        got = super().select(ctx, fleet, now)
        fused = list(needs)
        assert self.costed == fused  # each M went through the test's `eviction_cost`, the fused select's too
        if preble_e2.select_e2 is not e2_select_py.select_e2:  # the reference is the steps themselves
            needs.clear()
            assert got == self.select_steps(ctx, fleet, now)
            assert list(needs) == fused  # the same Ms, in the same order
            self.checks["fused"] += 1
            self.checks["m"] += len(fused)
            if self.checks["fused"] % 10 == 0:
                alt = dataclasses.replace(ctx, excluded_workers=frozenset({fleet.routable(ctx.model)[0].worker_id}))
                assert _logged(lambda: super(CheckedE2, self).select(alt, fleet, now)) == _logged(
                    lambda: self.select_steps(alt, fleet, now))
                self.checks["off_path"] += 1
        needs.clear()
        needs.extend(before + fused)  # as the select alone leaves them
        return got

    def prefix(self, ctx: RoutingContext, pool: list[WorkerView]) -> tuple[dict[WorkerId, int], int, list[Any]]:
        cached, best, path = super().prefix(ctx, pool)
        hashes = ctx.block_hashes
        m = self.tree.match(hashes) if hashes else None
        plain = {w.worker_id: self._cached_blocks(w.worker_id, m, hashes) if m else 0 for w in pool}
        assert list(cached.items()) == list(plain.items())  # same values, same (pool) order
        assert [id(n) for n in path] == [id(n) for n in (m.path if m else [])]
        assert best == max(plain.values(), default=0)
        self.checks["match"] += 1
        return cached, best, path

    def _exploit_set(
        self, key: Any, key_end: int, pool: list[WorkerView], cached: dict[WorkerId, int], now: float
    ) -> list[WorkerView]:
        got = super()._exploit_set(key, key_end, pool, cached, now)
        # the plain version: every holder, redirects applied, replicas added, duplicates dropped
        by_id = {w.worker_id: w for w in pool}
        ks = [w.worker_id for w in pool if key is not None and cached[w.worker_id] >= key_end]
        st = key.stats if key is not None else None
        if isinstance(st, NodeStats):
            for i, wid in enumerate(ks):
                light, until = st.redirect.get(wid, ("", -1.0))
                if until >= now and light in by_id:
                    ks[i] = WorkerId(light)
            if ks:
                ks += [WorkerId(r) for r, until in st.replicas.items() if until >= now and r in by_id]
        assert got == [by_id[w] for w in dict.fromkeys(ks)]
        self.checks["exploit_set"] += 1
        return got

    def _cheapest(
        self, ws: list[WorkerView], ctx: RoutingContext, cached: dict[WorkerId, int], path: list[Any], now: float
    ) -> tuple[WorkerView, list[Priced]]:
        got, raw = super()._cheapest(ws, ctx, cached, path, now)
        asked, costed = list(self.recent_needs), len(self.costed)
        priced = self._costs(ws, raw)
        full = self.loadcosts(ws, ctx, cached, path, now)  # every worker priced, M included (checked below)
        self.recent_needs.clear()
        self.recent_needs.extend(asked)  # the select's Ms, not this check's (`select` compares them)
        del self.costed[costed:]
        n = len(ws)
        plain = min(
            ((w, i) for i, w in enumerate(ws)),
            key=lambda wi: (full[wi[0].worker_id].total_s, (wi[1] - self._turn) % n),
        )[0]
        assert got is plain  # branch and bound picks the argmin of the full costs
        assert all(full[wid] == c for wid, c in priced.items()) and got.worker_id in priced
        self.checks["argmin"] += 1
        self.checks["pruned"] += n - len(priced)
        return got, raw

    def loadcosts(
        self,
        ws: list[WorkerView],
        ctx: RoutingContext,
        cached: dict[WorkerId, int],
        path: list[Any],
        now: float,
    ) -> dict[WorkerId, Cost]:
        got = super().loadcosts(ws, ctx, cached, path, now)
        plain = {w.worker_id: self.loadcost(w, ctx, cached[w.worker_id], path, now) for w in ws}
        assert list(got.items()) == list(plain.items())
        for w in ws:  # and the terms the plain way: R unmemoised, L with the moves summed from scratch
            c, wid = got[w.worker_id], w.worker_id
            bs = w.block_size
            tok = min(cached[wid] * bs, max(0, ctx.num_prompt_tokens - 1))
            assert c.prefill_s == _plain_prefill_s(self.cost_model(wid), ctx.num_prompt_tokens - tok, tok)
            cfg = self.cfg
            if cfg.load_signal != "outstanding":  # L from the sums, not WorkerHistory's memo
                h = self.history.get(wid)
                marginal = cfg.decode_pricing == "marginal"
                base = load_from_sums(*h.live_sums(now), self.cost_model(wid), marginal) if h is not None else 0.0
                assert c.load_s == base + self.moved_load.sum_s(wid, now - cfg.history_window_s)
            else:
                assert c.load_s == 0.0
            assert c.queue_s == (self.queue_s(wid) if cfg.load_signal != "history" else 0.0)
            m = 0.0  # M over the full-scan victims
            if cfg.eviction_cost != "off" and wid in self.lru:
                cap = w.kv_capacity_blocks
                used = max(self.resident_count.get(wid, 0), int(w.kv_usage_frac * cap))
                need = -(-(ctx.num_prompt_tokens - tok) // bs)
                evict = need if cfg.assume_full else need - max(0, cap - used)
                if evict > 0:
                    victims = lru_victims(wid, self.tree.nodes(), evict, {id(n) for n in path})
                    m = eviction_cost_s(victims, wid, now, cfg.node_window_s, bs, self.cost_model(wid), cfg.eviction_cost)
            assert c.evict_s == m
        self.checks["loadcosts"] += 1
        return got


class _Lines(logging.Handler):
    """Keeps the messages logged through it, DEBUG and up."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged(call: Any) -> tuple[Any, list[str]]:
    """(call(), the lines E2 logged during it) with E2's logger at DEBUG."""
    logger, handler = preble_e2.log, _Lines()
    lines = handler.lines
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        got = call()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert lines  # every select logs its decision at DEBUG
    return got, lines


def _plain_prefill_s(cost: Any, missed: int, cached: int) -> float:
    if not isinstance(cost, ProfileCost):
        return float(cost.prefill_s(missed, cached))
    e = max(0, missed)
    return cost.profile.iteration_time_s(e, pairs_for_prompt(e, max(0, cached)), 0, 0)


CONFIGS = {
    "e2": {},
    "paper_alg2": {
        "load_signal": "history",
        "decode_ratio": "hit_ratio",
        "pd_pick": "argmax",
        "decode_pricing": "single",
        "eviction_cost": "alg2",
    },
    "overflow_full": {"exploit_overflow": True, "assume_full": True, "key_portion": "longest"},
    "rebal_eager": {
        "rebalance_min_requests_per_worker": 1,
        "rebalance_threshold": 1.05,
        "replication_ttft_factor": 1.1,
        "history_window_s": 30.0,
    },
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("workload", ["videoqa-1500", "toolbench-200"])
def test_select_shortcuts_equal_plain_code(
    workload: str, config: str, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """300 requests over 6 workers with caches of 1500 (videoqa, ~620-block prompts) or 300 (toolbench) blocks:
    every select's match, exploit set, LOADCOSTs, eviction victims and argmin equal the plain versions, and the
    Cython build's fused select equals those steps."""
    monkeypatch.setattr(preble_e2, "RadixTree", radix_py.RadixTree if impl == "py" else radix.RadixTree)
    monkeypatch.setattr(preble_load, "EvictionOrder", lru_order_py.EvictionOrder if impl == "py" else lru_order.EvictionOrder)
    monkeypatch.setattr(preble_e2, "LruIndex", ReferenceLruIndex if impl == "py" else LruIndex)
    # every other ext/ structure E2 calls, the reference builds too ("py"): the kernel's M exits, R and the
    # L memo's pieces, and the dispatch's holder touches
    monkeypatch.setattr(preble_e2, "touch_holders", lru_order_py.touch_holders if impl == "py" else lru_order.touch_holders)
    kernel = e2_select_py if impl == "py" else e2_select
    for name in ("BoundsEnv", "SelectEnv", "cheapest", "exploit_set", "raw_bounds", "select_e2"):
        monkeypatch.setattr(preble_e2, name, getattr(kernel, name))
    made: list[CheckedE2] = []
    num_victims = 0

    def checked_victims(
        idx: LruIndex, worker: Any, need_blocks: int, protected: set[int]
    ) -> list[tuple[Any, int]]:
        got = fast_victims(idx, worker, need_blocks, protected)
        want = lru_victims(worker, made[0].tree.nodes(), need_blocks, protected)  # the full scan
        assert [(id(n), k) for n, k in got] == [(id(n), k) for n, k in want]
        return got

    priced = {"hot": 0, "fresh": 0}  # victims the fast path priced; of them, priced afresh (not from its memo)

    def checked_cost(idx: LruIndex, worker: Any, need_blocks: int, protected: set[int], *args: Any) -> float:
        nonlocal num_victims
        made[0].costed.append(need_blocks)
        before = dict(idx._order.memo) if idx._order is not None else {}
        got = fast_cost(idx, worker, need_blocks, protected, *args)
        if idx._order is not None:
            priced["hot"] += len(idx._order.hot_victims(need_blocks, protected))
            priced["fresh"] += sum(before.get(k) is not v for k, v in idx._order.memo.items())  # new or replaced
        victims = checked_victims(idx, worker, need_blocks, protected)  # the order it bisects, listed
        assert got == eviction_cost_s(victims, worker, *args)
        num_victims += len(victims)
        return got

    fast_victims, fast_cost = LruPricing.victims, LruPricing.eviction_cost
    monkeypatch.setattr(LruPricing, "eviction_cost", checked_cost)

    def make(name: str) -> CheckedE2:
        made.append(CheckedE2(E2Config(**CONFIGS[config])))
        return made[-1]

    monkeypatch.setattr(bench, "make_bench_policy", make)
    wl = bench.WORKLOADS[workload]
    small = bench.WorkloadDef(wl.name, wl.make, wl.profile, 1500 if workload.startswith("videoqa") else 300)
    bench.run_one(bench.prepare(small, 300, seed=1), small, "checked", 6)
    policy = made[0]
    assert policy.checks["select"] == 300
    if impl == "c":  # the fused select, against the steps; and off its default path
        assert (policy.checks["fused"], policy.checks["off_path"]) == (300, 30)
        assert policy.checks["m"] > 0  # the fused select priced M
        assert policy.checks["match"] == 300 + 30  # the steps (the fused select walks the prompt in C)
    else:
        assert policy.checks["match"] == 300
    assert policy.checks["loadcosts"] > 0 and policy.checks["argmin"] > 0  # the cost paths ran
    assert policy.checks["pruned"] > 0  # and the bound skipped some workers
    assert num_victims > 0  # eviction pricing ran
    assert priced["hot"] > priced["fresh"] > 0  # some victims' terms came from the memo, and matched
    if config == "rebal_eager":
        assert policy.num_redirects > 0  # the exploit set's redirect path ran


@pytest.mark.parametrize("seed", [3, 4])
def test_moved_load_sums_as_one_flat_list(seed: int) -> None:
    """`MovedLoad.sum_s` equals summing the flat (t, worker, Δ) list the old code kept, filtered, in order, and
    `first_t` (read from `sum_s`'s memo when it holds) is that list's oldest move at or after the cutoff; seed 4
    also adds moves out of time order."""
    rng = random.Random(seed)
    moved, flat = MovedLoad(), deque[tuple[float, str, float]]()
    workers = ["w0", "w1", "w2"]
    now = 0.0
    for _ in range(500):
        now += rng.random()
        op = rng.random()
        if op < 0.6:
            w, d = rng.choice(workers), rng.uniform(-1, 1) * 10 ** rng.randint(-3, 3)
            t = now - rng.random() * 3 if seed == 4 and rng.random() < 0.1 else now
            moved.add(t, w, d)
            flat.append((t, w, d))
        elif op < 0.8:
            if seed == 4:  # expiry pops each worker's oldest moves: out of order, not the flat list's head
                continue
            cutoff = now - 20.0
            moved.expire(cutoff)
            while flat and flat[0][0] < cutoff:
                flat.popleft()
        elif op < 0.82:
            w = rng.choice(workers)
            moved.drop(w)
            flat = deque(x for x in flat if x[1] != w)
        for w in workers:
            cutoff = now - rng.choice([5.0, 20.0, 30.0])
            first = min((t for t, x, _ in flat if x == w and t >= cutoff), default=math.inf)
            if rng.random() < 0.5:
                assert moved.first_t(w, cutoff) == first  # before `sum_s`: no memo for this cutoff yet
            assert moved.sum_s(w, cutoff) == sum(d for t, x, d in flat if x == w and t >= cutoff)
            assert moved.first_t(w, cutoff) == first
            cutoff += rng.random() * 2  # a later cutoff: the memo holds while it stays before its first move
            assert moved.first_t(w, cutoff) == min((t for t, x, _ in flat if x == w and t >= cutoff), default=math.inf)


@pytest.mark.parametrize("unordered", [False, True])
def test_load_memo_pieces_equal_l_from_scratch(unordered: bool) -> None:
    """The pieces of L a hook memoises ahead (`load_s(w, now, ahead)`: the next expiries of entries and moves)
    are, bit for bit, L priced from scratch at a time inside each piece, and a select there reads the memo."""
    rng = random.Random(11)
    policy = PrebleE2(E2Config(history_window_s=10.0))
    w = WorkerId("w0")
    hist = policy.history[w] = preble_load.WorkerHistory(10.0)
    hist.on_change = lambda: policy._drop_load_memo(w)
    policy.moved_load.on_change = policy._drop_load_memo
    for i, t in enumerate([1.0, 2.0, 2.0, 4.0, 6.0, 8.5]):
        hist.add(HistoryEntry(t, f"r{i}", rng.uniform(0.01, 2.0), rng.randint(10, 900), rng.randint(1, 300)))
    for t in ([1.5, 3.0, 5.0, 7.0] if not unordered else [3.0, 1.5, 5.0]):
        policy.moved_load.add(t, w, rng.uniform(-0.5, 0.5))
    cost, marginal = policy.cost_model(w), policy.cfg.decode_pricing == "marginal"

    def scratch(now: float) -> float:
        cutoff = now - 10.0
        moves = sum(d for t, d in policy.moved_load.by_worker[w] if t >= cutoff)
        return load_from_sums(*hist.live_sums(now), cost, marginal) + moves

    v = policy.load_s(w, 11.5)  # as on_dispatch leaves it: one piece
    assert len(policy._load_memo[w]) == 3
    policy.load_s(w, 11.5, 20)  # a hook asking for pieces ahead extends it, to the same value
    memo = policy._load_memo[w]
    assert memo[2] == v
    if unordered:  # a move out of time order: one piece, until the oldest live entry or move expires
        assert memo == (11.5, 1.5, scratch(11.5))
        assert policy.load_s(w, 11.5, 20) == v and policy._load_memo[w] is memo  # not priced again per tick
        return
    assert policy.load_s(w, 11.5, 20) == v and policy._load_memo[w] is memo  # enough pieces: read, not priced
    cuts = memo[1::2]
    assert cuts == (1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.5, math.inf)  # entries' and moves' times, merged
    assert memo[2] == scratch(11.5)
    for prev, t, want in zip(cuts[:-1], cuts[1:], memo[4::2], strict=True):
        now = ((prev + t) / 2 if t < math.inf else prev + 1.0) + 10.0
        assert want == scratch(now) == policy.load_s(w, now)
        assert policy._load_memo[w] is memo  # read from the memo, not priced again


def test_profile_cost_formulas_are_exact() -> None:
    """PREFILLTIME / DECODETIME (the iteration-time formula written out) equal `PerfProfile.iteration_time_s`
    bit for bit, for every profile's constants."""
    for name in PROFILES:
        _check_profile_cost(ProfileCost(get_profile(name)))


def _check_profile_cost(cost: ProfileCost) -> None:
    it = cost.profile.iteration_time_s
    rng = random.Random(5)
    for _ in range(400):
        missed, cached = rng.randint(-5, 40) * 16, rng.randint(0, 20) * 16
        n, ctx = rng.choice([0, 0.5, 3.0, 17.25, 1, 40]), rng.choice([rng.uniform(0, 9000), rng.randint(0, 200_000)])
        e = max(0, missed)
        assert cost.prefill_s(missed, cached) == it(e, pairs_for_prompt(e, max(0, cached)), 0, 0)
        assert cost.decode_s(n, ctx) == (n * it(0, 0, 1, int(ctx)) if n > 0 else 0.0)
        c = int(ctx)
        assert cost.decode_marginal_s(n, ctx) == (
            n * max(0.0, it(0, 0, 2, 2 * c) - it(0, 0, 1, c)) if n > 0 else 0.0
        )
    assert cost == ProfileCost(cost.profile) and hash(cost) == hash(
        ProfileCost(cost.profile)
    )  # the constants are not compared


@pytest.mark.c_extension
def test_the_fused_select_prices_m_as_the_steps() -> None:
    """The Cython select reads M from the worker's eviction order itself (`_e2_select_c._evict_s`): on a fleet that
    evicts, every select's DEBUG line (each priced worker's L, M, R) and the blocks each M was asked to evict
    equal those of `select_steps`, which prices M through `_evict_s` and `LruPricing.eviction_cost`."""
    if e2_select.IMPLEMENTATION != "c":
        pytest.fail("the Cython build of ext/e2_select did not load")
    spec = WorkloadSpec(rate=40.0, num_requests=200, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)
    lines: list[str] = []

    class Both(PrebleE2):
        def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
            needs = self.recent_needs
            before = list(needs)
            needs.clear()
            got, fused = _logged(lambda: super(Both, self).select(ctx, fleet, now))
            asked = list(needs)
            needs.clear()
            assert _logged(lambda: self.select_steps(ctx, fleet, now)) == (got, fused)
            assert list(needs) == asked
            needs.clear()
            needs.extend(before + asked)
            lines.extend(fused)
            return got

    pol = Both(E2Config(node_window_s=2.0))  # a window shorter than the run: M's terms count its requests
    cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
    Simulator(make_workload(spec, seed=2), cfg, policy=pol).run()
    assert pol._select_env.fused_ms > 0  # M was read from the orders in C
    assert any(re.search(r"M=(?!0\.000 )", ln) for ln in lines)  # and some M was not 0


def test_the_fused_select_calls_an_evict_s_patched_on_the_policy() -> None:
    """The Cython select prices M from the worker's eviction order itself, but an `_evict_s` patched on the policy
    instance (a wrapper, a stub) is the one asked: with every M it answers made dear, the decisions follow it."""
    spec = WorkloadSpec(rate=40.0, num_requests=200, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)

    def simulate(patch: bool) -> tuple[int, list[tuple[str, str]]]:
        pol = PrebleE2()
        asked = 0
        own = pol._evict_s

        def dear(w: WorkerView, evict: int, now: float, protected: set[int]) -> float:
            nonlocal asked
            asked += 1
            return own(w, evict, now, protected) + (1e3 if w.worker_id == "w1" else 0.0)

        if patch:
            pol._evict_s = dear  # type: ignore[method-assign]
        cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
        res = Simulator(make_workload(spec, seed=2), cfg, policy=pol).run()
        return asked, sorted((r.request_id, r.worker_id) for r in res.records)

    asked, picks = simulate(True)
    assert asked > 0
    assert picks != simulate(False)[1]  # w1 made dear wherever it would evict


@pytest.mark.c_extension
def test_the_fused_select_asks_an_index_class_of_its_own_beside_fused_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """One worker's LRU index is a subclass that overrides `eviction_cost` (M made dear), the others' are the
    class M is read from in C. A select that prices both asks the subclass for its M even after a fused one (the
    select checks each index class it meets, not only the first): the decisions equal a run with every M asked
    through the policy's `_evict_s`."""
    if e2_select.IMPLEMENTATION != "c":
        pytest.fail("the Cython build of ext/e2_select did not load")
    spec = WorkloadSpec(rate=40.0, num_requests=200, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)
    asked = 0

    class Dear(preble_load.LruIndex):
        __slots__ = ()

        def eviction_cost(self, *args: Any) -> float:
            nonlocal asked
            asked += 1
            return super().eviction_cost(*args) + 1e3

    def simulate(through_python: bool) -> tuple[int, list[tuple[str, str]]]:
        made: list[object] = []

        def index() -> object:  # the second worker to store blocks gets the dear index
            made.append((Dear if len(made) == 1 else preble_load.LruIndex)())
            return made[-1]

        monkeypatch.setattr(preble_e2, "LruIndex", index)
        pol = PrebleE2()
        if through_python:
            pol._evict_s = pol._evict_s  # type: ignore[method-assign]  # on the instance: no M is read in C
        cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
        res = Simulator(make_workload(spec, seed=2), cfg, policy=pol).run()
        assert any(type(i) is Dear for i in pol.lru.values())
        return pol._select_env.fused_ms, sorted((r.request_id, r.worker_id) for r in res.records)

    fused_ms, picks = simulate(False)
    assert fused_ms > 0 and asked > 0  # Ms read in C, and the dear index asked, in one run
    asked_fused, asked = asked, 0
    assert simulate(True) == (0, picks)
    assert asked == asked_fused  # the dear index was asked for every M it was asked for through Python


@pytest.mark.parametrize("how", ["instance", "subclass"])
def test_the_fused_select_calls_a_protected_of_the_policys_own(how: str) -> None:
    """The Cython select builds the ids M protects (the prompt's matched nodes) in C, but a `_protected` patched on
    the policy or overridden by a subclass is the one asked, at every select that prices M."""
    spec = WorkloadSpec(rate=40.0, num_requests=200, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)
    asked = 0

    def counted(path: list[Any]) -> set[int]:
        nonlocal asked
        asked += 1
        return PrebleE2._protected(path)

    class Own(PrebleE2):
        @staticmethod
        def _protected(path: list[Any]) -> set[int]:
            return counted(path)

    pol = Own() if how == "subclass" else PrebleE2()
    if how == "instance":
        pol._protected = counted  # type: ignore[method-assign]
    cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
    Simulator(make_workload(spec, seed=2), cfg, policy=pol).run()
    assert asked > 0


def test_decisions_do_not_depend_on_memory_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction-order ties (requests prefilled in one engine iteration store their blocks in KV events of one
    timestamp) break by the nodes' creation order, not by id(): a simulation in which every id() the policy and
    its eviction bookkeeping see is negated (a stand-in for nodes at other addresses, which a test cannot arrange
    reliably) prices the same M and places every request on the same worker."""

    spec = WorkloadSpec(rate=40.0, num_requests=300, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)

    def simulate(flip: bool) -> list[Any]:
        priced: list[Any] = []

        class Recording(PrebleE2):
            def _evict_s(self, w: WorkerView, evict: int, now: float, protected: set[int]) -> float:
                got = super()._evict_s(w, evict, now, protected)
                priced.append((w.worker_id, evict, got))
                return got

            @staticmethod
            def _protected(path: list[Any]) -> set[int]:  # the module's id(), flipped too (the fused select's own
                return PrebleE2._protected(path)  # are pointers, built in C)

        with monkeypatch.context() as m:
            m.setitem(registry.POLICIES, "e2", Recording)
            # the reference eviction order, whose id() can be replaced (the Cython build's ids are pointers; the
            # twin test in tests/ext/test_lru_order.py holds it to the reference step for step)
            m.setattr(preble_load, "EvictionOrder", lru_order_py.EvictionOrder)
            m.setattr(preble_e2, "LruIndex", ReferenceLruIndex)  # and the reference index (its ids are id())
            if flip:  # every id() of the policy and its eviction bookkeeping reversed in order (still unique)
                for module in (preble_e2, preble_load, lru_order_py):
                    m.setattr(module, "id", lambda o: -builtins.id(o), raising=False)
            cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
            res = Simulator(make_workload(spec, seed=2), cfg).run()
        assert any(x[2] > 0 for x in priced)  # M was priced, and not always 0
        return [priced, sorted((r.request_id, r.worker_id) for r in res.records)]

    assert simulate(False) == simulate(True)


@pytest.mark.parametrize("fused", [pytest.param(True, marks=pytest.mark.c_extension), False])
def test_decisions_are_kept_per_worker_and_reason_up_to_a_cap(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Decision is immutable, so `_decide` (and the fused select's) keeps one per (worker, reason), P/D's reasons
    with their ratio too: each pair is one object all run long. At `DECISIONS_CAP` entries the memo starts over,
    so ratios cannot grow it without bound; the decisions stay the same."""
    if fused and e2_select.IMPLEMENTATION != "c":
        pytest.fail("the Cython build of ext/e2_select did not load")
    spec = WorkloadSpec(rate=40.0, num_requests=200, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)

    def simulate() -> tuple[list[Decision], int]:
        most = 0

        class Kept(PrebleE2):
            def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
                nonlocal most
                got = super().select(ctx, fleet, now) if fused else self.select_steps(ctx, fleet, now)
                most = max(most, len(self._decisions))
                made.append(got)
                return got

        made: list[Decision] = []
        cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
        Simulator(make_workload(spec, seed=2), cfg, policy=Kept()).run()
        return made, most

    made, most = simulate()
    by_pair: dict[tuple[str, str], set[int]] = {}
    for d in made:
        by_pair.setdefault((d.worker_id, d.reason), set()).add(id(d))
    assert any(why.startswith("explore P/D ratio=") for _, why in by_pair)
    assert all(len(ids) == 1 for ids in by_pair.values())  # one object per (worker, reason)
    assert most == len(by_pair) > 3
    monkeypatch.setattr(preble_e2, "DECISIONS_CAP", 3)
    capped, most = simulate()
    assert most == 3
    assert capped == made  # equal Decisions: the memo only saves building them


@pytest.mark.c_extension
def test_the_fused_select_follows_the_loggers_level_as_it_changes() -> None:
    """The fused select reads whether DEBUG is on from the logger's own memo of `isEnabledFor` (a False there is the
    answer; else the logger is asked): a level set between selects, or a logger disabled while its memo says DEBUG,
    is followed at the very next select."""
    if e2_select.IMPLEMENTATION != "c":
        pytest.fail("the Cython build of ext/e2_select did not load")
    spec = WorkloadSpec(rate=40.0, num_requests=120, prompt_len="lognormal:512:0.4", output_len="lognormal:32:0.5",
                        prefix_groups=24, prefix_len=256)
    logger, handler = preble_e2.log, _Lines()
    lines = handler.lines
    level = logger.level
    logged: list[int] = []

    class Toggled(PrebleE2):
        def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
            step = len(logged) % 5  # WARNING twice (the memo holds False), DEBUG twice (then True), disabled
            if step == 0:
                logger.setLevel(logging.WARNING)
            elif step == 2:
                logger.setLevel(logging.DEBUG)
            logger.disabled = step == 4
            before = len(lines)
            got = super().select(ctx, fleet, now)
            logged.append(len(lines) - before)
            assert logged[-1] == (1 if step in (2, 3) else 0), step
            return got

    logger.addHandler(handler)
    try:
        cfg = SimConfig(policy="e2", num_workers=3, engine_overrides={"num_kv_blocks": 300})
        Simulator(make_workload(spec, seed=2), cfg, policy=Toggled()).run()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.disabled = False
    assert len(logged) == 120
