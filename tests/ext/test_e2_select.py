"""E2's bound kernel: the Cython build against the reference, float for float, over policy states built through
E2's hooks, every configuration switch, both memo paths of L, and R's memo past its capacity."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from ext_testlib import NO_EXTENSIONS
from hook_fuzz import drive, random_prompts

from switchyard.ext import e2_select, e2_select_py
from switchyard.router.policies import preble_e2
from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.preble_cost import profile_cost
from switchyard.router.policies.preble_e2 import E2Config, PrebleE2
from switchyard.workers.engine.profiles import PROFILES

try:
    from switchyard.ext import _e2_select_c, _lru_order_c
except ImportError:  # pragma: no cover - test_c_extension_loaded reports it
    _e2_select_c = _lru_order_c = None

WORKERS = [WorkerId(f"w{i}") for i in range(4)]


@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
def test_c_extension_loaded() -> None:
    if NO_EXTENSIONS:
        pytest.skip("SWITCHYARD_NO_EXTENSIONS is set")
    assert _e2_select_c is not None, "switchyard.ext._e2_select_c did not build or import"
    assert e2_select.IMPLEMENTATION == "c"
    assert e2_select.raw_bounds is _e2_select_c.raw_bounds
    # M on the Cython build's eviction orders is a C call into it (`_lru_order_c.PRICE_C`), not `order.price`
    assert _e2_select_c.c_priced_order_type() is _lru_order_c.EvictionOrder
    assert _e2_select_c.c_read_index_type() is _lru_order_c.LruIndexCore  # and M's early exit reads it in C
    from switchyard.ext import _anticipator_c

    # the fill level reads each Cython anticipator's D_in with a C call (`_anticipator_c.DECODE_IN_C`)
    assert _e2_select_c.c_decode_in_type() is _anticipator_c.Anticipator
    # the policy keeps the records whose fields the selects read in C
    assert e2_select.Outstanding is _e2_select_c.Outstanding is preble_e2.Outstanding


@dataclass
class View:
    """What the kernel reads of a worker view."""

    worker_id: WorkerId
    kv_usage_frac: float
    block_size: int
    kv_capacity_blocks: int


@dataclass
class Facts:
    block_size: int
    kv_capacity_blocks: int


class HotLru:
    """An LRU index with nothing cold: M must always be simulated (`m_is_zero` is False)."""

    heap = [None]
    floor_b = None
    below = 0
    cand: dict[int, tuple[float, int]] = {}

    def cold_blocks(self, protected: set[int]) -> int:
        return 0


def _m_of(i: int, evict: int) -> float:
    """A stand-in M, a fixed function of (worker index, blocks to evict)."""
    return ((i * 7919 + evict) % 13) * 0.01


def _pricer(asked: list[tuple[int, int]]) -> Callable[[int, int], float]:
    """`_m_of`, recording each question in `asked`."""

    def price(i: int, evict: int) -> float:
        asked.append((i, evict))
        return _m_of(i, evict)

    return price


def _record(rng: random.Random, queued_s: float, queued_tokens: int) -> object:
    """An outstanding record with this queued work, of either build at random: the Cython build's (its fields
    read in C by the selects) or the reference's (read through its attributes)."""
    rec = (_e2_select_c.Outstanding if rng.random() < 0.5 else e2_select_py.Outstanding)()  # type: ignore[union-attr]
    rec.queued_s, rec.queued_tokens = queued_s, queued_tokens
    return rec


