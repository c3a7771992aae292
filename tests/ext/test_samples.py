"""Windowed (t, value) samples: both builds against a plain deque of tuples and the window queries' definitions."""

from __future__ import annotations

import gc
import math
import pickle
import random
import statistics
from collections import deque
from contextlib import nullcontext

import pytest
from ext_testlib import NO_EXTENSIONS, impl_params

from switchyard.ext import samples, samples_py

try:
    from switchyard.ext import _samples_c
except ImportError:  # pragma: no cover - test_c_extension_loaded reports it
    _samples_c = None


@pytest.fixture(params=impl_params(_samples_c))
def impl(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return samples_py if request.param == "py" else _samples_c


@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
def test_c_extension_loaded() -> None:
    if NO_EXTENSIONS:
        pytest.skip("SWITCHYARD_NO_EXTENSIONS is set")
    assert _samples_c is not None, "switchyard.ext._samples_c did not build or import"
    assert samples.IMPLEMENTATION == "c" and samples.Samples is _samples_c.Samples
    assert samples.RecentMedian is _samples_c.RecentMedian and samples.NodeStats is _samples_c.NodeStats


def since_by_definition(ref: deque, cutoff: float) -> tuple[int, float]:  # type: ignore[type-arg]
    inside = [t for t, _ in ref if t >= cutoff]
    return len(inside), (inside[0] if inside else math.inf)


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_match_a_deque(impl, seed: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(seed)
    s, ref = impl.Samples(), deque()
    now = 0.0
    for _ in range(3000):
        op = rng.random()
        if op < 0.45:
            now += rng.choice([0.0, rng.expovariate(2.0)])  # ties too: t is non-decreasing, not increasing
            sample = (now, rng.uniform(-1, 5))
            s.append(sample)
            ref.append(sample)
        elif op < 0.55 and ref:
            assert s.popleft() == ref.popleft()
        elif op < 0.6:
            with pytest.raises(IndexError) if not ref else nullcontext():
                assert s.popleft() == ref.popleft()
        elif op < 0.7:
            cutoff = now - rng.uniform(0, 3)
            s.trim(cutoff)
            while ref and ref[0][0] < cutoff:
                ref.popleft()
        elif op < 0.72:
            s.clear()
            ref.clear()
        cutoff = now - rng.uniform(-0.5, 4)
        assert s.since(cutoff) == since_by_definition(ref, cutoff)
        n, total = s.total_since(cutoff)
        head = [v for t, v in ref if t < cutoff]  # t never decreases: the expired are the head
        assert n == since_by_definition(ref, cutoff)[0]
        assert total == ((sum(v for _, v in ref) - sum(head)) if n else 0.0)  # the same additions, bit for bit
        assert len(s) == len(ref) and bool(s) == bool(ref) and list(s) == list(ref)
        if ref:
            i = rng.randrange(-len(ref), len(ref))
            assert s[i] == ref[i]
        with pytest.raises(IndexError):
            s[len(ref)]


def test_iteration_refuses_a_change_and_copies_round_trip(impl) -> None:  # type: ignore[no-untyped-def]
    s = impl.Samples([(1.0, 2.0), (2.0, 3.0)])
    with pytest.raises(RuntimeError):
        for _ in s:
            s.append((3.0, 1.0))
    assert list(pickle.loads(pickle.dumps(s))) == list(s) == [(1.0, 2.0), (2.0, 3.0), (3.0, 1.0)]
    assert list(impl.Samples(iter(s))) == list(s)


@pytest.mark.parametrize("capacity", [1, 2, 5, 64])
def test_recent_median_is_the_median_of_the_last_values(impl, capacity: int) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(capacity)
    rm, ref = impl.RecentMedian(capacity), deque((), capacity)
    assert rm.median() is None and len(rm) == 0
    for _ in range(600):
        x = rng.choice([rng.randrange(0, 8), rng.randrange(0, 5000), 2**40 + rng.randrange(3)])  # repeats too
        rm.add(x)
        ref.append(x)
        got, want = rm.median(), statistics.median(ref)
        assert got == want and type(got) is type(want)  # the middle int, or the mean of two as a float
        assert rm.median() is got  # kept until the next add
        assert len(rm) == len(ref) and list(rm) == list(ref)


@pytest.mark.c_extension
@pytest.mark.skipif(_samples_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_c_samples_are_invisible_to_the_collector() -> None:
    """The point of the build: a node's stats add nothing to a full collection: the stats, their windows and recent
    output lengths are untracked, and their dicts stay untracked (a redirect's tuple is untracked by a collection)."""
    from switchyard.router.policies.preble_load import NodeStats

    s = _samples_c.Samples([(0.0, 1.0)])
    hits = {"w0": s}
    assert not gc.is_tracked(s) and not gc.is_tracked(hits) and not gc.is_tracked(_samples_c.RecentMedian(4))
    st = NodeStats()
    st.add_hit("w0", 1.0, 0.1, 60.0)
    st.add_decode(7)
    st.ttft["w0"] = _samples_c.Samples([(1.0, 0.2)])
    st.redirect["w0"] = ("w1", 9.0)
    gc.collect()
    assert [f for f in ("hits", "decode_tokens", "ttft", "redirect", "replicas") if gc.is_tracked(getattr(st, f))] == []
    assert NodeStats is _samples_c.NodeStats and not gc.is_tracked(st)


@pytest.mark.skipif(_samples_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_c_recent_median_allocates_as_it_fills() -> None:
    """Most nodes' stats never get an output length (only a request's key node does), so an empty `RecentMedian`
    holds no array, and a few values take a few slots, not `cap`'s (tracemalloc counts `PyMem_Malloc`)."""
    import tracemalloc

    full = 2 * 64 * 8  # both arrays of a 64-slot median
    tracemalloc.start()
    try:
        empty = [_samples_c.RecentMedian(64) for _ in range(1000)]
        per_empty = tracemalloc.get_traced_memory()[0] / len(empty)
        for rm in empty[:500]:
            for v in (3, 1, 2):
                rm.add(v)
        per_three = (tracemalloc.get_traced_memory()[0] - per_empty * len(empty)) / 500
    finally:
        tracemalloc.stop()
    assert per_empty < full / 4
    assert per_three <= 2 * 4 * 8 + 16  # two arrays of 4 slots (an allocator's rounding aside)
    assert [rm.median() for rm in empty[:2]] == [2, 2] and empty[-1].median() is None


def test_node_stats_keep_the_window_and_the_median(impl) -> None:  # type: ignore[no-untyped-def]
    st = impl.NodeStats()
    assert st.median_decode() is None and st.hits == {} and st.ttft == {} and st.redirect == {} and st.replicas == {}
    for i in range(10):
        st.add_hit("w0" if i % 3 else "w1", float(i), 0.5 + i, window_s=4.0)
    assert list(st.hits["w0"]) == [(4.0, 4.5), (5.0, 5.5), (7.0, 7.5), (8.0, 8.5)]  # t >= 8 - 4 at its last add
    assert list(st.hits["w1"]) == [(6.0, 6.5), (9.0, 9.5)]
    for n in [*range(100), 7]:
        st.add_decode(n)
    assert len(st.decode_tokens) == impl.DECODE_SAMPLES == 64
    assert st.median_decode() == statistics.median([*range(37, 100), 7])
