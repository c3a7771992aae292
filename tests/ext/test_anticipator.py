"""The per-worker load anticipator: specs/preserve.md §10 claims 1-6 as worked examples on both builds, a
from-scratch recount, and a state machine that runs the reference and the Cython build side by side."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
from ext_testlib import NO_EXTENSIONS, impl_params
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from switchyard.ext import anticipator, anticipator_py, e2_select_py
from switchyard.router.policies.preble_cost import profile_cost
from switchyard.workers.engine.profiles import PROFILES

try:
    from switchyard.ext import _anticipator_c
except ImportError:  # pragma: no cover - test_c_extension_loaded reports it
    _anticipator_c = None


@pytest.fixture(params=impl_params(_anticipator_c))
def impl(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return anticipator_py if request.param == "py" else _anticipator_c


@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
def test_c_extension_loaded() -> None:
    if NO_EXTENSIONS:
        pytest.skip("SWITCHYARD_NO_EXTENSIONS is set")
    assert _anticipator_c is not None, "switchyard.ext._anticipator_c did not build or import"
    assert anticipator.IMPLEMENTATION == "c"
    assert anticipator.Anticipator is _anticipator_c.Anticipator


def recount(a, rids) -> list[int]:  # type: ignore[no-untyped-def]
    """U[0..max_len) in tokens from the records alone (spec §5.3's per-request formula, two difference arrays):
    U[j] = sum over r with j < end_r - iteration of (P_r + generated_r + j)."""
    it, n = a.iteration, a.max_len
    const, slope = [0] * (n + 1), [0] * (n + 1)
    for rid in rids:
        p, start, _d, end = a.record(rid)
        m = min(end - it, n)
        if m > 0:
            const[0] += p + (it - start)
            const[m] -= p + (it - start)
            slope[0] += 1
            slope[m] -= 1
    out, c, s = [], 0, 0
    for j in range(n):
        c += const[j]
        s += slope[j]
        out.append(c + s * j)
    return out


def full(a) -> list[int]:  # type: ignore[no-untyped-def]
    return a.load_tokens(a.max_len)


# ---- claim 1: add on an empty map ----------------------------------------------------------------------------


def test_add_on_empty_map(impl) -> None:  # type: ignore[no-untyped-def]
    a = impl.Anticipator(1000, max_len=16)
    a.add("r", 100, 5)
    # holds P + i = 100 + i tokens at offset i < D = 5, nothing from offset 5 on
    assert a.load_tokens(8) == [100, 101, 102, 103, 104, 0, 0, 0]
    assert [a.occupancy(j) for j in range(6)] == [0.1, 0.101, 0.102, 0.103, 0.104, 0.0]
    assert a.occupancy(16) == 0.0 and a.occupancy(10**30) == 0.0  # beyond the map
    assert a.peak(100) == 0.104 and a.peak(3) == 0.102 and a.peak(0) == 0.0
    assert a.resident_tokens() == 100 and a.remaining_decode_tokens() == 5
    assert len(a) == 1 and "r" in a and "x" not in a
    assert a.record("r") == (100, 0, 5, 5) and a.generated("r") == 0
    # a prediction beyond max_len is capped: offsets 0..15 only
    b = impl.Anticipator(1000, max_len=16)
    b.add("long", 10, 50)
    assert full(b) == [10 + j for j in range(16)] and b.record("long") == (10, 0, 50, 16)
    assert b.load_tokens(10**6) == full(b)  # the horizon clamps to the map


# ---- claim 2: superposition ---------------------------------------------------------------------------------


def test_superposition(impl) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(2)
    for _ in range(20):
        reqs = [(f"r{i}", rng.randint(0, 500), rng.randint(0, 80), rng.randint(0, 30)) for i in range(6)]
        split = rng.randint(1, 5)
        maps = [impl.Anticipator(10_000, max_len=64) for _ in range(3)]  # A alone, B alone, A + B
        groups = [reqs[:split], reqs[split:], reqs]
        for t in range(31):  # add each request at its own iteration, overruns included
            for m, g in zip(maps, groups, strict=True):
                m.advance_to(t)
                for rid, p, d, at in g:
                    if at == t:
                        m.add(rid, p, d)
            a, b, ab = (full(m) for m in maps)
            assert ab == [x + y for x, y in zip(a, b, strict=True)]
            assert maps[2].remaining_decode_tokens() == sum(m.remaining_decode_tokens() for m in maps[:2])


# ---- claim 3: early finish ----------------------------------------------------------------------------------


def test_early_finish_restores_map_as_if_added_with_true_length(impl) -> None:  # type: ignore[no-untyped-def]
    p, d_pred, d_true = 40, 30, 12
    pred, true, bg = (impl.Anticipator(1000, max_len=64) for _ in range(3))
    for m in (pred, true, bg):
        m.add("background", 7, 50)  # another request keeps the map non-trivial
    pred.add("r", p, d_pred)
    true.add("r", p, d_true)
    for t in range(1, d_true + 1):
        for m in (pred, true, bg):
            m.advance_to(t)
    # after D_true iterations the prediction still holds the over-estimated tail [D_true, D_pred):
    # at offset j that is P + D_true + j = 52 + j, for j < 30 - 12 = 18
    assert [x - y for x, y in zip(full(pred), full(bg), strict=True)] == [52 + j for j in range(18)] + [
        0
    ] * 46
    assert pred.remaining_decode_tokens() - bg.remaining_decode_tokens() == 18
    assert pred.generated("r") == d_true
    assert pred.finish("r") and true.finish("r")  # the true one ran to its end: nothing left to subtract
    assert full(pred) == full(true) == full(bg)
    assert not pred.finish("r") and "r" not in pred and len(pred) == 1


# ---- claim 4: overrun ---------------------------------------------------------------------------------------


def expected_end(d_pred: int, ext: int, t: int) -> int:
    """Effective length at iteration t (relative to the add): one extension each time t reaches the end."""
    return d_pred if t < d_pred else d_pred + ((t - d_pred) // ext + 1) * ext


def test_overrun_extends_until_done_and_ends_as_add_with_true_length(impl) -> None:  # type: ignore[no-untyped-def]
    """ "Final map" is checked in both senses:
    - realized: U[0] at each iteration t (the slot as it becomes current), for t in [0, D_true], equals what an
      add with D_true gives (P + t while t < D_true, then 0): every overrun iteration was covered in time;
    - residual: after the finish at D_true, the whole future map equals the one where the request was added
      with D_true (and ran to its end), i.e. the extension beyond D_true was subtracted.
    """
    p, d_pred, d_true = 100, 10, 15
    ext = 2  # ceil(0.2 * 10)
    over, true = impl.Anticipator(1000, max_len=64), impl.Anticipator(1000, max_len=64)
    over.add("r", p, d_pred)
    true.add("r", p, d_true)
    realized_over, realized_true, ends = [], [], []
    for t in range(d_true + 1):
        over.advance_to(t)
        true.advance_to(t)
        if t == d_true:
            assert over.finish("r") and true.finish("r")
        else:
            end = over.record("r")[3]
            ends.append(end)
            assert end == expected_end(d_pred, ext, t)
            assert over.load_tokens(20) == [p + t + j if j < end - t else 0 for j in range(20)]
        realized_over.append(over.resident_tokens())
        realized_true.append(true.resident_tokens())
    # ends: 10 until t=10, then +2 each time it is reached: 12 at t=10, 14 at t=12, 16 at t=14
    assert ends == [10] * 10 + [12, 12, 14, 14, 16]
    assert realized_over == realized_true == [p + t for t in range(d_true)] + [0]
    assert full(over) == full(true) == [0] * 64


def test_overrun_extension_size_and_cap(impl) -> None:  # type: ignore[no-untyped-def]
    # D_pred = 7: ext = ceil(1.4) = 2; ext_frac = 0.5: ext = ceil(3.5) = 4; D_pred = 0: ext = max(1, 0) = 1
    for d, frac, ext in ((7, 0.2, 2), (7, 0.5, 4), (0, 0.2, 1), (3, 0.0, 1)):
        a = impl.Anticipator(1000, max_len=1000, ext_frac=frac)
        a.add("r", 0, d)
        a.advance_to(d)
        assert a.record("r")[3] == d + ext
    # the total is capped at max_len = 16: 10 -> 12 -> 14 -> 16, and then it stays at 16
    a = impl.Anticipator(1000, max_len=16)
    a.add("r", 5, 10)
    for t in range(1, 40):
        a.advance_to(t)
        assert a.record("r")[3] == min(16, expected_end(10, 2, t))
    assert full(a) == [0] * 16 and a.remaining_decode_tokens() == 0  # at the cap it holds nothing ahead
    assert a.generated("r") == 39 and a.finish("r")


def test_large_jump_equals_stepwise(impl) -> None:  # type: ignore[no-untyped-def]
    """A jump (even past the ring) gives the state of advancing one iteration at a time."""
    for jump in (13, 63, 64, 65, 200, 10**6):
        jumped, stepped = impl.Anticipator(1000, max_len=64), impl.Anticipator(1000, max_len=64)
        for m in (jumped, stepped):
            m.add("a", 100, 10)  # overruns: 10 -> 12 -> 14 ... capped at 64
            m.add("b", 5, 60)
            m.advance_to(3)
            m.add("c", 9, 200)  # capped at 3 + 64 = 67
        jumped.advance_to(3 + jump)
        for t in range(4, 3 + min(jump, 300) + 1):
            stepped.advance_to(t)
        if jump <= 300:
            assert full(jumped) == full(stepped)
            assert [jumped.record(r) for r in "abc"] == [stepped.record(r) for r in "abc"]
        assert full(jumped) == recount(jumped, "abc")
    # 0 -> 16 in one jump: "a" ends at 10 + ((16 - 10) // 2 + 1) * 2 = 18, so it holds P + 16 = 116 and 117
    # at offsets 0 and 1; "b" holds 5 + 16 + j
    a = impl.Anticipator(1000, max_len=64)
    a.add("a", 100, 10)
    a.add("b", 5, 60)
    a.advance_to(16)
    assert a.record("a")[3] == 18 and a.load_tokens(3) == [116 + 21, 117 + 22, 23]


# ---- claim 5: drains to zero --------------------------------------------------------------------------------


def test_drains_to_zero_over_random_ops(impl) -> None:  # type: ignore[no-untyped-def]
    """10^5 random add/finish/advance steps on the build (10^4 on the reference: its adds are Python loops
    over up to max_len slots), recounted from scratch every 2,500 steps, end exactly at zero."""
    num_ops = 100_000 if impl is _anticipator_c else 10_000
    rng = random.Random(5)
    a = impl.Anticipator(200_000, max_len=4096)
    live: list[str] = []
    it = 0
    for k in range(num_ops):
        x = rng.random()
        if x < 0.35 or not live:
            rid = f"r{k}"
            a.add(rid, rng.randint(0, 4000), rng.choice((rng.randint(1, 300), rng.randint(1, 5000))))
            live.append(rid)
        elif x < 0.7:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            assert a.finish(live.pop())
        else:
            it += (
                5000 if rng.random() < 0.01 else rng.choice((1, 1, 1, 2, 7, 40))
            )  # rarely: everything overruns
            a.advance_to(it)
        if k % 2500 == 0:
            assert full(a) == recount(a, live)
    for rid in live:
        assert a.finish(rid)
    assert len(a) == 0 and full(a) == [0] * 4096
    assert a.peak(4096) == 0.0 and a.remaining_decode_tokens() == 0 and a.resident_tokens() == 0


class MarginalFit:
    """A cost model without `terms` (a real vLLM worker's online fit): the Cython build must ask it."""

    def decode_marginal_s(self, num_tokens: float, context_tokens: float) -> float:
        return num_tokens * (1e-4 + context_tokens * 1e-8)


COSTS = [*(profile_cost(name) for name in PROFILES), MarginalFit()]


def test_batch_and_decode_in_read_the_records_and_the_queued(impl) -> None:  # type: ignore[no-untyped-def]
    """`batch` (the default policy's view of a worker's batch): each record with decode left is running as
    (remaining, context + generated), the context defaulting to its private prompt; records finished,
    overrun-free past their end or at the cap are left out; the requests of `queued` follow as (prompt, private
    prompt, D), in its order. `decode_in` (the fill level's D_in, read for every worker each select) is
    `e2_select_py.decode_in` over that batch, the same float (profile and fitted cost models), and equal to D_in
    over the batch as a router's own records of its requests describe it when it keeps them in lockstep with the
    map (every running request in the map, its whole prompt as context)."""
    rng = random.Random(4)
    seen = {"running": 0, "queued": 0, "left_out": 0, "default_context": 0}
    for _ in range(60):
        a = impl.Anticipator(100_000, max_len=rng.choice((64, 512)), ext_frac=rng.choice((0.0, 0.2)))
        reqs, ctx = {}, {}
        for k in range(rng.randint(0, 30)):
            rid = f"r{k}"
            prompt, d = rng.randint(1, 2000), rng.randint(0, 300)
            private = rng.randint(0, prompt)
            running = rng.random() < 0.7
            if running:
                if rng.random() < 0.2:
                    a.add(rid, private, d)  # no context: its private prompt
                    ctx[rid] = private
                    seen["default_context"] += 1
                else:
                    a.add(rid, private, d, prompt)
                    ctx[rid] = prompt
            reqs[rid] = SimpleNamespace(running=running, prompt_tokens=ctx.get(rid, prompt), kv_prompt_tokens=private,
                                        predicted_tokens=d)
            if rng.random() < 0.3:
                a.advance_to(a.iteration + rng.randint(1, 120))
            if reqs and rng.random() < 0.1:
                gone = rng.choice(list(reqs))
                a.finish(gone)
                del reqs[gone]
        queued = {rid: rq for rid, rq in reqs.items() if not rq.running}
        want_run, lockstep = [], []
        for rid, rq in reqs.items():  # the definitions: from the public records, and from the router's requests
            if not rq.running:
                continue
            _, start, _, end = a.record(rid)
            if end > a.iteration:
                want_run.append((end - a.iteration, ctx[rid] + a.iteration - start))
                lockstep.append((end - a.iteration, rq.prompt_tokens + a.iteration - start))
            else:
                seen["left_out"] += 1
        want_queued = [(rq.prompt_tokens, rq.kv_prompt_tokens, rq.predicted_tokens) for rq in queued.values()]
        running, waiting = a.batch(queued)
        assert sorted(running) == sorted(want_run) and waiting == want_queued
        seen["running"] += bool(want_run)
        seen["queued"] += bool(want_queued)
        for d in (1, 60, 400):
            cost = rng.choice(COSTS)
            got = a.decode_in(queued, d, cost)
            assert got == e2_select_py.decode_in(want_run, want_queued, 0, d, cost)
            assert got == e2_select_py.decode_in(lockstep, want_queued, 0, d, cost)
    assert all(seen.values()), seen


# ---- claim 6: time advance ----------------------------------------------------------------------------------


def test_time_advance_shifts_the_map(impl) -> None:  # type: ignore[no-untyped-def]
    for t in (1, 7, 50):
        a = impl.Anticipator(1000, max_len=128)
        a.add("x", 30, 90)
        a.add("y", 4, 60)
        a.advance_to(5)
        a.add("z", 11, 128)
        old = full(a)
        a.advance_to(5 + t)  # every end (90, 60, 133) is beyond 5 + 50: nothing overruns
        assert full(a) == old[t:] + [0] * t


# ---- virtual add, overload fraction -------------------------------------------------------------------------


def test_virtual_peak_is_add_peak_finish_without_mutation(impl) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(7)
    a = impl.Anticipator(5000, max_len=128)
    for i in range(15):
        a.add(f"r{i}", rng.randint(0, 800), rng.randint(0, 200))
        a.advance_to(a.iteration + rng.randint(0, 9))
    for p, d, h in (
        (0, 0, 100),
        (500, 1, 100),
        (120, 40, 100),
        (300, 500, 100),
        (50, 20, 10),
        (70, 90, 10**6),
    ):
        before = (full(a), a.remaining_decode_tokens(), len(a))
        vp = a.virtual_peak(p, d, h)
        assert (full(a), a.remaining_decode_tokens(), len(a)) == before  # no mutation
        a.add("virtual", p, d)
        assert vp == a.peak(h)
        a.finish("virtual")
        assert (full(a), a.remaining_decode_tokens(), len(a)) == before
    # worked example: U = [100 + j] for j < 5; a virtual (P=10, D=3) adds 10, 11, 12 at offsets 0..2
    b = impl.Anticipator(1000, max_len=16)
    b.add("r", 100, 5)
    assert b.virtual_peak(10, 3) == 0.114  # max(110, 112, 114, 103, 104) / 1000
    assert b.virtual_peak(10, 3, horizon=2) == 0.112 and b.virtual_peak(10, 3, horizon=0) == 0.0


def test_overload_fraction(impl) -> None:  # type: ignore[no-untyped-def]
    a = impl.Anticipator(1000, max_len=4096)
    a.add("r", 940, 20)  # U[j] = 940 + j for j < 20: strictly above 950 for j = 11..19
    assert a.overload_fraction(100, 0.95) == 9 / 100
    assert a.overload_fraction(15, 0.95) == 4 / 15
    assert a.overload_fraction(0) == 0.0 and a.overload_fraction(100, 0.0) == 20 / 100
    assert a.overload_fraction(10**9, 0.95) == 9 / 4096  # the horizon clamps to max_len


def test_validation(impl) -> None:  # type: ignore[no-untyped-def]
    for bad in (
        {"capacity_tokens": 0},
        {"capacity_tokens": -5},
        {"capacity_tokens": 10, "max_len": 0},
        {"capacity_tokens": 10, "ext_frac": -0.1},
        {"capacity_tokens": 10, "ext_frac": float("nan")},
    ):
        with pytest.raises(ValueError):
            impl.Anticipator(**bad)
    with pytest.raises(TypeError):
        impl.Anticipator(10.0)
    a = impl.Anticipator(1000, max_len=16)
    a.add("r", 1, 2)
    for args in (
        ("s", -1, 5),
        ("s", 1, -5),
        ("s", 2**31, 5),
        ("s", 1, 2**70),
        ("s", 1, 2, -1),
        ("s", 1, 2, 2**31),
        ("r", 1, 2),
    ):  # last: duplicate
        with pytest.raises(ValueError):
            a.add(*args)
    with pytest.raises(TypeError):
        a.add("s", 1.5, 2)
    with pytest.raises(TypeError):
        a.add("s", 1, 2, 3.0)
    with pytest.raises(ValueError):
        a.virtual_peak(-1, 2)
    for q in (a.peak, a.load_tokens, a.overload_fraction, a.occupancy):
        with pytest.raises(ValueError):
            q(-1)
    a.advance_to(5)
    with pytest.raises(ValueError):
        a.advance_to(4)
    with pytest.raises(ValueError):
        a.advance_to(2**62 + 1)
    with pytest.raises(KeyError):
        a.generated("nope")
    with pytest.raises(KeyError):
        a.record("nope")
    assert a.finish("nope") is False
    assert a.iteration == 5 and len(a) == 1 and a.record("r") == (1, 0, 2, 6)  # unchanged by the failures


# ---- side by side -------------------------------------------------------------------------------------------

RIDS = st.sampled_from([f"r{i}" for i in range(12)])


class SideBySide(RuleBasedStateMachine):
    """Random operation sequences on both builds; every observable is compared after each step and the map is
    recounted from the records."""

    def __init__(self) -> None:
        super().__init__()
        self.maps: list = []
        self.live: set[str] = set()

    @initialize(
        capacity=st.sampled_from([1, 97, 1000, 10**6]),
        max_len=st.sampled_from([1, 2, 7, 32, 100]),
        ext_frac=st.sampled_from([0.0, 0.2, 0.5, 1.5, 1e300]),
    )
    def setup(self, capacity: int, max_len: int, ext_frac: float) -> None:
        mods = [anticipator_py] + ([_anticipator_c] if _anticipator_c is not None else [])
        self.maps = [m.Anticipator(capacity, max_len=max_len, ext_frac=ext_frac) for m in mods]

    def same(self, results: list) -> None:
        for r in results[1:]:
            assert r == results[0]

    @rule(rid=RIDS, p=st.integers(0, 5000), d=st.integers(0, 150), shared=st.none() | st.integers(0, 5000))
    def add(self, rid: str, p: int, d: int, shared: int | None) -> None:
        outcomes = []
        for m in self.maps:
            try:
                m.add(rid, p, d) if shared is None else m.add(rid, p, d, p + shared)
                outcomes.append("ok")
            except ValueError:
                outcomes.append("duplicate")
        self.same(outcomes)
        assert (outcomes[0] == "duplicate") == (rid in self.live)
        self.live.add(rid)

    @rule(rid=RIDS)
    def finish(self, rid: str) -> None:
        self.same([m.finish(rid) for m in self.maps] + [rid in self.live])
        self.live.discard(rid)

    @rule(step=st.sampled_from([0, 1, 1, 1, 2, 3, 5, 8, 40, 129, 10**5]))
    def advance(self, step: int) -> None:
        for m in self.maps:
            m.advance_to(m.iteration + step)

    @rule(p=st.integers(0, 5000), d=st.integers(0, 150), h=st.sampled_from([0, 1, 5, 100, 10**4]))
    def queries(self, p: int, d: int, h: int) -> None:
        self.same([(m.virtual_peak(p, d, h), m.peak(h), m.load_tokens(h)) for m in self.maps])
        for thr in (0.0, 0.5, 0.95):
            self.same([m.overload_fraction(h, thr) for m in self.maps])
        self.same([[m.occupancy(j) for j in (0, 1, 6, 99, 100)] for m in self.maps])
        queued = {"q": SimpleNamespace(prompt_tokens=p, kv_prompt_tokens=p, predicted_tokens=h % 97 + 1)}
        self.same([(sorted(m.batch(queued)[0]), m.batch(queued)[1]) for m in self.maps])
        for cost in COSTS[-2:]:
            self.same([[m.decode_in(q, max(1, d), cost) for q in ({}, queued)] for m in self.maps])

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def virtual_equals_add(self, data: st.DataObject) -> None:
        p, d = data.draw(st.integers(0, 5000)), data.draw(st.integers(0, 150))
        for m in self.maps:
            vp = m.virtual_peak(p, d, 100)
            m.add("virtual", p, d)
            assert m.peak(100) == vp
            m.finish("virtual")

    @invariant()
    def identical_and_consistent(self) -> None:
        if not self.maps:
            return
        rids = sorted(self.live)
        views = [
            (
                m.iteration,
                len(m),
                full(m),
                m.remaining_decode_tokens(),
                m.resident_tokens(),
                [(m.record(r), m.generated(r), r in m) for r in rids],
            )
            for m in self.maps
        ]
        self.same(views)
        assert views[0][1] == len(rids)
        assert views[0][2] == recount(self.maps[0], rids)


SideBySide.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_side_by_side = SideBySide.TestCase


# ---------------------------------------------------------------------------------------------- iteration clock
class FitCost:
    """A cost model without `terms` (a real vLLM worker's online fit): the Cython clock must ask it."""

    def decode_iteration_s(self, n: int, c: int) -> float:
        return 0.01 + n * 1e-4 + c * 1e-8


@pytest.mark.c_extension
@pytest.mark.skipif(_anticipator_c is None, reason="Cython extension not built")
@pytest.mark.parametrize("seed", range(4))
def test_cython_clock_equals_reference(seed: int) -> None:
    """The iteration clock and `sync_known`, Cython against the reference, over random batches, Stats samples
    (progressing, repeated, without an exact time, not yet taken, a counter that went down), times that step
    back, profile, fitted and missing cost models (the observed rate, else the default profile) and workers the
    tracker does not know: the same fields, floats and maps after every step."""
    from switchyard.router.policies.preble_cost import profile_cost
    from switchyard.workers.engine.profiles import DEFAULT_PROFILE, PROFILES

    rng = random.Random(seed)
    default = profile_cost(DEFAULT_PROFILE)
    profiles = [profile_cost(n) for n in PROFILES]
    fields = ("base", "sample_iterations", "sample_at", "has_sample", "since_sample", "last_t", "observed_rate",
              "rate_n", "rate_c", "memo_rate")

    class State:  # what `sync_known` reads of the tracker's per-worker state
        def __init__(self, mod, cost, now: float) -> None:  # type: ignore[no-untyped-def]
            self.anticipator = mod.Anticipator(100_000, max_len=512)
            self.clock = mod.IterationClock(cost, default, now)

    class View:  # what it reads of a worker view
        def __init__(self, worker_id: str) -> None:
            self.worker_id, self.stats_at, self.stats_age_s, self.num_iterations = worker_id, None, math.inf, 0

    now = 0.0
    ids = [f"w{i}" for i in range(5)]
    worker_cost = {w: c for w, c in zip(ids, [None, FitCost(), *(rng.choice(profiles) for _ in range(3))],
                                        strict=True)}
    states = {mod: {w: State(mod, worker_cost[w], now) for w in ids} for mod in (anticipator_py, _anticipator_c)}
    views = {w: View(w) for w in [*ids, "unknown"]}
    seen = {"advanced": 0, "synced": 0, "unknown": 0, "observed": 0, "restarted": 0, "anchored": 0}
    live: dict[str, list[str]] = {w: [] for w in ids}
    for step in range(600):
        now += rng.choice([0.0, rng.uniform(0.0, 0.2), -0.05])
        w = rng.choice(ids)
        op = rng.random()
        p, d = rng.randint(1, 300), rng.randint(1, 80)  # drawn once for both builds
        finished = live[w][step % len(live[w])] if 0.3 <= op < 0.4 and live[w] else None
        for sts in states.values():
            ant, clock = sts[w].anticipator, sts[w].clock
            clock.advance(ant, now)  # as the tracker's hooks, before the batch changes
            if op < 0.3:
                ant.add(f"r{step}", p, d)
            elif finished is not None:
                assert ant.finish(finished)
        if op < 0.3:
            live[w].append(f"r{step}")
        elif finished is not None:
            live[w].remove(finished)
        elif op < 0.6:  # a Stats sample on the view: progressing, repeated, timeless, or a restart's counter
            v = views[rng.choice([*ids, "unknown"])]
            v.stats_age_s = rng.choice([0.0, 0.05, 0.3, math.inf])
            taken = now - v.stats_age_s if math.isfinite(v.stats_age_s) else None  # a sample's time is finite
            v.stats_at = rng.choice([taken, None, v.stats_at])
            v.num_iterations = rng.choice([v.num_iterations + rng.randint(1, 400), v.num_iterations,
                                           max(0, v.num_iterations - rng.randint(1, 50))])
        elif op < 0.7:  # the clock's own `observe`, as the tracker's `sync` calls it
            v = views[w]
            for sts in states.values():
                sts[w].clock.observe(sts[w].anticipator, v.stats_at, v.stats_age_s, v.num_iterations, now)
        got = {mod: mod.sync_known(sts, list(views.values()), now) for mod, sts in states.items()}
        assert [a is None for a in got[anticipator_py]] == [a is None for a in got[_anticipator_c]]
        seen["synced"] += sum(a is not None for a in got[anticipator_py])
        seen["unknown"] += got[anticipator_py][-1] is None
        for w2 in ids:
            a, b = states[anticipator_py][w2], states[_anticipator_c][w2]
            assert [getattr(a.clock, f) for f in fields] == [getattr(b.clock, f) for f in fields], (step, w2)
            assert a.anticipator.iteration == b.anticipator.iteration
            assert a.anticipator.load_tokens(64) == b.anticipator.load_tokens(64)
            assert a.clock.rate(a.anticipator) == b.clock.rate(b.anticipator)
            seen["advanced"] += a.anticipator.iteration > 0
            seen["observed"] += a.clock.observed_rate > 0 and worker_cost[w2] is None
            seen["restarted"] += a.clock.base != 0
            seen["anchored"] += a.clock.has_sample
    assert all(seen.values()), seen


def test_bench_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from switchyard.bench.micro import anticipator as bench

    assert bench.main(["--ops", "200", "--records", "20", "--out", str(tmp_path), "--no-plot"]) == 0
    rows = json.loads((tmp_path / "anticipator.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == ({"py", "c"} if _anticipator_c is not None else {"py"})
    assert all(r["p50_us"] > 0 and r["p99_us"] >= r["p50_us"] for r in rows)