def _envs(
    policy: PrebleE2, facts: dict, flags: dict, rng: random.Random  # type: ignore[type-arg]
) -> tuple[object, object]:
    """(reference env, Cython env) over the same policy dicts (its outstanding records copied, each of either
    build: `_record`); cost models vary per worker (R's memo keys)."""
    models = [profile_cost(name) for name in PROFILES]
    outstanding = {w: _record(rng, o.queued_s, o.queued_tokens) for w, o in policy.outstanding.items()}
    kw = dict(
        cost_memo={}, cost_model=lambda w: models[int(w[1:]) % len(models)], facts=facts, lru=policy.lru,
        resident_count=policy.resident_count, outstanding=outstanding, load_memo=policy._load_memo,
        load_s=policy.load_s, window_s=policy.cfg.history_window_s, **flags,
    )
    return e2_select_py.BoundsEnv(**kw), _e2_select_c.BoundsEnv(**kw)  # type: ignore[union-attr]


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(6))
def test_cython_bounds_equal_reference(seed: int) -> None:
    rng = random.Random(seed)
    # a short H, so L's memo expires between steps; a short W, so the cold floors move and M's early exit is taken
    policy = PrebleE2(E2Config(history_window_s=2.0, node_window_s=3.0))
    prompts = random_prompts(rng, 40, labels=50)
    clock = [0.0]
    seen = {"evict": 0, "queued": 0, "memo_miss": 0, "many_r": 0, "no_facts": 0, "pruned": 0, "m_asked": 0,
            "m_cold": 0, "later_piece": 0, "c_record": 0, "ref_record": 0}
    for step in drive(policy, rng, prompts, WORKERS, 300, clock=clock):
        if step % 3:
            continue
        if step % 5 == 0:
            policy.advance_cold(clock[0])  # as on_tick: the cold floors that `m_is_zero` reads
        if step % 4 == 0:
            for w in WORKERS:  # as on_tick and on_finish: L's memo with pieces ahead
                policy.load_s(w, clock[0], 2)
        now = clock[0] + rng.choice([0.0, 0.5, 3.0])
        path = policy.tree.match(rng.choice(prompts)).path  # the protected nodes
        # every other step beyond the driven workers: unknown ones (no history, no LRU, no facts), up to 40 for R's
        # memo; else only driven ones (with LRU indexes, so M is asked)
        ids = rng.sample(range(40), rng.randint(1, 40)) if step % 2 else rng.sample(range(4), rng.randint(1, 4))
        ws = [View(WorkerId(f"w{i}"), rng.random(), rng.choice([1, 2, 16]), rng.randint(1, 40)) for i in ids]
        facts = {v.worker_id: Facts(rng.choice([1, 16]), rng.randint(1, 40)) for v in ws if rng.random() < 0.7}
        seen["no_facts"] += len(ws) - len(facts)
        cached = {v.worker_id: rng.randint(0, 12) for v in ws}
        n = rng.choice([0, 1, 5, 16, 64, 200])
        turn = rng.randint(-50, 10**6)
        flags = dict(evict_on=rng.random() < 0.8, assume_full=rng.random() < 0.3, with_l=rng.random() < 0.8,
                     with_q=rng.random() < 0.8)
        ref_env, c_env = _envs(policy, facts, flags, rng)
        seen["memo_miss"] += sum(1 for v in ws if v.worker_id not in policy._load_memo)
        seen["later_piece"] += sum(1 for v in ws if (mm := policy._load_memo.get(v.worker_id)) and mm[0] <= now
                                   and now - policy.cfg.history_window_s > mm[1]
                                   and any(now - policy.cfg.history_window_s <= t for t in mm[3::2]))
        got = _e2_select_c.raw_bounds(c_env, ws, cached, n, now)  # type: ignore[union-attr]
        want = e2_select_py.raw_bounds(ref_env, ws, cached, n, now)
        assert got == want
        assert [tuple(map(type, t)) for t in got] == [tuple(map(type, t)) for t in want]
        # the branch and bound: the same answer, the same M asked in the same order, and the exact argmin of
        # (L + M + R + Q, rotated index) over every worker with M priced for all
        asked_c: list[tuple[int, int]] = []
        asked_py: list[tuple[int, int]] = []
        got_best = _e2_select_c.cheapest(  # type: ignore[union-attr]
            c_env, ws, cached, n, now, turn, _pricer(asked_c), path)
        assert got_best == e2_select_py.cheapest(ref_env, ws, cached, n, now, turn, _pricer(asked_py), path)
        assert asked_c == asked_py
        # M is 0 where the LRU index says so before simulating (`m_is_zero`), else the stand-in
        zero = [t[3] > 0 and e2_select_py.m_is_zero(policy.lru[v.worker_id], path, t[3])
                for v, t in zip(ws, want, strict=True)]
        assert [_e2_select_c.m_is_zero(policy.lru[v.worker_id], path, t[3])  # type: ignore[union-attr]
                for v, t in zip(ws, want, strict=True) if t[3] > 0] == [z for z, t in zip(zero, want, strict=True)
                                                                         if t[3] > 0]
        full = [(load + (_m_of(j, ev) if ev > 0 and not zero[j] else 0.0) + r + q, (j - turn) % len(ws), j)
                for j, (load, r, q, ev) in enumerate(want)]
        assert got_best[0] == min(full)[2]
        seen["pruned"] += len(got_best[1]) < len(ws)
        seen["m_asked"] += len(asked_c) > 0
        seen["m_cold"] += sum(1 for v, z in zip(ws, zero, strict=True) if z and policy.lru[v.worker_id].heap)
        seen["evict"] += sum(1 for t in want if t[3] > 0)
        seen["queued"] += sum(1 for t in want if t[2] > 0)
        for v, t in zip(ws, want, strict=True):
            if t[2] > 0:  # Q read from a record of either build
                o = c_env.outstanding[v.worker_id]  # type: ignore[attr-defined]
                seen["ref_record" if type(o) is e2_select_py.Outstanding else "c_record"] += 1
        seen["many_r"] += len({(cached[v.worker_id], facts[v.worker_id].block_size if v.worker_id in facts
                                else v.block_size, int(v.worker_id[1:]) % len(PROFILES)) for v in ws}) > 16
    assert all(seen.values()), seen  # every path was exercised


