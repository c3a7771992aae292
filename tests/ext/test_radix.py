"""The global prefix radix tree: worked examples on both builds, and a state machine that runs them side by side."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from ext_testlib import NO_EXTENSIONS, impl_params
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from switchyard.ext import radix, radix_py

try:
    from switchyard.ext import _radix_c
except ImportError:  # pragma: no cover - test_c_extension_loaded reports it
    _radix_c = None



if _radix_c is not None:

    class _ChainedTree(_radix_c.RadixTree):
        """The Cython build as E2 makes it (`chained=True`): the examples' hashes are chains."""

        def __init__(self) -> None:
            super().__init__(chained=True)


def _chained_c_params() -> list:  # type: ignore[type-arg]
    """"c" again, as "c-chained": the C build's walk by the chain (its last covered block, then a bisection)."""
    c = impl_params(_radix_c)[1]
    return [pytest.param("c-chained", marks=c.marks)]


@pytest.fixture(params=impl_params(_radix_c) + _chained_c_params())
def impl(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    if request.param == "c-chained":
        return SimpleNamespace(RadixTree=_ChainedTree)
    return radix_py if request.param == "py" else _radix_c


@pytest.mark.skip_in_ci_ok  # skipping is right when the opt-out is set on purpose
def test_c_extension_loaded() -> None:
    if NO_EXTENSIONS:
        pytest.skip("SWITCHYARD_NO_EXTENSIONS is set")
    assert _radix_c is not None, "switchyard.ext._radix_c did not build or import"
    assert radix.IMPLEMENTATION == "c"
    assert radix.RadixTree is _radix_c.RadixTree
    assert radix.Node is _radix_c.Node
    assert radix.MatchResult is _radix_c.MatchResult
    assert radix.MAX_WORKERS == _radix_c.MAX_WORKERS == 256


def blocks_of(path) -> list[tuple[int, ...]]:  # type: ignore[no-untyped-def]
    return [tuple(node.blocks) for node in path]


# Block hashes in the examples are small ints: the tree only needs them unique per prefix, as chained hashes are.
SYS = [11, 12, 13, 14]  # a 4-block system prompt
TOOL_A = [21, 22]
TOOL_B = [31, 32, 33]


def test_insert_splits_and_key_node(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    first = t.insert(SYS + TOOL_A, now=1.0)  # one leaf of 6 blocks
    assert blocks_of(first) == [(11, 12, 13, 14, 21, 22)]
    path = t.insert(SYS + TOOL_B, now=2.0)
    # the match ends inside the 6-block node after 4 blocks: split at k=4 -> [11..14] + [21, 22];
    # the new leaf [31, 32, 33] hangs under the upper half
    assert blocks_of(path) == [(11, 12, 13, 14), (31, 32, 33)]
    assert [n.context_blocks for n in path] == [0, 4]
    assert first[0].blocks == (21, 22) and first[0].context_blocks == 4  # the original object is the lower half
    assert first[0].parent is path[0] and path[0].parent is None
    assert t.num_nodes == 3 and t.num_blocks == 4 + 2 + 3
    assert t.node_of(22) == (first[0], 1) and t.node_of(13) == (path[0], 2) and t.node_of(99) is None
    # runs_of: one (node, i, j) per stretch of consecutive positions in one node; unknown or non-int hashes skipped
    assert t.runs_of([12, 13, 99, 14, 21, 22, "x", 11, 31]) == [
        (path[0], 0, 2), (path[0], 3, 4), (first[0], 4, 6), (path[0], 7, 8), (path[1], 8, 9)
    ]
    assert t.runs_of([]) == [] and t.runs_of((99, 2**70, -1)) == []
    # key portion: [11..14] has 4 blocks > 0 before it; [31..33] has 3 > 4? no -> the system prompt is the key
    assert path[0].last_access == 2.0 and first[0].last_access == 1.0  # insert touched only its own path
    m = t.match(SYS + TOOL_B + [41])
    assert m.matched_blocks == 7 and m.key_node is path[0]  # 4 + 3 matched, block 41 unknown
    # a long question under a short prefix: [11..14] + [51..55]: 5 blocks > 4 before -> the leaf is the key
    tail = t.insert(SYS + [51, 52, 53, 54, 55], now=3.0)
    assert t.match(SYS + [51, 52, 53, 54, 55]).key_node is tail[-1]
    assert impl.RadixTree.key_node(tail) is tail[-1]
    # a query ending mid-node is split on insert so the path covers exactly the query
    assert blocks_of(t.insert([11, 12], now=4.0)) == [(11, 12)]
    assert t.match([11, 12]).matched_blocks == 2 and t.num_nodes == 5
    t.check_invariants()


def test_split_keeps_stats_on_lower_half_and_clips_runs(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    (node,) = t.insert([1, 2, 3, 4, 5], now=0.0)
    node.stats = {"count": 7}
    t.mark_resident("w0", [1, 2, 3, 4], None, now=0.0)  # run 4 of 5
    t.mark_resident("w1", [1], None, now=0.0)  # run 1 of 5
    t.assign([node], "w2", now=0.0)
    upper, _leaf = t.insert([1, 2, 9], now=1.0)  # split at k=2
    # upper [1, 2]: runs min(4, 2) = 2 and min(1, 2) = 1; lower [3, 4, 5]: 4 - 2 = 2, w1 (1 <= 2) dropped
    assert upper.resident == {"w0": 2, "w1": 1} and node.resident == {"w0": 2}
    assert upper.assigned == {"w2"} == node.assigned
    assert upper.stats is None and node.stats == {"count": 7}
    t.check_invariants()


def test_match_leading_runs(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    t.insert(SYS + TOOL_A, now=0.0)
    t.insert(SYS + TOOL_B, now=0.0)  # [11..14] -> {[21, 22], [31, 32, 33]}
    t.mark_resident("a", SYS + TOOL_B, None, now=0.0)  # all 7 blocks
    t.mark_resident("b", SYS, None, now=0.0)
    t.mark_resident("b", [32, 33], 31, now=0.0)  # gap: 31 missing, so 32, 33 cannot count (leading run)
    t.mark_resident("c", [12, 13], 11, now=0.0)  # no block 11: no leading run at all
    t.assign(t.match(SYS + TOOL_A).path, "d", now=0.0)
    m = t.match(SYS + [31, 32, 99])
    assert m.matched_blocks == 6  # 4 + 2 of [31, 32, 33]
    # a: 4 + min(3, 2) = 6; b: 4 + 0 (its run on [31..33] is empty) = 4; c: none; d: 4 (assigned [11..14] only)
    assert m.resident_blocks == {"a": 6, "b": 4}
    assert m.assigned_blocks == {"d": 4}
    t.mark_resident("b", [31], 14, now=0.0)  # now 31 is there: run 0 -> 1, and 32, 33 still need re-storing
    assert t.match(SYS + TOOL_B).resident_blocks == {"a": 7, "b": 5}
    t.check_invariants()


def test_match_cached_and_key_portion(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    path = t.insert([1, 2, 3, 4], now=0.0)  # one node of 4 blocks
    t.insert([1, 2, 5, 6, 7, 8, 9], now=0.0)  # splits it: [1, 2] -> {[3, 4], [5, 6, 7, 8, 9]}
    t.assign(t.insert([1, 2, 5, 6, 7, 8, 9], now=1.0), "a", now=1.0)
    t.mark_resident("r", [1, 2, 5], None, now=1.0)
    cached, best, path = t.match_cached([1, 2, 5, 6, 7, 8, 9], ["r", "a", "x"], {"a": {7, 99}})
    assert list(cached.items()) == [("r", 3), ("a", 4), ("x", 0)] and best == 4  # a's run cut at evicted 7
    assert blocks_of(path) == [(1, 2), (5, 6, 7, 8, 9)]
    node, end = t.key_portion(path, 7, True)  # [5..9] has 5 blocks > its 2 predecessors
    assert tuple(node.blocks) == (5, 6, 7, 8, 9) and end == 7
    node, end = t.key_portion(path, 3, True)  # clipped to 3 blocks: [5] alone is 1 block, not > 2
    assert tuple(node.blocks) == (1, 2) and end == 2
    node, end = t.key_portion(path, 3, False)  # Alg 1's longest node: [1, 2] (2 blocks) beats [5] (1)
    assert tuple(node.blocks) == (1, 2) and end == 2
    assert t.key_portion([], 5, True) == (None, 0)


def test_mark_resident_inserts_under_parent_and_ignores_unknown_parent(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    t.insert([1, 2, 3], now=0.0)
    t.mark_resident("w", [7, 8], 2, now=5.0)  # parent 2 is mid-node: split [1, 2] + [3], then [7, 8] under [1, 2]
    assert sorted(blocks_of(t.nodes())) == [(1, 2), (3,), (7, 8)]
    assert t.node_of(7)[0].last_access == 5.0 and t.node_of(7)[0].resident == {"w": 2}
    assert t.match([1, 2, 7, 8]).resident_blocks == {}  # w never stored 1, 2
    t.mark_resident("w", [1, 2], None, now=5.0)
    assert t.match([1, 2, 7, 8]).resident_blocks == {"w": 4}
    t.mark_resident("w", [40, 41], 999, now=5.0)  # unknown parent: ignored
    assert t.node_of(40) is None and t.num_nodes == 3
    t.check_invariants()


def test_eviction_is_never_reported_resident(impl) -> None:  # type: ignore[no-untyped-def]
    # Preble claim 10 (sync): once the eviction events are applied, no block of them is reported resident.
    t = impl.RadixTree()
    t.mark_resident("w", [1, 2, 3, 4, 5, 6], None, now=0.0)
    t.assign(t.insert([1, 2, 3, 4, 5, 6], now=0.0), "w", now=0.0)  # optimistic too
    t.mark_evicted("w", [6, 5, 4])  # tail first, as vLLM frees: run 6 -> min(6, 5)=5 -> 4 -> 3
    m = t.match([1, 2, 3, 4, 5, 6])
    assert m.resident_blocks == {"w": 3} and m.assigned_blocks == {"w": 6}  # assigned stays optimistic
    t.mark_evicted("w", [2])  # a middle block: run min(3, 1) = 1, block 3 is no longer usable either
    assert t.match([1, 2, 3]).resident_blocks == {"w": 1}
    t.mark_resident("w", [3], 2, now=0.0)  # 3 is not right after the run (1): still not counted
    assert t.match([1, 2, 3]).resident_blocks == {"w": 1}
    t.mark_evicted("w", [1, 42])  # unknown hashes are skipped
    assert t.match([1, 2, 3]).resident_blocks == {} and t.node_of(1)[0].resident == {}
    t.check_invariants()


def test_gc_removes_unreferenced_nodes_after_the_window(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    sys_path = t.insert(SYS, now=0.0)
    a = t.insert(SYS + TOOL_A, now=10.0)[-1]
    b = t.insert(SYS + TOOL_B, now=100.0)[-1]
    t.assign([a], "w", now=10.0)  # assigned but never confirmed by a KV event
    t.mark_resident("r", SYS, None, now=0.0)
    # window 60 s at now=120: a (120 - 10 = 110 > 60) is stale -> collected although assigned;
    # b (20 s) is inside the window; SYS is resident -> kept
    assert t.gc(now=120.0, window_s=60.0) == 1
    assert not a.is_attached and a.parent is None and a.assigned == set()
    assert sorted(blocks_of(t.nodes())) == [(11, 12, 13, 14), (31, 32, 33)]
    assert t.node_of(21) is None and t.num_blocks == 7
    t.clear_worker("r")
    # at now=200: b (100 s) goes, then SYS becomes a leaf, its last access 100 s ago: also goes (one pass)
    assert t.gc(now=200.0, window_s=60.0) == 2
    assert t.num_nodes == 0 and t.num_blocks == 0 and not sys_path[0].is_attached
    t.assign(sys_path, "w", now=300.0)  # a detached node: no effect
    assert t.match(SYS).path == [] and b.assigned == set()
    t.check_invariants()


def test_gc_visits_no_candidate_before_it_can_expire(impl) -> None:  # type: ignore[no-untyped-def]
    """A burst of 500 prompts last used at t=0.5: until now - 0 > W no gc call takes one of them off the queue
    (a node of the bucket of second 0 passes only then), and the first call after removes them all. The bound
    before visited the whole bucket on every call of the second before (re-queuing each node)."""
    t = impl.RadixTree()
    for k in range(500):
        t.insert([10_000 + k, 20_000 + k], now=0.5)
    for now in (0.6, 59.5, 59.9, 60.0):
        assert t.gc(now=now, window_s=60.0) == 0
    assert t.gc_visits == 0 and t.num_nodes == 500
    assert t.gc(now=60.4, window_s=60.0) == 0  # second 0 may hold a node old enough now: visited, none is
    assert t.gc_visits == 500
    assert t.gc(now=60.6, window_s=60.0) == 500 and t.num_nodes == 0
    assert t.gc_visits == 1000
    t.check_invariants()


def test_remove_worker_and_unassign(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    path = t.insert([1, 2, 3], now=0.0)
    for w in ("a", "b"):
        t.assign(path, w, now=0.0)
        t.mark_resident(w, [1, 2, 3], None, now=0.0)
    t.unassign_worker("a")
    m = t.match([1, 2, 3])
    assert m.assigned_blocks == {"b": 3} and m.resident_blocks == {"a": 3, "b": 3}
    t.remove_worker("b")
    m = t.match([1, 2, 3])
    assert m.assigned_blocks == {} and m.resident_blocks == {"a": 3}
    t.clear_worker("a")
    assert t.match([1, 2, 3]).resident_blocks == {}
    t.check_invariants()


def test_bad_hashes_and_collisions(impl) -> None:  # type: ignore[no-untyped-def]
    t = impl.RadixTree()
    with pytest.raises(ValueError, match="not a uint64"):
        t.insert([1, -1], now=0.0)
    with pytest.raises(ValueError, match="not a uint64"):
        t.mark_resident("w", [2**64], None, now=0.0)
    assert t.num_nodes == 0
    t.insert([2**64 - 1, 0], now=0.0)  # the extremes are fine
    assert t.match([2**64 - 1, 0, -5]).matched_blocks == 2  # a bad hash in a query just does not match
    # 0 is already in the tree (a collision or a broken chain): the new leaf is cut before it
    assert blocks_of(t.insert([5, 6, 0, 7], now=0.0)) == [(5, 6)]
    assert blocks_of(t.insert([8, 9, 8], now=0.0)) == [(8, 9)]  # a repeat inside one insert: same
    t.check_invariants()


def test_a_bad_hash_on_a_matched_path_is_refused(impl) -> None:  # type: ignore[no-untyped-def]
    """The C insert converts only the blocks past the walk: a non-uint64 that equals a stored hash (a float) must
    still be refused wherever it sits (a chained tree: wherever its walk reads), before the tree changes."""
    t = impl.RadixTree()
    t.insert([1, 2, 3], now=0.0)
    for bad in ([1.0, 2, 3, 4], [1, 2.0, 3, 4], [1, 2, 3.0], [1, 2, 3, -4]):
        if t.chained and bad == [1, 2.0, 3, 4]:
            continue  # inside a node's span: a chained walk does not read it (the promise covers it)
        with pytest.raises(ValueError, match="not a uint64"):
            t.insert(bad, now=1.0)
        seq = tuple(bad)  # walked by a match first: the C build answers the insert's walk from its memo
        t.match(seq)
        with pytest.raises(ValueError, match="not a uint64"):
            t.insert(seq, now=1.0)
    assert t.num_nodes == 1 and blocks_of(t.insert([1, 2, 3], now=2.0)) == [(1, 2, 3)]
    t.check_invariants()


@pytest.mark.c_extension
@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_a_chained_tree_walks_by_the_chain() -> None:
    """chained=True: a walk reads a node's last covered block, then bisects. For chains that is the reference's
    answer wherever a query leaves a long node; for a broken chain (outside the promise) the node matches through
    its last block where the reference stops, which shows the walk does not read every block."""
    trees = [radix_py.RadixTree(), _radix_c.RadixTree(), _radix_c.RadixTree(chained=True)]
    assert [t.chained for t in trees] == [False, False, True]
    base = [(k + 1) * 0x9E3779B97F4A7C15 % 2**64 for k in range(1000)]
    for t in trees:
        t.insert(base, now=0.0)
    for k in range(1, 1001):
        left = tuple(base[:k] + [(h + 1) % 2**64 for h in base[k:]])  # a chain leaving the node at offset k
        short = tuple(base[:k])  # a chain that ends inside it
        assert [t.match(left).matched_blocks for t in trees] == [k] * 3, k
        assert [t.match(short).matched_blocks for t in trees] == [k] * 3, k
    broken = tuple(base[:500] + [12345] + base[501:])
    assert [t.match(broken).matched_blocks for t in trees] == [500, 500, 1000]
    for t in trees:
        t.check_invariants()


class _Int(int):
    """An int subclass: the C build reads exact ints from their digits and takes the API path for these."""


@pytest.mark.parametrize(
    "h",
    [0, 1, 2**30 - 1, 2**30, 2**60 - 1, 2**60, 2**63 + 12345, 2**64 - 1, True, _Int(7), _Int(2**64 - 1)],
)
def test_every_uint64_width_round_trips(impl, h: int) -> None:  # type: ignore[no-untyped-def]
    """One, two and three 30-bit digits (the last capped at 64 bits): stored, read back and matched as the value."""
    t = impl.RadixTree()
    other = int(h) ^ (2**64 - 1)  # its 64-bit complement: every width again, and never equal to it
    t.insert([h, other], now=0.0)
    assert blocks_of(t.walk([h])[0]) == [(int(h), other)]
    assert t.match([int(h), other]).matched_blocks == 2


@pytest.mark.parametrize("h", [2**64, 2**64 + 2**60, 2**90 - 1, 2**90, 2**200, -1, -(2**64), _Int(2**64), 1.0])
def test_values_past_uint64_are_refused(impl, h: object) -> None:  # type: ignore[no-untyped-def]
    """Past 64 bits (a third digit over 4 bits, or more digits), negative, or not an int: refused, never truncated."""
    t = impl.RadixTree()
    t.insert([h % 2**64 if isinstance(h, int) else 3], now=0.0)  # what a truncating read would find
    with pytest.raises(ValueError, match="not a uint64"):
        t.insert([h], now=0.0)
    assert t.match([h]).matched_blocks == 0
    assert t.walk([h])[1] == 0


def test_c_slot_limit() -> None:
    """`MAX_WORKERS` (E2's `max_workers`, which the registry enforces) is the build's real limit: that many workers
    hold state in one tree, one more raises, and a worker removed frees its slot for the next."""
    if _radix_c is None:
        pytest.skip("Cython extension not built")
    limit = _radix_c.MAX_WORKERS
    t = _radix_c.RadixTree()
    path = t.insert([1], now=0.0)
    for w in range(limit):
        t.assign(path, f"w{w}", now=0.0)
    with pytest.raises(RuntimeError, match=f"more than {limit} workers"):
        t.mark_resident("one-more", [1], None, now=0.0)
    t.remove_worker("w100")  # frees a slot in the second mask word
    t.mark_resident("one-more", [1], None, now=0.0)
    assert t.match([1]).resident_blocks == {"one-more": 1} and len(t.match([1]).assigned_blocks) == limit - 1
    t.check_invariants()


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_c_nodes_are_invisible_to_the_collector_and_never_leak() -> None:
    """Nodes are not tracked by the cyclic collector (a big tree made every full collection walk it), so the tree
    must free them by reference counting alone: with the collector off, nodes removed by gc and a whole tree
    dropped with nodes still held elsewhere all go, and the count of live nodes returns to where it started."""
    import gc
    import random

    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        base = _radix_c.live_nodes()
        rng = random.Random(7)
        t = _radix_c.RadixTree()
        held = []
        for i in range(400):
            head = [rng.randrange(1, 6)]
            seq = [*head, *(rng.randrange(1, 40) for _ in range(rng.randrange(1, 6)))]
            chain = [hash((tuple(seq[: k + 1]), "c")) & (2**63 - 1) for k in range(len(seq))]
            path = t.insert(chain, now=float(i))
            if i % 3 == 0:
                t.mark_resident(f"w{i % 4}", chain, None, now=float(i))
            if i % 5 == 0:
                t.assign(path, f"w{i % 4}", now=float(i))
            if i % 7 == 0:
                t.mark_evicted(f"w{i % 4}", chain[-1:])
            if i % 50 == 0:
                held.append(path[-1])
            if i % 97 == 0:
                t.remove_worker(f"w{rng.randrange(4)}")
        assert not gc.is_tracked(held[0]) and not gc.is_tracked(t.match(chain).path[0])
        assert _radix_c.live_nodes() >= base + t.num_nodes
        for w in range(4):
            t.remove_worker(f"w{w}")
        assert t.gc(1e9, 1.0) > 0 and t.num_nodes == 0  # all past the window, no worker left on any
        mine = {id(n): n for n in [*held, *path]}
        assert all(not n.is_attached for n in mine.values())
        assert _radix_c.live_nodes() == base + 1 + len(mine)  # the root and the nodes this test holds
        del held, path, mine
        assert _radix_c.live_nodes() == base + 1
        # a tree dropped whole: its nodes go, except one held here, which stays alive and detached
        for i in range(200):
            a = i % 9 + 1
            deep = t.insert([a, a * 100 + i % 13, (a * 100 + i % 13) * 10_000 + i], now=2e9)[-1]  # chained
        assert t.num_nodes > 200 and deep.parent.parent is not None
        del t
        assert not deep.is_attached and deep.parent is None and not deep.children
        assert _radix_c.live_nodes() == base + 1
        del deep
        assert _radix_c.live_nodes() == base
    finally:
        if was:
            gc.enable()


# ---- state machine: reference and Cython side by side -----------------------------------------------------

@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
@pytest.mark.parametrize("seed", range(4))
def test_block_set_behaves_as_a_set(seed: int) -> None:
    """The C build's `BlockSet` against `set` over random adds, discards, updates and difference updates of values
    that collide in its table (few distinct low bits) and of every width, through growth and backward-shift
    deletions: membership, size and contents agree after every operation."""
    import random

    rng = random.Random(seed)
    pool = [rng.choice([k, k << 40, ((k % 16) << 60) | k, 2**64 - 1 - k]) for k in range(3000)]
    bs, ref = _radix_c.RadixTree.block_set(), set()
    assert isinstance(bs, _radix_c.BlockSet) and not bs and bs == set()
    for step in range(4000):
        op = rng.random()
        batch = rng.sample(pool, rng.randint(0, 40))
        if op < 0.3:
            bs.update(batch)
            ref.update(batch)
        elif op < 0.55:
            bs.difference_update(tuple(batch) + (-1, 2**64))  # values past uint64 are not members
            ref.difference_update(batch)
        elif op < 0.7:
            for h in batch[:5]:
                bs.add(h)
                ref.add(h)
        else:
            for h in batch[:5]:
                bs.discard(h)
                ref.discard(h)
        assert len(bs) == len(ref) and bool(bs) == bool(ref)
        probe = rng.sample(pool, 20)
        assert [h in bs for h in probe] == [h in ref for h in probe], step
        assert bs.intersection(probe + [-1]) == ref.intersection(probe)
        if step % 500 == 0:
            assert sorted(bs) == sorted(ref) and bs == ref
    assert sorted(bs) == sorted(ref) and len(ref) > 500
    for bad in (-1, 2**64, 1.5):
        assert bad not in bs
        bs.discard(bad)
        with pytest.raises(ValueError, match="not a uint64"):
            bs.add(bad)
        with pytest.raises(ValueError, match="not a uint64"):
            bs.update([bad])
    bs.difference_update(list(ref))
    assert len(bs) == 0 and bs == set()


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_a_block_set_emptied_after_a_burst_gives_its_table_back() -> None:
    """E2's evicted sets fill in a burst and empty as the blocks are stored again or collected: the table shrinks
    below load 0.1 (`sys.getsizeof` reads it), keeping every member, and grows again with the next burst."""
    import sys

    burst = [(k * 0x9E3779B97F4A7C15) % 2**64 for k in range(1, 50_001)]
    bs = _radix_c.BlockSet(burst)
    peak = sys.getsizeof(bs)
    assert peak >= len(burst) / 0.7 * 9
    for cut in range(0, 49_000, 7_000):  # remove in steps, checking the members at each
        bs.difference_update(burst[cut : cut + 7_000])
        kept = burst[cut + 7_000 :]
        assert len(bs) == len(kept) and all(h in bs for h in kept[::97]) and burst[cut] not in bs
    bs.difference_update(burst[49_000:49_990])
    assert sorted(bs) == sorted(burst[49_990:])
    assert sys.getsizeof(bs) <= 1_024 * 9 + 256  # the smallest table that shrinks
    bs.update(burst)
    assert len(bs) == len(burst) and sys.getsizeof(bs) == peak
    # a table this large prefetches ahead in update and difference_update (past 32k slots); as `set`'s, an update
    # stops at the first value that is not a uint64, the ones before it added, and a difference update skips it
    with pytest.raises(ValueError, match="not a uint64"):
        bs.update([1, 2, -1, 3])
    assert 1 in bs and 2 in bs and 3 not in bs and len(bs) == len(burst) + 2
    bs.difference_update([1, 2**64, 2, burst[0]])
    assert 1 not in bs and 2 not in bs and burst[0] not in bs and len(bs) == len(burst) - 1


TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=0, max_size=7)
WORKERS = st.sampled_from(["w0", "w1", "w2"])


def snapshot(tree) -> tuple:  # type: ignore[no-untyped-def]
    nodes = []
    for n in tree.nodes():
        parent = None if n.parent is None else tuple(n.parent.blocks)
        nodes.append(
            (
                tuple(n.blocks),
                n.num_blocks,
                n.first_block == n.blocks[0],
                n.context_blocks,
                parent,
                tuple(sorted(n.children)),
                tuple(sorted(n.resident.items())),
                tuple(n.resident_on(w) for w in ("w0", "w1", "w2", "absent")),  # = resident.get(w, 0)
                tuple(sorted(n.assigned)),
                tuple(sorted(n.evictions)),
                tuple(n.has_evictions(w) for w in ("w0", "w1", "w2", "absent")),  # = w in evictions
                n.last_access,
                n.is_attached,
                n.stats,
                n.seq,
            )
        )
    return tree.num_nodes, tree.num_blocks, sorted(nodes)


def match_view(m) -> tuple:  # type: ignore[no-untyped-def]
    key = None if m.key_node is None else tuple(m.key_node.blocks)
    return blocks_of(m.path), m.matched_blocks, m.resident_blocks, m.assigned_blocks, key


def dead_by_definition(tree: object, now: float, window_s: float) -> list:
    """What gc must remove, from the definition over every node (a post-order pass: a node with no resident
    worker, idle for more than the window, whose children all go too), independent of gc's candidate queue."""
    dead: list = []
    gone: set[int] = set()
    for node in reversed(tree.nodes()):  # type: ignore[attr-defined]
        if node.resident or any(id(c) not in gone for c in node.children.values()):
            continue
        if now - node.last_access > window_s:
            gone.add(id(node))
            dead.append(node)
    return dead


class SideBySide(RuleBasedStateMachine):
    """Random operation sequences on both builds; every observable result is compared after each step."""

    def __init__(self) -> None:
        super().__init__()
        # the reference, the C build, and the C build walking by the chain (E2's): the rules' hashes are chains
        self.trees = [radix_py.RadixTree()] + (
            [_radix_c.RadixTree(), _radix_c.RadixTree(chained=True)] if _radix_c is not None else []
        )
        self.hash_of: dict[tuple[int, ...], int] = {}  # token prefix -> chained "block hash"
        self.chains: dict[tuple[int, ...], tuple[int, ...]] = {}  # tokens -> their one tuple of hashes
        self.paths: list[list] = []  # per insert: the path from each tree
        self.held: dict[str, set[int]] = {}  # model: blocks each worker's cache really holds
        self.evs: list[dict] = [{} for _ in self.trees]  # per tree, E2's evicted sets: its own `block_set()`s
        self.now = 0.0

    def chain(self, tokens: list[int]) -> tuple[int, ...]:
        """The hashes of tokens, as the same tuple object each time (a RoutingContext's `block_hashes`, walked by
        select and then by the dispatch's insert): the C build answers a walk of the tuple it walked last from a
        memo until the tree's shape changes, and the reference has none, so a stale memo shows as a difference."""
        key = tuple(tokens)
        got = self.chains.get(key)
        if got is not None:
            return got
        out = []
        for i in range(1, len(tokens) + 1):
            prefix = tuple(tokens[:i])
            if prefix not in self.hash_of:  # large, distinct, deterministic uint64 values
                self.hash_of[prefix] = ((len(self.hash_of) + 1) * 0x9E3779B97F4A7C15) % 2**64
            out.append(self.hash_of[prefix])
        got = self.chains[key] = tuple(out)
        return got

    def tick(self, dt: float) -> float:
        self.now += dt
        return self.now

    def same(self, results: list) -> None:
        for r in results[1:]:
            assert r == results[0]

    @rule(tokens=TOKENS, dt=st.sampled_from([0.0, 1.0, 30.0]))
    def insert(self, tokens: list[int], dt: float) -> None:
        hashes, now = self.chain(tokens), self.tick(dt)
        paths = [t.insert(hashes, now) for t in self.trees]
        self.same([blocks_of(p) for p in paths])
        self.paths.append(paths)

    @rule(tokens=TOKENS)
    def match(self, tokens: list[int]) -> None:
        hashes = self.chain(tokens)
        results = [t.match(hashes) for t in self.trees]
        self.same([match_view(m) for m in results])
        for t, m in zip(self.trees, results, strict=True):  # walk: match's path and count, nothing else
            path, matched = t.walk(hashes)
            assert [id(n) for n in path] == [id(n) for n in m.path] and matched == m.matched_blocks
        # claim 10: a reported resident run is held by the worker's cache, block by block
        for w, r in results[0].resident_blocks.items():
            assert set(hashes[:r]) <= self.held.get(w, set()), (w, r)

    @rule(
        tokens=TOKENS,
        evicted=st.dictionaries(WORKERS, st.sets(st.integers(min_value=0, max_value=6))),
        upto=st.integers(min_value=0, max_value=8),
        study=st.booleans(),
        workers=st.one_of(st.just(["w2", "w0", "wx", "w1"]), st.lists(st.sampled_from(["w2", "w0", "wx", "w1"]))),
    )
    def match_cached(
        self, tokens: list[int], evicted: dict[str, set[int]], upto: int, study: bool, workers: list[str]
    ) -> None:
        """Any workers in any order, repeats and ones left out included ("wx" never holds anything): a worker with
        a run that was not asked is not answered."""
        hashes = self.chain(tokens)
        ev = {w: {hashes[i] for i in idx if i < len(hashes)} for w, idx in evicted.items()}
        results = [t.match_cached(hashes, workers, ev) for t in self.trees]
        for t in self.trees:  # each build's own set type (the C one's BlockSet is read in C), and a plain set
            own = {}
            for w, hs in ev.items():
                own[w] = t.block_set()
                own[w].update(sorted(hs))
            assert t.match_cached(hashes, workers, own)[:2] == results[0][:2]
        self.same([(list(c.items()), best, blocks_of(p)) for c, best, p in results])
        assert list(results[0][0]) == list(dict.fromkeys(workers))
        assert results[0][1] == max(results[0][0].values(), default=0)
        m = self.trees[0].match(hashes)  # the definition, from match's runs
        for w in workers:
            r, a = m.resident_blocks.get(w, 0), m.assigned_blocks.get(w, 0)
            a = next((k for k in range(r, a) if hashes[k] in ev.get(w, set())), a)
            assert results[0][0][w] == max(r, a)
        portions = [t.key_portion(p, upto, study) for t, (_, _, p) in zip(self.trees, results, strict=True)]
        self.same([(None if n is None else tuple(n.blocks), end) for n, end in portions])

    @precondition(lambda self: self.paths)
    @rule(i=st.integers(min_value=0), worker=WORKERS, dt=st.sampled_from([0.0, 5.0]))
    def assign(self, i: int, worker: str, dt: float) -> None:
        now = self.tick(dt)
        for t, p in zip(self.trees, self.paths[i % len(self.paths)], strict=True):
            t.assign(p, worker, now)

    @precondition(lambda self: self.paths)
    @rule(i=st.integers(min_value=0), k=st.integers(min_value=0), worker=WORKERS)
    def note_evictions(self, i: int, k: int, worker: str) -> None:
        paths = self.paths[i % len(self.paths)]
        if paths[0]:
            got = [t.note_evictions(p[k % len(p)], worker) for t, p in zip(self.trees, paths, strict=True)]
            self.same(got)
            node = paths[0][k % len(paths[0])]
            assert got[0] == (worker in node.assigned)  # noted only where assigned, the set then holds it
            assert not got[0] or worker in node.evictions

    @rule(
        worker=WORKERS,
        tokens=TOKENS,
        cut=st.sampled_from([0, 0, 0, 1, 2, 3]),  # mostly whole chains: a parent unknown to the tree is ignored
        orphan=st.sampled_from([False] * 7 + [True]),
    )
    def mark_resident(self, worker: str, tokens: list[int], cut: int, orphan: bool) -> None:
        hashes = self.chain(tokens)
        cut = min(cut, len(hashes))
        parent = hashes[cut - 1] if cut else None
        if orphan:
            parent = 12345  # never a chained hash here: the tree ignores the event
        self.held.setdefault(worker, set()).update(hashes[cut:])  # the worker's cache holds them either way
        for t in self.trees:
            t.mark_resident(worker, hashes[cut:], parent, self.now)

    @rule(worker=WORKERS, tokens=st.just([]) | TOKENS, data=st.data())
    def mark_evicted(self, worker: str, tokens: list[int], data: st.DataObject) -> None:
        candidates = list(self.chain(tokens)) + sorted(self.held.get(worker, ()))  # mostly blocks it holds
        evicted = data.draw(st.lists(st.sampled_from(candidates), max_size=3)) if candidates else []
        if data.draw(st.booleans()):  # or a chain's tail, as a worker evicts it: tail first or head first
            tail = self.chain(tokens)[data.draw(st.integers(0, 3)):]
            evicted = tail[::-1] if data.draw(st.booleans()) else tail
        self.held.get(worker, set()).difference_update(evicted)
        for t, evs in zip(self.trees, self.evs, strict=True):
            t.mark_evicted(worker, evicted)
            if worker not in evs:
                evs[worker] = t.block_set()
            evs[worker].update(evicted)  # any block (E2 adds only assigned ones): gc prunes the removed nodes'

    # NOTE: "keep" makes this rule a no-op 3 times in 4, or the workers would rarely hold anything long enough.
    @rule(worker=WORKERS, how=st.sampled_from(["clear_worker", "unassign_worker", "remove_worker"] + ["keep"] * 9))
    def drop_worker(self, worker: str, how: str) -> None:
        if how == "keep":
            return
        if how != "unassign_worker":
            self.held.pop(worker, None)
        for t in self.trees:
            getattr(t, how)(worker)

    @rule(window=st.sampled_from([0.0, 10.0, 60.0]), dt=st.sampled_from([0.0, 20.0]),
          budget=st.sampled_from([None, None, 0, 1, 3]))
    def gc(self, window: float, dt: float, budget: int | None) -> None:
        now = self.tick(dt)
        expected = [dead_by_definition(t, now, window) for t in self.trees]
        before = [{id(x): (tuple(x.blocks), set(x.assigned)) for x in exp} for exp in expected]
        outs: list[list] = [[] for _ in self.trees]
        sets_before = [{w: set(hs) for w, hs in evs.items()} for evs in self.evs]
        visits = [t.gc_visits for t in self.trees]
        got = [t.gc(now, window, budget, out, evicted=evs) for t, out, evs in zip(self.trees, outs, self.evs, strict=True)]
        for t, exp, n, was, out, evs, ev0, v0 in zip(self.trees, expected, got, before, outs, self.evs, sets_before,
                                                     visits, strict=True):
            gone = [x for x in exp if not x.is_attached]
            assert len(gone) == n  # only nodes the definition removes
            assert sorted(out) == sorted(was[id(x)] for x in gone if was[id(x)][1])  # (blocks, assigned) as it was
            for x in gone:  # a removed node's blocks leave the sets of the workers it was assigned to, no others
                for w in was[id(x)][1]:
                    ev0.get(w, set()).difference_update(was[id(x)][0])
            assert {w: set(hs) for w, hs in evs.items()} == ev0
            visited = t.gc_visits - v0
            assert visited >= len(gone)
            if budget is None:
                assert len(gone) == len(exp)
            elif len(gone) < len(exp):  # stopped at the visit that took the blocks freed plus the candidates
                # visited to the budget; the rest stay for the next call
                work = sum(x.num_blocks for x in gone) + visited
                assert budget <= work < budget + 1 + max(x.num_blocks for x in exp)
                assert dead_by_definition(t, now, window) == [x for x in exp if x.is_attached]
        if budget is not None:
            # which dead nodes a budgeted pass takes first follows each build's candidate queue (unspecified);
            # a pass without a budget completes it, and the trees are identical again
            rest = [t.gc(now, window, evicted=evs) for t, evs in zip(self.trees, self.evs, strict=True)]
            self.same([g + r for g, r in zip(got, rest, strict=True)] + [len(expected[0])])
        else:
            self.same(got)
        self.same([{w: sorted(hs) for w, hs in evs.items()} for evs in self.evs])  # the same blocks pruned

    @rule(tokens=TOKENS, value=st.integers(min_value=0, max_value=3))
    def set_stats(self, tokens: list[int], value: int) -> None:
        for t in self.trees:
            m = t.match(self.chain(tokens))
            if m.path:
                m.path[-1].stats = value

    @invariant()
    def identical_and_consistent(self) -> None:
        for t in self.trees:
            t.check_invariants()
        self.same([snapshot(t) for t in self.trees])
        hashes = list(self.hash_of.values())[:40]
        hashes = hashes + hashes[::-1]  # chains head first, then tail first
        for h in hashes:
            self.same([(None if p is None else (tuple(p[0].blocks), p[1])) for p in (t.node_of(h) for t in self.trees)])
        self.same([[(tuple(n.blocks), i, j) for n, i, j in t.runs_of(hashes)] for t in self.trees])
        for t in self.trees:  # the definition: consecutive positions whose node_of is one node, unknown ones skipped
            want: list[tuple[object, int, int]] = []
            for i, h in enumerate(hashes):
                if (p := t.node_of(h)) is not None:
                    if want and want[-1][0] is p[0] and want[-1][2] == i:
                        want[-1] = (p[0], want[-1][1], i + 1)
                    else:
                        want.append((p[0], i, i + 1))
            assert t.runs_of(hashes) == want


SideBySide.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
test_side_by_side = SideBySide.TestCase


class SideBySideManySlots(SideBySide):
    """The same, with 127 other workers holding a block each, so the rules' three workers take slots 70, 100 and
    129: the Cython build's second and third mask words, where a fleet of three never goes."""

    def __init__(self) -> None:
        super().__init__()
        for t in self.trees:
            for i in range(130):
                t.mark_resident(f"filler{i}", [2**63 + i], None, 0.0)
            for i in (70, 100, 129):
                t.remove_worker(f"filler{i}")


SideBySideManySlots.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
test_side_by_side_past_the_first_mask_word = SideBySideManySlots.TestCase


def test_bench_smoke(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from switchyard.bench.micro import radix as bench

    against = ["--growth-against", "HEAD"] if _radix_c is not None else []
    args = ["--nodes", "300", "--ops", "50", "--growth-blocks", "5000", "--growth-paces", "0", "1000", *against,
            "--out", str(tmp_path)]
    assert bench.main(args) == 0
    out = __import__("json").loads((tmp_path / "radix.json").read_text())
    rows = out["rows"]
    assert {r["impl"] for r in rows} == ({"py", "c", "c-chained"} if _radix_c is not None else {"py"})
    assert all(r["nodes"] >= 300 and r["match_p50_us"] > 0 and r["cold_insert_p50_us"] > 0 for r in rows)
    growth = {(r["impl"], r["pace_per_s"]): r for r in out["growth"]}
    builds = {"c@HEAD", "c", "py"} if _radix_c is not None else {"py"}
    assert set(growth) == {(b, pace) for b in builds for pace in (0.0, 1000.0)}
    assert all(r["blocks"] >= 5000 and r["inserts"] == 9 and r["insert_max_ms"] > 0 for r in growth.values())
    # then collected (9 prompts: none kept): today's C build gives its index back
    assert all(r["kept_blocks"] == 0 and r["gc_calls"] >= 4 for r in growth.values())
    if _radix_c is not None:
        assert all(growth[("c", pace)]["index_mib_end"] < growth[("c", pace)]["index_mib_peak"] for pace in (0.0, 1000.0))


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_block_index_past_two_mib() -> None:
    """Past 2 MiB (131,072 slots) the index's table takes its other allocation path (mapped, zeroed by the kernel
    on first touch, advised to huge pages, faulted in by a thread): 150k blocks grow it through that size and
    beyond, and every block is found, stored, evicted and collected as in the reference. Whether the kernel backs
    it with huge pages is not asserted (it is advice; the speed is the bench's)."""
    import random

    rng = random.Random(7)
    trees = [radix_py.RadixTree(), _radix_c.RadixTree()]
    prompts = [[rng.getrandbits(64) for _ in range(600)] for _ in range(250)]
    for i, hs in enumerate(prompts):
        for t in trees:
            t.insert(hs, float(i))
            if i % 2:
                t.mark_resident("w0", hs[:300], None, float(i))
    assert trees[1].num_blocks == trees[0].num_blocks == 150_000
    probe = [h for hs in prompts[::7] for h in hs[::13]]
    assert [trees[1].node_of(h)[1] for h in probe] == [trees[0].node_of(h)[1] for h in probe]
    for t in trees:
        t.clear_worker("w0")
        assert t.gc(1000.0, 10.0) == 250
        assert t.num_blocks == 0 and all(t.node_of(h) is None for h in probe)
        t.check_invariants()


def apply_op(tree, kind: str, hashes: list[int], now: float) -> None:  # type: ignore[no-untyped-def]
    """One of the block index's writers on `tree`: insert, store on w0, evict from w0 (in reverse, as an LRU
    drops a chain's tail first), or collect (w0 cleared, nodes unused for a minute removed)."""
    if kind == "insert":
        tree.insert(hashes, now)
    elif kind == "store":
        tree.mark_resident("w0", hashes, None, now)
    elif kind == "evict":
        tree.mark_evicted("w0", hashes[::-1])
    else:
        tree.clear_worker("w0")
        tree.gc(now, 60.0)


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
@pytest.mark.parametrize("seed", range(3))
def test_block_index_at_scale_matches_the_reference(seed: int) -> None:
    """The Cython build's open-addressing block index through many doublings and deletions (probe runs that wrap
    around the table, backward shifts): ~30k blocks inserted, stored, evicted and collected on both builds,
    then every hash ever used is looked up in both and the trees compared (check_invariants scans every slot)."""
    import random

    rng = random.Random(seed)
    trees = [radix_py.RadixTree(), _radix_c.RadixTree()]
    used: list[int] = []
    prefixes = [[rng.getrandbits(64) for _ in range(rng.randint(1, 40))] for _ in range(30)]
    small = seed == 0  # small sequential ints: the worst case for an unmixed hash
    now = 0.0
    for step in range(600):
        now += 0.5
        if small:
            hashes = [step * 100 + i for i in range(rng.randint(1, 80))]
        else:
            hashes = rng.choice(prefixes) + [rng.getrandbits(64) for _ in range(rng.randint(0, 80))]
        used += hashes
        kind = rng.choices(["insert", "store", "evict"], [5, 3, 2])[0]
        for t in trees:
            apply_op(t, kind, hashes, now)
            if step % 50 == 49:
                t.gc(now, 20.0)
    for t in trees:
        t.check_invariants()
    assert trees[1].num_blocks == trees[0].num_blocks > 1000
    assert snapshot(trees[0]) == snapshot(trees[1])
    for h in used:
        a, b = (t.node_of(h) for t in trees)
        assert (a is None) == (b is None) and (a is None or (tuple(a[0].blocks), a[1]) == (tuple(b[0].blocks), b[1]))


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_block_index_grows_in_steps_while_every_operation_goes_on() -> None:
    """A full index (load 0.7) moves into its larger table a few slots per new block, not at once: the tree is
    `growing` across many operations, and meanwhile inserts, stores, evictions, lookups and collections (deletions
    from either table) give the reference's results, with both tables checked after each step."""
    import random

    rng = random.Random(3)
    trees = [radix_py.RadixTree(), _radix_c.RadixTree()]
    first = [rng.getrandbits(64) for _ in range(700)]  # 1,024 slots at first: 700 blocks stay below 0.7
    for t in trees:
        t.insert(first, 0.0)
    assert not trees[1].growing
    used, steps_growing, peak, now = list(first), 0, 0, 0.0
    for _ in range(400):
        now += 1.0
        hashes = rng.choice([first[:rng.randint(1, 700)], used[-rng.randint(1, 40):]])
        hashes = hashes + [rng.getrandbits(64) for _ in range(rng.randint(1, 30))]
        used += hashes
        kind = rng.choices(["insert", "store", "evict", "collect"], [13, 4, 2, 1])[0]  # collect: either table
        for t in trees:
            apply_op(t, kind, hashes, now)
            t.check_invariants()
        steps_growing += trees[1].growing
        peak = max(peak, trees[1].num_blocks)
        assert trees[1].num_blocks == trees[0].num_blocks
        probe = rng.sample(used, 50)
        a, b = ([t.node_of(h) for h in probe] for t in trees)
        assert [x if x is None else (tuple(x[0].blocks), x[1]) for x in a] == [
            y if y is None else (tuple(y[0].blocks), y[1]) for y in b
        ]
    assert peak > 1_500  # past 0.7 of 1,024 slots and of 2,048
    assert steps_growing >= 10  # each doubling spans operations (a one-shot rehash: never growing between them)
    assert snapshot(trees[0]) == snapshot(trees[1])


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_the_next_table_is_faulted_in_off_the_callers_thread_and_dropping_the_tree_stops_it() -> None:
    """At load 0.6 of a table past 1 MiB the next one (32 MiB here) is mapped and a thread writes to its pages, so
    the kernel's page faults are not the dispatching thread's; dropping the tree meanwhile stops that thread before
    the mapping is freed (without, the thread writes to unmapped memory: the process dies)."""
    import gc as collector
    import threading

    def touchers() -> list[threading.Thread]:
        return [th for th in threading.enumerate() if th.name == "switchyard-radix-grow"]

    for _ in range(3):
        t = _radix_c.RadixTree()
        t.insert(range(1, 629_000), 0.0)  # 2**20 slots: 0.6 of it is 629,146 blocks
        assert not touchers()
        t.insert(range(629_000, 630_000), 0.0)
        started = touchers()
        assert started
        del t
        collector.collect()
        for th in started:
            th.join(timeout=30)
            assert not th.is_alive()


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_a_child_forked_while_the_next_table_is_faulted_in_still_grows() -> None:
    """A fork copies the tree but not the thread faulting its next table in: the child must not wait for that
    thread at its next doubling (it would spin forever); it grows and answers as the parent's copy would."""
    import multiprocessing
    import threading

    def grow_on(tree, queue) -> None:  # type: ignore[no-untyped-def]
        tree.insert(range(630_000, 900_000), 1.0)  # past 0.85 of 2**20 slots: the next table is due however far
        queue.put((tree.num_blocks, tree.node_of(5)[1], tree.node_of(899_999)[1]))

    t = _radix_c.RadixTree()
    t.insert(range(1, 629_000), 0.0)
    t.insert(range(629_000, 630_000), 0.0)  # load 0.6: the next table's thread starts
    assert any(th.name == "switchyard-radix-grow" for th in threading.enumerate())
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=grow_on, args=(t, queue))
    child.start()
    child.join(timeout=30)
    if child.exitcode is None:
        child.kill()
    assert child.exitcode == 0
    assert queue.get(timeout=5) == (899_999, 4, 269_999)


def test_a_walk_memo_never_outlives_a_change_of_shape() -> None:
    """The C build answers a walk of the tuple it walked last from a memo (`_walk`): every change to the nodes'
    spans or links must drop it, or the next walk reports the old path (a leaf, a split, a gc removal)."""
    if _radix_c is None:
        pytest.skip("compiled radix tree not built")
    tree = _radix_c.RadixTree()
    whole, head = (11, 12, 13), (11, 12)
    assert tree.walk(whole) == ([], 0)
    tree.insert(whole, 1.0)  # a leaf under the root
    path, matched = tree.walk(whole)
    assert [n.num_blocks for n in path] == [3] and matched == 3
    assert tree.walk(head)[1] == 2
    tree.insert(head, 1.0)  # splits the leaf at 2
    path, matched = tree.walk(head)
    assert [n.num_blocks for n in path] == [2] and matched == 2
    path, matched = tree.walk(whole)
    assert [n.num_blocks for n in path] == [2, 1] and matched == 3
    assert tree.gc(100.0, 10.0) == 2  # both nodes: nothing resident or assigned, past the window
    assert tree.walk(whole) == ([], 0)
    strict = (11, 12.5)  # a walk that stopped at a bad hash does not answer insert's strict one wrongly
    assert tree.walk(strict) == ([], 0)
    with pytest.raises(ValueError):
        tree.insert(strict, 101.0)


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_the_block_index_gives_memory_back_once_collection_empties_it() -> None:
    """A tree that grew to 6,000 blocks and was then collected down to one 200-block node gives its index back
    over the next collections (the grow under way finished, the smallest table mapped, then moved into), while
    inserts, stores, evictions and lookups between them give the reference's results; it grows again after.
    (A small table moves within one collection; the next test moves a large one in steps.)"""
    import random

    rng = random.Random(5)
    trees = [radix_py.RadixTree(), _radix_c.RadixTree()]
    chains = [[rng.getrandbits(64) for _ in range(200)] for _ in range(30)]  # 6,000 blocks: 16,384 slots
    for t in trees:
        for c in chains:
            t.insert(c, 0.0)
        t.mark_resident("w1", chains[0][:40], None, 0.0)  # survives collection
    full = trees[1].index_bytes
    assert full >= 16_384 * 16
    now, shrunk_steps = 100.0, 0
    for step in range(12):
        now += 1.0
        kind = ["collect", "insert", "store", "evict"][step % 4]  # the first: all but the stored run go
        hashes = chains[0][:rng.randint(1, 40)] + [rng.getrandbits(64) for _ in range(rng.randint(0, 3))]
        for t in trees:
            apply_op(t, kind, hashes, now) if kind != "collect" else t.gc(now, 60.0)
            t.check_invariants()
        shrunk_steps += trees[1].growing  # moving into the smaller table
        assert snapshot(trees[0]) == snapshot(trees[1])
        probe = chains[0] + rng.sample(chains[1], 20)
        assert [n is None for n in map(trees[0].node_of, probe)] == [n is None for n in map(trees[1].node_of, probe)]
    assert trees[1].index_bytes == 1_024 * 16 < full  # ~200 blocks: the smallest table
    assert shrunk_steps == 0  # a small old table is moved within one collection
    for t in trees:  # and it grows back
        for c in chains:
            t.insert(c, now + 1.0)
        t.check_invariants()
    assert trees[1].index_bytes >= 16_384 * 16
    assert snapshot(trees[0]) == snapshot(trees[1])


@pytest.mark.skipif(_radix_c is None, reason="the Cython build did not load (test_c_extension_loaded fails)")
def test_a_large_index_shrinks_in_steps_with_its_pages_faulted_in_off_the_callers_thread() -> None:
    """Collected from ~600k blocks down to 40k, the index (16 MiB, and its next table mapped at load 0.6, 32 MiB
    more) first drops the next table, then maps a 4 MiB one whose pages a thread faults in, moves into it once that
    thread is done, a slice of the old table per collection, and unmaps the old one; every surviving block stays
    found throughout. A pending small table is dropped if the tree grows back before the move."""
    import threading

    def touchers() -> list[threading.Thread]:
        return [th for th in threading.enumerate() if th.name == "switchyard-radix-grow"]

    def settle(t, now: float) -> None:  # type: ignore[no-untyped-def]
        for th in touchers():
            th.join(timeout=30)
        t.gc(now, 1.0)

    t = _radix_c.RadixTree()
    for start in range(1, 40_001, 1_000):  # kept: 40 nodes (check_invariants scans a node per block)
        t.insert(range(start, start + 1_000), 0.0)
        t.mark_resident("w0", range(start, start + 1_000), None, 0.0)
    for start in range(40_001, 640_001, 100_000):
        t.insert(range(start, start + 100_000), 0.0)  # collectable
    for th in touchers():
        th.join(timeout=30)
    assert t.index_bytes == (2**20 + 2**21) * 16  # load 0.61 of 2**20 slots: the next table is mapped
    assert t.gc(10.0, 1.0) == 6
    assert t.num_blocks == 40_000
    # load 0.04: the next table unmapped, and the smallest holding 40k blocks at <= 0.25 mapped (2**18 slots)
    assert t.index_bytes == (2**20 + 2**18) * 16 and not t.growing
    t.insert(range(40_001, 200_001), 11.0)  # the tree grows back (load 0.19) before the move: not moved
    settle(t, 12.0)
    assert t.index_bytes == 2**20 * 16 and not t.growing
    assert t.gc(20.0, 1.0) == 1
    settle(t, 21.0)  # the small table mapped again; its pages in
    settle(t, 22.0)  # the move starts: 2**14 old slots per collection
    collections = 0
    while t.growing:
        assert t.node_of(1)[1] == 0 and t.node_of(40_000)[1] == 999
        if collections % 16 == 0:
            t.check_invariants()
        t.gc(23.0 + collections, 1.0)
        collections += 1
    assert 60 <= collections <= 64  # 2**20 old slots, 2**14 per collection (the first slice moved at the switch)
    assert t.index_bytes == 2**18 * 16
    t.check_invariants()
    assert [t.node_of(h)[1] for h in (1, 20_000, 40_000)] == [0, 999, 999]