@pytest.mark.parametrize("mod", ["py", "c"])
def test_bounds_price_each_term(mod: str) -> None:
    """A worked case: L from the memo, R from the cost model, Q from the outstanding record, and the eviction
    need against free blocks (capacity minus the larger of resident blocks and KV usage)."""
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")

    class Cost:
        def prefill_s(self, missed: int, cached: int) -> float:
            return missed * 0.001 + cached * 0.0001

    class Out:
        queued_s = 0.25

    cost = Cost()
    w0, w1 = WorkerId("a"), WorkerId("b")
    env = impl.BoundsEnv(
        cost_memo={w0: cost, w1: cost}, cost_model=lambda w: cost, facts={w0: Facts(16, 10)}, lru={w0: HotLru()},
        resident_count={w0: 8}, outstanding={w1: Out()}, load_memo={w0: (5.0, 4.0, 1.5)},
        load_s=lambda w, now: 9.0, window_s=3.0, evict_on=True, assume_full=False, with_l=True, with_q=True,
    )
    ws = [View(w0, 0.5, 16, 10), View(w1, 0.0, 16, 10)]
    # w0: 2 of 5 blocks cached -> 48 missed tokens = 3 blocks, 10 - max(8, 5) = 2 free -> evicts 1; L memo holds
    # at now=6 (5 <= 6 and 6 - 3 <= 4). w1 holds all 5 blocks, but the last token is always computed: 1 missed.
    got = impl.raw_bounds(env, ws, {w0: 2, w1: 5}, 80, 6.0)
    assert got == [(1.5, 48 * 0.001 + 32 * 0.0001, 0.0, 1), (9.0, 1 * 0.001 + 79 * 0.0001, 0.25, 0)]
    assert impl.raw_bounds(env, ws[:1], {w0: 2}, 80, 7.5)[0][0] == 9.0  # 7.5 - 3 > 4: the memo expired
    # later pieces of L's memo: from valid_from 5 on, L_j for the first j with now - 3 <= t_j; before 5, asked
    env.load_memo[w0] = (5.0, 4.0, 1.5, 6.0, 1.2, math.inf, 0.7)
    assert [impl.raw_bounds(env, ws[:1], {w0: 2}, 80, now)[0][0] for now in (7.0, 8.5, 9.5, 4.5)] == [1.5, 1.2, 0.7, 9.0]
    # the branch and bound, nothing cached: w0's bound 1.5 + R + 0 is below w1's 9.0 + R + 0.25, and w0 would
    # evict 3 blocks (5 needed, 2 free), so M is asked of w0 first; with M = 0.5 w0 wins and w1, whose bound is
    # above w0's total, is never priced; with M = 10 w1 is priced too and wins
    r0 = 80 * 0.001 + 0 * 0.0001
    asked: list[tuple[int, int]] = []
    got = impl.cheapest(env, ws, {w0: 0, w1: 0}, 80, 6.0, 1, lambda i, ev: asked.append((i, ev)) or 0.5, [])
    assert got == (0, [(0, 1.5, 0.5, r0, 0.0)]) and asked == [(0, 3)]
    got = impl.cheapest(env, ws, {w0: 0, w1: 0}, 80, 6.0, 1, lambda i, ev: 10.0, [])
    assert got == (1, [(0, 1.5, 10.0, r0, 0.0), (1, 9.0, 0.0, r0, 0.25)])
    with pytest.raises(ValueError, match="no worker"):
        impl.cheapest(env, [], {}, 80, 6.0, 1, lambda i, ev: 0.0, [])


@pytest.mark.parametrize("mod", ["py", "c"])
def test_m_is_zero_follows_the_lru_early_exits(mod: str) -> None:
    """M is 0 without a simulation when the LRU index has no candidates, or when its cold candidates (keyed
    before the floor), less those on the prompt's own path, cover the need; then `cheapest` does not ask."""
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")
    from switchyard.router.policies.preble_load import LruIndex

    mine, other = object(), object()  # nodes: one cold candidate on the prompt's path, one warm
    lru = LruIndex()
    assert impl.m_is_zero(lru, [mine], 1)  # no candidates at all
    lru.heap = [(1.0, 0, mine)]
    assert not impl.m_is_zero(lru, [mine], 1)  # no cold floor yet: cold_blocks = 0
    lru.floor_b, lru.below, lru.cand = 5, 10, {id(mine): (3, 4), id(other): (6, 2)}
    assert impl.m_is_zero(lru, [mine], 6) and not impl.m_is_zero(lru, [mine], 7)  # 10 - 4 on the path
    assert impl.m_is_zero(lru, [other], 10) and not impl.m_is_zero(lru, [other], 11)  # warm: not subtracted
    assert lru.cold_blocks({id(mine)}) == 6  # the reference reads LruIndex's own rule

    class Free:
        def prefill_s(self, missed: int, cached: int) -> float:
            return 0.0

    a = WorkerId("a")
    env = impl.BoundsEnv(
        cost_memo={a: Free()}, cost_model=lambda w: Free(), facts={}, lru={a: lru}, resident_count={a: 10},
        outstanding={}, load_memo={}, load_s=lambda w, now: 0.0, window_s=1.0, evict_on=True, assume_full=False,
        with_l=True, with_q=True,
    )
    asked: list[tuple[int, int]] = []
    ws = [View(a, 1.0, 16, 10)]  # full: 96 tokens = 6 blocks to evict
    assert impl.cheapest(env, ws, {a: 0}, 96, 0.0, 0, _pricer(asked), [mine]) == (0, [(0, 0.0, 0.0, 0.0, 0.0)])
    assert asked == []
    assert impl.cheapest(env, ws, {a: 0}, 112, 0.0, 0, _pricer(asked), [mine])[1][0][2] == _m_of(0, 7)
    assert asked == [(0, 7)]


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(4))
def test_cython_exploit_set_equals_reference(seed: int) -> None:
    rng = random.Random(seed)
    shapes = set()
    for _ in range(400):
        ids = [WorkerId(f"w{i}") for i in range(rng.randint(1, 20))]
        by_id = {w: View(w, 0.0, 16, 10) for w in ids}
        cached = {w: rng.randint(0, 6) for w in ids}
        key_end = rng.randint(0, 6)
        others = ids + [WorkerId("gone"), WorkerId("left")]  # redirect targets and replicas outside the pool
        redirect = rng.choice([None, {}, {w: (rng.choice(others), rng.choice([1.0, 2.0, 3.0]))
                                          for w in rng.sample(ids, rng.randint(1, len(ids)))}])
        replicas = rng.choice([None, {}, {w: rng.choice([1.0, 2.0, 3.0]) for w in rng.sample(others, 3)
                                          if len(others) >= 3}])
        want = e2_select_py.exploit_set(cached, key_end, by_id, redirect, replicas, 2.0)
        got = _e2_select_c.exploit_set(cached, key_end, by_id, redirect, replicas, 2.0)  # type: ignore[union-attr]
        assert [id(v) for v in got] == [id(v) for v in want]
        shapes.add((bool(redirect), bool(replicas), len(want) > 0))
    assert len(shapes) >= 6  # with and without redirects and replicas, empty and not


@pytest.mark.parametrize("mod", ["py", "c"])
def test_exploit_set_applies_redirects_and_replicas(mod: str) -> None:
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")
    a, b, c, d = (WorkerId(x) for x in "abcd")
    views = {w: View(w, 0.0, 16, 10) for w in (a, b, c, d)}
    cached = {a: 4, b: 1, c: 3, d: 0}  # key portion ends at block 3: a and c hold it
    assert impl.exploit_set(cached, 3, views, None, None, 5.0) == [views[a], views[c]]
    # a's traffic redirected to d (live), c's to b (expired); replicas: b live, a (already in), "x" not routable
    got = impl.exploit_set(cached, 3, views, {a: (d, 6.0), c: (b, 4.0)}, {b: 5.0, a: 9.0, "x": 9.0}, 5.0)
    assert got == [views[d], views[c], views[b], views[a]]
    assert impl.exploit_set(cached, 5, views, {}, {b: 9.0}, 5.0) == []  # replicas only widen a holder set


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
def test_bench_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`switchyard bench e2-select` times both builds on E2's own calls, and leaves E2 as it found it (with the
    reference forced, E2 has no Cython call to time: the bench says so and exits 2)."""
    from switchyard.bench.micro import e2_select as bench
    from switchyard.router.policies import preble_e2

    if e2_select.IMPLEMENTATION != "c":
        assert bench.main(["--out", str(tmp_path)]) == 2
        return
    before = preble_e2.exploit_set, preble_e2.cheapest, preble_e2.select_e2
    args = ["--runs", "toolbench-200:400,videoqa-1500:200", "--preload-nodes", "0", "--out", str(tmp_path),
            "--no-plot"]
    assert bench.main(args) == 0
    assert (preble_e2.exploit_set, preble_e2.cheapest, preble_e2.select_e2) == before
    rows = json.loads((tmp_path / "e2_select.json").read_text())["rows"]
    assert {(r["workload"], r["op"]) for r in rows} == {
        (w, op) for w in ("toolbench-200", "videoqa-1500") for op in ("exploit_set", "cheapest")}
    assert all(r["calls"] > 0 and 0 < r["c_p50_us"] <= r["c_p99_us"] for r in rows)


@pytest.mark.parametrize("mod", ["py", "c"])
def test_cheapest_ties_go_to_the_lower_rotated_index(mod: str) -> None:
    """Equal LOADCOSTs: the worker earlier in the rotation wins, also when the later one was priced (its bound
    below the best total) and reached the tie only through its M."""
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")

    class Free:
        def prefill_s(self, missed: int, cached: int) -> float:
            return 0.0

    a, b = WorkerId("a"), WorkerId("b")
    env = impl.BoundsEnv(
        cost_memo={a: Free(), b: Free()}, cost_model=lambda w: Free(), facts={}, lru={a: HotLru(), b: HotLru()},
        resident_count={a: 10, b: 10}, outstanding={}, load_memo={a: (0.0, 0.0, 1.0), b: (0.0, 0.0, 1.5)},
        load_s=lambda w, now: 0.0, window_s=1.0, evict_on=True, assume_full=False, with_l=True, with_q=True,
    )
    ws = [View(a, 1.0, 16, 10), View(b, 1.0, 16, 10)]
    ms = {0: 1.0, 1: 0.5}  # a: 1.0 + 1.0 = 2.0; b: 1.5 + 0.5 = 2.0, priced since 1.5 < 2.0
    best, priced = impl.cheapest(env, ws, {a: 0, b: 0}, 32, 0.0, 0, lambda i, ev: ms[i], [])
    assert [p[0] for p in priced] == [0, 1] and best == 0  # rotated indices 0 and 1: a
    best, priced = impl.cheapest(env, ws, {a: 0, b: 0}, 32, 0.0, 1, lambda i, ev: ms[i], [])
    assert [p[0] for p in priced] == [0, 1] and best == 1  # turn 1: b's rotated index is 0


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
def test_two_decimals_is_formats_text() -> None:
    """P/D's reason shows its ratio as `format(ratio, ".2f")` (`select_steps`); the Cython build takes ratios in
    [0, 1] from a table, rounded half to even in integers: the same text at each hundredth and each midpoint between
    two and the floats around them, at decode fractions d / (d + q), at random floats, at the extremes, and past
    [0, 1]."""
    assert _e2_select_c is not None
    xs: list[float] = []
    for k in range(201):
        for toward in (-1.0, 2.0):
            x = k / 200
            for _ in range(4):
                xs.append(x)
                x = math.nextafter(x, toward)
    xs += [d / (d + q) for d in range(1, 300) for q in range(0, 3000, 37)]
    rng = random.Random(5)
    xs += [rng.random() for _ in range(20_000)]
    xs += [0.0, -0.0, 5e-324, 1e-300, 0.005, 0.015, 0.125, 0.375, 0.995, 1.0, 1.5, -0.5, 2.675, 1e300]
    xs += [math.nan, math.inf, -math.inf]
    assert [_e2_select_c.two_decimals(x) for x in xs] == [format(x, ".2f") for x in xs]


# ---------------------------------------------------------------------------------------------- the default policy
@dataclass
class SyView:
    """What the default policy's bound pass reads of a worker view."""

    worker_id: WorkerId
    block_size: int


class FitCost:
    """A cost model without `terms` (as `OnlineFit`): the Cython build must ask it, not price it in C."""

    def __init__(self, k: float) -> None:
        self.k = k

    def prefill_s(self, missed: int, cached: int) -> float:
        return self.k * (0.002 + missed * 1e-4 + missed * cached * 1e-9)

    def decode_s(self, num_tokens: float, context_tokens: float) -> float:
        return num_tokens * self.k * (0.01 + context_tokens * 1e-7)

    def decode_marginal_s(self, num_tokens: float, context_tokens: float) -> float:
        return num_tokens * self.k * (1e-4 + context_tokens * 1e-8)


@dataclass
class Queued:
    queued_s: float
    queued_tokens: int


def _argmin_envs(rng: random.Random, ids: list[int]) -> tuple[object, object, dict[WorkerId, int]]:
    """(reference env, Cython env, batched tokens per worker) over one random state: profile and fitted cost
    models, queued prefills (some over B, some not), queued requests, both queue pricings and both
    `joint_prefill` settings."""
    models: list[object] = [profile_cost(name) for name in PROFILES] + [FitCost(1.0), FitCost(3.0)]
    by_worker = {WorkerId(f"w{i}"): rng.choice(models) for i in ids}
    memo = {w: c for w, c in by_worker.items() if rng.random() < 0.6}  # the rest through cost_model
    outstanding = {w: _record(rng, rng.choice([0.0, -1e-12, rng.random()]), rng.choice([0, 0, 16, 500, 3000, 9000]))
                   for w in by_worker if rng.random() < 0.7}
    queued = {w: {f"{w}-q{k}": SimpleNamespace(prompt_tokens=rng.randint(1, 8000), kv_prompt_tokens=0,
                                             predicted_tokens=rng.randint(1, 600)) for k in range(rng.randint(0, 6))}
              for w in by_worker if rng.random() < 0.7}
    batched = {w: rng.choice([512, 2048, 8192]) for w in by_worker}
    kw = dict(
        cost_memo=memo, cost_model=by_worker.__getitem__, outstanding=outstanding, queued=queued,
        batched_tokens=lambda v: batched[v.worker_id], queue_weight=rng.choice([0.0, 1.0, 0.7]),
        prefix_weight=rng.choice([1.0, 0.5]), decode_weight=rng.choice([1.0, 0.0]),
        interference_weight=rng.choice([0.1, 0.0, 0.25]), queue_by_sum=rng.random() < 0.3,
        joint_prefill=rng.random() < 0.7, externality_weight=rng.choice([0.1, 0.0, 1.0]),
        interference_term_weight=rng.choice([1.0, 0.0, 2.5]), behind_weight=rng.choice([1.0, 0.0, 0.5]),
        window_s=rng.choice([10.0, 60.0]),
    )
    return e2_select_py.ArgminEnv(**kw), _e2_select_c.ArgminEnv(**kw), batched  # type: ignore[union-attr]


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(4))
def test_cython_argmin_bounds_equal_reference(seed: int) -> None:
    """The default policy's bound pass: the Cython build returns the reference's floats and order, over random
    states that take every branch (queued tokens that fit beside r in one iteration and that do not, "sum"
    queue pricing, fitted cost models priced through Python, ties in the bounds broken by the rotation)."""
    rng = random.Random(seed)
    seen = {"joint": 0, "chunked": 0, "interference": 0, "fit": 0, "tie": 0, "by_sum": 0, "c_record": 0,
            "ref_record": 0}
    for _ in range(300):
        ids = rng.sample(range(40), rng.randint(1, 20))
        ref_env, c_env, batched = _argmin_envs(rng, ids)
        pool = [SyView(WorkerId(f"w{i}"), rng.choice([1, 16, 32])) for i in ids]
        if rng.random() < 0.3:  # identical workers: equal bounds, ordered by the rotation alone
            pool = [SyView(pool[0].worker_id, pool[0].block_size)] * len(pool)
        cached = {v.worker_id: rng.choice([0, 0, 3, 40, 500]) for v in pool}
        p, d, turn = rng.choice([1, 2, 17, 700, 5000]), rng.choice([1, 2, 50, 900]), rng.randint(-5, 10**6)
        got = _e2_select_c.argmin_bounds(c_env, pool, cached, p, d)  # type: ignore[union-attr]
        want = e2_select_py.argmin_bounds(ref_env, pool, cached, p, d)
        assert got == want and all(type(x) is float for x in got)
        assert _e2_select_c.argmin_order(c_env, pool, cached, p, d, turn) == e2_select_py.argmin_order(  # type: ignore[union-attr]
            ref_env, pool, cached, p, d, turn)
        for v in pool:
            o = ref_env.outstanding.get(v.worker_id)  # type: ignore[attr-defined]
            if o is not None and (o.queued_s > 0 or o.queued_tokens > 0):  # read from a record of either kind
                seen["c_record" if type(o) is _e2_select_c.Outstanding else "ref_record"] += 1  # type: ignore[union-attr]
            if o is not None and o.queued_tokens > 0 and not ref_env.queue_by_sum:  # type: ignore[attr-defined]
                fits = o.queued_tokens + p <= batched[v.worker_id]
                seen["joint" if fits and ref_env.joint_prefill else "chunked"] += 1  # type: ignore[attr-defined]
            seen["interference"] += bool(ref_env.queued.get(v.worker_id))  # type: ignore[attr-defined]
            seen["fit"] += isinstance(ref_env.cost_model(v.worker_id), FitCost)  # type: ignore[attr-defined]
        seen["tie"] += len(set(want)) < len(want)
        seen["by_sum"] += ref_env.queue_by_sum  # type: ignore[attr-defined]
    assert all(seen.values()), seen


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(3))
def test_cython_head_terms_equal_reference(seed: int) -> None:
    """The default policy's per-worker terms before M, O and W: the Cython build returns the reference's floats
    and ints (and the reference's `decode_in`, D_in alone, the same float), over random states that take every
    branch (no co-runners, running and queued ones shorter and longer than the request, queued tokens joint with
    r's and chunked, "sum" pricing, prefill loads idle, under and over 1 with and without a measured span, fitted
    cost models priced through Python)."""
    rng = random.Random(100 + seed)
    seen = {"co": 0, "alone": 0, "joint": 0, "chunked": 0, "by_sum": 0, "loaded": 0, "over": 0, "span": 0}
    for _ in range(1500):
        ids = rng.sample(range(40), 1)
        ref_env, c_env, batched = _argmin_envs(rng, ids)
        v = SyView(WorkerId(f"w{ids[0]}"), rng.choice([1, 16, 32]))
        cost = ref_env.cost_model(v.worker_id)  # type: ignore[attr-defined]
        running = [(rng.randint(1, 900), rng.randint(1, 60_000)) for _ in range(rng.choice([0, 0, 1, 5, 40]))]
        queued = [(px := rng.randint(1, 20_000), rng.randint(0, px), rng.randint(1, 900))
                  for _ in range(rng.choice([0, 0, 1, 3]))]
        p, d = rng.choice([1, 2, 17, 700, 5000]), rng.choice([1, 2, 50, 900])
        cached = rng.choice([0, 0, 3, 40, 500])
        load, r, q = rng.choice([0.0, rng.random()]), rng.random(), rng.choice([0.0, rng.random()])
        rho = rng.choice([0.0, -0.1, 0.3, 0.95, 1.0, 2.5])
        span = rng.choice([None, None, 0.5, 30.0])
        arrivals = rng.choice([0.0, 3.0, 40.0])
        args = (v, cost, running, queued, p, d, cached, load, r, q, arrivals, rho, span)
        got = _e2_select_c.head_terms(c_env, *args)  # type: ignore[union-attr]
        want = e2_select_py.head_terms(ref_env, *args)  # type: ignore[arg-type]
        assert got == want and [type(x) for x in got] == [type(x) for x in want], (got, want)
        # D_in alone (the definition the anticipator's `decode_in` sums for the fill level): the same float
        assert e2_select_py.decode_in(running, queued, p, d, cost) == want[2]
        o = ref_env.outstanding.get(v.worker_id)  # type: ignore[attr-defined]
        if o is not None and o.queued_tokens > 0 and not ref_env.queue_by_sum:  # type: ignore[attr-defined]
            fits = o.queued_tokens + want[6] <= batched[v.worker_id]
            seen["joint" if fits and ref_env.joint_prefill else "chunked"] += 1  # type: ignore[attr-defined]
        seen["co" if running or queued else "alone"] += 1
        seen["by_sum"] += ref_env.queue_by_sum  # type: ignore[attr-defined]
        seen["loaded"] += 0.0 < rho < 1.0 and arrivals > 0.0
        seen["over"] += rho >= 1.0
        seen["span"] += span is not None and rho > 0.0
    assert all(seen.values()), seen


@pytest.mark.parametrize("mod", ["py", "c"])
def test_water_level_fills_the_lowest_values_first(mod: str) -> None:
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")
    assert impl.water_level([5.0, 0.0, 1.0], 3.0) == 2.0  # 0 and 1 filled to 2 (2 + 1 = 3); 5 stays above
    assert impl.water_level([5.0, 0.0, 1.0], 0.0) == 0.0  # nothing poured: the lowest
    assert impl.water_level([5.0, 0.0, 1.0], 12.0) == 6.0  # over every value: their mean + 12 / 3
    assert impl.water_level([1.0, 1.0, 4.0], 2.0) == 2.0  # equal values fill together
    assert impl.water_level([0.2], 0.1) == pytest.approx(0.3)
    assert impl.water_level([], 1.0) == 0.0


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(3))
def test_cython_fill_level_equals_reference(seed: int) -> None:
    """The default policy's fill level: the Cython build returns the reference's float over random pools (each
    worker's map with running records, overrun and capped ones, its queued requests, profile and fitted cost
    models from the memo or through `cost_model`, with either anticipator build), and L is the water level of
    the workers' D_self + `decode_in` values with F on the worker of the least of them (in any pool order), the
    floor L less the largest D_self (at least 0)."""
    from switchyard.ext import _anticipator_c, anticipator_py

    rng = random.Random(200 + seed)
    seen = {"queued": 0, "records": 0, "idle": 0, "fit": 0, "raised": 0, "c_ants": 0, "py_ants": 0}
    for _ in range(200):
        ids = rng.sample(range(40), rng.randint(1, 16))
        ref_env, c_env, _ = _argmin_envs(rng, ids)
        pool = [SyView(WorkerId(f"w{i}"), 16) for i in ids]
        mod = rng.choice([_anticipator_c, anticipator_py])
        seen["c_ants" if mod is _anticipator_c else "py_ants"] += 1
        ants, queued = [], ref_env.queued  # type: ignore[attr-defined]
        assert c_env.queued is queued  # type: ignore[attr-defined]
        for v in pool:
            a = mod.Anticipator(10**6, max_len=rng.choice([64, 4096]))
            for k in range(rng.choice([0, 0, 1, 4, 30])):
                p = rng.randint(1, 8000)
                a.add(f"{v.worker_id}-{k}", rng.randint(0, p), rng.randint(0, 600), p)
                if rng.random() < 0.2:
                    a.advance_to(a.iteration + rng.randint(1, 200))
            ants.append(a)
            seen["records"] += len(a) > 0
            seen["queued"] += bool(queued.get(v.worker_id))
            seen["fit"] += isinstance(ref_env.cost_model(v.worker_id), FitCost)  # type: ignore[attr-defined]
        p, d = rng.choice([1, 17, 700, 5000]), rng.choice([1, 2, 50, 900])
        rate = rng.choice([0.0, 0.5, 12.0, 300.0])
        got = _e2_select_c.fill_level(c_env, pool, ants, p, d, rate)  # type: ignore[union-attr]
        want = e2_select_py.fill_level(ref_env, pool, ants, p, d, rate)  # type: ignore[arg-type]
        assert got == want and type(got) is tuple and all(type(x) is float for x in got)
        costs = [ref_env.cost_model(v.worker_id) for v in pool]  # type: ignore[attr-defined]
        d_self = [c.decode_s(d, p + (d - 1) / 2) for c in costs]
        d_in = [a.decode_in(queued.get(v.worker_id, {}), d, c) for v, a, c in zip(pool, ants, costs, strict=True)]
        totals = [s + i for s, i in zip(d_self, d_in, strict=True)]
        q = totals.index(min(totals))  # F on the worker the arrivals fill first
        f = rate * d_self[q] * costs[q].decode_marginal_s(max(1, d // 2), p + d // 2)
        level = e2_select_py.water_level(totals, f)
        assert want == (level, max(0.0, level - max(d_self)))
        # the order the workers joined in does not matter (the pool reversed, each with its map)
        assert _e2_select_c.fill_level(c_env, pool[::-1], ants[::-1], p, d, rate) == want  # type: ignore[union-attr]
        seen["idle"] += min(d_in) == 0.0
        seen["raised"] += want[1] > min(d_in)
        seen["mixed"] = seen.get("mixed", 0) + (len(set(d_self)) > 1)
    assert all(seen.values()) and "mixed" in seen, seen
    with pytest.raises(ValueError):
        _e2_select_c.fill_level(c_env, pool, ants[:-1], 10, 10, 1.0)  # type: ignore[union-attr]
    assert _e2_select_c.fill_level(c_env, [], [], 10, 10, 1.0) == (0.0, 0.0)  # type: ignore[union-attr]


@pytest.mark.parametrize("mod", ["py", "c"])
def test_head_terms_price_each_term(mod: str) -> None:
    """A worked case: Q from the chunked queued prefill plus the batch's decode marginal over k + 1.5 iterations,
    D_self, D_co over a running and a queued co-runner, I and B from r's step gain, each weighted."""
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")
    cost = FitCost(1.0)
    a = WorkerId("a")
    env = impl.ArgminEnv(
        cost_memo={}, cost_model=lambda w: cost, outstanding={a: Queued(0.3, 3000)}, queued={a: {"x": None}},
        batched_tokens=lambda v: 2048, queue_weight=1.0, prefix_weight=1.0, decode_weight=0.5,
        interference_weight=0.1, queue_by_sum=False, joint_prefill=True, externality_weight=0.1,
        interference_term_weight=2.0, behind_weight=1.0, window_s=10.0,
    )
    running, queued = [(100, 4000)], [(1200, 1000, 30)]  # (remaining, context); (prompt, private prompt, D)
    p, d, load, r = 800, 11, 0.25, cost.prefill_s(800, 0)
    got = impl.head_terms(env, SyView(a, 16), cost, running, queued, p, d, 0, load, r, 0.0, 4.0, 0.5, None)
    # 3000 queued tokens > B: k = 2 chunks of 1500, then the two co-runners' mean context over 2 + 1.5 iterations
    queue = 2 * cost.prefill_s(1500, 0) + 3.5 * cost.decode_marginal_s(2, (4000 + 1200) / 2)
    d_self = cost.decode_s(11, 805.0)
    # running: m = min(11, 100) = 11 shared iterations; queued: min(11, 30) = 11, as (30, 1200)
    d_in = (cost.decode_marginal_s(11, 11 * (4000 + 5.0) / 11) + cost.decode_marginal_s(11, 11 * (1200 + 5.0) / 11))
    d_out = 2 * cost.decode_marginal_s(11, 11 * (800 + 5.0) / 11)
    gain = r - cost.prefill_s(0, 0)  # 3000 + 800 > B: r's prefill runs after them
    backlog = queue + r
    busy = max(backlog, backlog / (1 - 0.5)) if backlog < 10.0 * 0.5 else backlog
    want = (queue, d_self, d_in, d_out, 2 * gain, 4.0 * busy * gain, 800, load + queue + r,
            0.5 * (d_self + d_in + 0.1 * d_out), 0.1 * (2.0 * 2 * gain + 1.0 * 4.0 * busy * gain))
    assert got == pytest.approx(want, rel=1e-12)
    assert got[6] == 800 and type(got[6]) is int
    assert e2_select_py.decode_in(running, queued, p, d, cost) == got[2]  # D_in alone, the same float


@pytest.mark.parametrize("mod", ["py", "c"])
def test_argmin_bounds_price_each_term(mod: str) -> None:
    """A worked case: R and D_self from the cost model, Q from the queued prefill (chunked, and joint with r's),
    I from the queued requests, each weighted."""
    impl = e2_select_py if mod == "py" else _e2_select_c
    if impl is None:
        pytest.skip("Cython extension not built")
    cost = FitCost(1.0)
    a, b, c = WorkerId("a"), WorkerId("b"), WorkerId("c")
    out = {a: Queued(0.3, 3000), b: Queued(0.2, 100)}
    env = impl.ArgminEnv(
        cost_memo={}, cost_model=lambda w: cost, outstanding=out, queued={b: {"x": None, "y": None}}, batched_tokens=lambda v: 2048,
        queue_weight=1.0, prefix_weight=1.0, decode_weight=0.5, interference_weight=0.1, queue_by_sum=False,
        joint_prefill=True, externality_weight=0.1, interference_term_weight=1.0, behind_weight=1.0, window_s=10.0,
    )
    pool = [SyView(a, 16), SyView(b, 16), SyView(c, 16)]
    p, d = 800, 11
    cached = {a: 0, b: 10, c: 100}  # c holds more than the prompt: its last token is still computed
    r = [cost.prefill_s(800, 0), cost.prefill_s(640, 160), cost.prefill_s(1, 799)]
    d_self = cost.decode_s(11, 805.0)
    # a: 3000 queued tokens > B: 2 chunks of 1500; b: 100 + 640 <= B, run with r's: PT(740) - PT(640), and its two
    # queued requests each delayed by what r's 640 tokens add to that iteration plus r's attention over its cache
    q_a = 2 * cost.prefill_s(1500, 0)
    q_b = cost.prefill_s(740, 0) - cost.prefill_s(640, 0)
    gain_b = cost.prefill_s(740, 0) - cost.prefill_s(100, 0) + r[1] - cost.prefill_s(640, 0)
    want = [q_a + r[0] + 0.5 * d_self + 0.1 * 0.0, q_b + r[1] + 0.5 * d_self + 0.1 * (2 * gain_b),
            0.0 + r[2] + 0.5 * d_self + 0.1 * 0.0]
    assert impl.argmin_bounds(env, pool, cached, p, d) == want
    order = impl.argmin_order(env, pool, cached, p, d, 1)
    assert [i for _, _, i in order] == sorted(range(3), key=lambda i: want[i])
    assert {(i, rot) for _, rot, i in order} == {(0, 2), (1, 0), (2, 1)}  # (i - 1) mod 3


@pytest.mark.c_extension
@pytest.mark.skipif(_e2_select_c is None, reason="Cython extension not built")
def test_cython_co_residency_equals_reference() -> None:
    """D_co, DECODETIME, the marginal decode cost and PREFILLTIME: the Cython build returns the reference's floats (profile
    cost models in C, others asked), over random batches: empty, co-runners shorter and longer than the request,
    contexts up to 100k tokens, float mean contexts."""
    rng = random.Random(7)
    models: list[object] = [profile_cost(name) for name in PROFILES] + [FitCost(2.0)]
    for _ in range(2000):
        cost = rng.choice(models)
        batch = [(rng.randint(1, 900), rng.randint(0, 100_000)) for _ in range(rng.choice([0, 1, 3, 40]))]
        p, d = rng.randint(1, 20_000), rng.randint(1, 800)
        got = _e2_select_c.co_residency(batch, p, d, cost)  # type: ignore[union-attr]
        assert got == e2_select_py.co_residency(batch, p, d, cost) and all(type(x) is float for x in got)
        n, ctx = rng.choice([0, 1, 7, 300]), rng.choice([rng.uniform(0, 50_000), float(rng.randint(0, 9))])
        assert _e2_select_c.decode_marginal(cost, n, ctx) == cost.decode_marginal_s(n, ctx)  # type: ignore[union-attr, attr-defined]
        assert _e2_select_c.decode(cost, d, p + (d - 1) / 2) == cost.decode_s(d, p + (d - 1) / 2)  # type: ignore[union-attr, attr-defined]
        missed, held = rng.choice([0, 1, 300, 9000]), rng.choice([0, 16, 4000])
        assert _e2_select_c.prefill(cost, missed, held) == cost.prefill_s(missed, held)  # type: ignore[union-attr, attr-defined]
    assert _e2_select_c.co_residency([], 5, 5, models[0]) == (0.0, 0.0)  # type: ignore[union-attr]
