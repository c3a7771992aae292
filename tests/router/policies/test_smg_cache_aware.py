"""smg_cache_aware: SMG's approximate tree, imbalance switch, match threshold and smallest-tree fallback."""

from __future__ import annotations

import pytest
from factories import make_fleet

from switchyard.router.fleet import Fleet
from switchyard.router.policies.base import Decision, RoutingContext, WorkerId
from switchyard.router.policies.smg_cache_aware import ApproxTree, SmgCacheAware, SmgCacheAwareConfig


def req(rid: str, tokens: list[int] | range) -> RoutingContext:
    return RoutingContext(request_id=rid, model="m", prompt_token_ids=tuple(tokens), block_hashes=(), max_tokens=8,
                          arrival_s=0.0)


def route(policy: SmgCacheAware, fleet: Fleet, ctx: RoutingContext, now: float = 0.0) -> str:
    d = policy.select(ctx, fleet, now)
    assert d is not None
    fleet.note_dispatch(d.worker_id)
    policy.on_dispatch(ctx, d, now)
    return d.worker_id


def seed(policy: SmgCacheAware, wid: str, tokens: list[int] | range, now: float = 0.0) -> None:
    """As if this router had sent `tokens` to `wid` (tree only, no in-flight)."""
    policy.on_dispatch(req("seed", tokens), Decision(worker_id=WorkerId(wid)), now)


def test_tree_split_sizes_and_match() -> None:
    t = ApproxTree()
    t.insert([1, 2, 3, 4], "w0", 0.0)
    t.insert([1, 2, 5, 6], "w1", 1.0)  # splits [1,2,3,4] into [1,2] -> {[3,4], [5,6]}
    assert t.tenant_size == {"w0": 4, "w1": 4}  # w1: [1,2] (2) + [5,6] (2)
    assert t.match([1, 2, 3, 9], {"w0", "w1"}) == (3, ["w0"])  # partial edge [3,4] counts 1 token
    assert sorted(t.match([1, 2, 7], {"w0", "w1"})[1]) == ["w0", "w1"]
    assert t.match([1, 2, 7], {"w1"}) == (2, ["w1"])  # holders restricted to candidates
    assert t.match([9], {"w0", "w1"}) == (0, [])


def test_tree_evicts_lru_leaves_per_worker() -> None:
    t = ApproxTree()
    t.insert([1, 2, 3, 4], "w0", 0.0)
    t.insert([1, 2, 7, 8], "w0", 5.0)
    t.insert([1, 2, 3, 4], "w1", 1.0)
    assert t.tenant_size == {"w0": 6, "w1": 4}  # w0: [1,2] + [3,4] + [7,8]
    assert t.evict_tenant_by_size(4) == 2  # w0 over by 2: its LRU leaf [3,4] (t=0) goes; w1 (4) fits
    assert t.tenant_size == {"w0": 4, "w1": 4}
    assert t.match([1, 2, 3, 4], {"w0"}) == (2, ["w0"])
    assert t.match([1, 2, 3, 4], {"w1"}) == (4, ["w1"])  # the node survives for w1
    assert t.evict_tenant_by_size(0) == 8  # everything, leaves first, then their parents
    assert t.tenant_size == {"w0": 0, "w1": 0} and not t.root.children


# (case, tree contents per worker, in-flight per worker, prompt, expected pick, reason prefix)
PREFIX = list(range(10))
CASES = [
    # balanced (loads 0,0,0); w1 was sent [0..9]; prompt [0..7]+2 new: 8/10 = 0.8 > 0.3 -> w1
    ("match above threshold", {"w1": PREFIX}, [0, 0, 0], PREFIX[:8] + [100, 101], "w1", "match 8/10"),
    # 2/10 = 0.2 <= 0.3 -> smallest tree: w0 20 tok, w1 10, w2 0 -> w2
    ("miss -> smallest tree", {"w0": range(50, 70), "w1": PREFIX}, [0, 0, 0], [0, 1] + list(range(200, 208)), "w2",
     "miss 2/10"),
    # exactly at the threshold is a miss: 3/10 = 0.3, not > 0.3; smallest tree is w0 (0 tok)
    ("threshold is strict", {"w1": PREFIX, "w2": PREFIX}, [0, 0, 0], [0, 1, 2] + list(range(300, 307)), "w0",
     "miss 3/10"),
    # imbalanced: 100 - 30 = 70 > 64 and 100 > 1.5 x 30 = 45 -> least in-flight w1, ignoring w0's 100% match
    ("imbalanced -> least load", {"w0": PREFIX}, [100, 30, 40], PREFIX, "w1", "imbalanced"),
    # 300 - 210 = 90 > 64 but 300 <= 1.5 x 210 = 315: balanced, so the cache decides -> w0
    ("relative test keeps balance", {"w0": PREFIX}, [300, 210, 220], PREFIX, "w0", "match 10/10"),
    # 70 - 10 = 60 <= 64: balanced though 70 > 1.5 x 10 -> w0
    ("absolute test keeps balance", {"w0": PREFIX}, [70, 10, 10], PREFIX, "w0", "match 10/10"),
]


@pytest.mark.parametrize(("case", "trees", "loads", "prompt", "want", "why"), CASES, ids=[c[0] for c in CASES])
def test_worked_examples(case: str, trees: dict, loads: list[int], prompt: list[int], want: str, why: str) -> None:
    fleet, policy = make_fleet(3), SmgCacheAware()
    for wid, tokens in trees.items():
        seed(policy, wid, tokens)
    for i, n in enumerate(loads):
        for _ in range(n):
            fleet.note_dispatch(WorkerId(f"w{i}"))
    d = policy.select(req("r", prompt), fleet, 0.0)
    assert d is not None and d.worker_id == want and d.reason.startswith(why)


def test_imbalanced_dispatch_still_updates_the_tree() -> None:
    fleet, policy = make_fleet(2), SmgCacheAware(SmgCacheAwareConfig(balance_abs_threshold=1, balance_rel_threshold=1.0))
    seed(policy, "w0", PREFIX)
    fleet.note_dispatch(WorkerId("w0"))
    fleet.note_dispatch(WorkerId("w0"))  # 2 - 0 > 1 and 2 > 1.0 x 0 -> imbalanced
    assert route(policy, fleet, req("r", PREFIX)) == "w1"
    assert policy.tree("m").tenant_size["w1"] == 10
    assert policy.tree("m").match(PREFIX, {"w1"}) == (10, ["w1"])


def test_affinity_then_spread_over_a_session() -> None:
    # three groups of 10-token prefixes: each cold group goes to the smallest tree, each repeat follows its group
    fleet, policy = make_fleet(3), SmgCacheAware()
    first = [route(policy, fleet, req(f"g{g}", range(g * 100, g * 100 + 10))) for g in range(3)]
    assert sorted(first) == ["w0", "w1", "w2"]  # smallest tree each time: 0 tok until chosen
    again = [route(policy, fleet, req(f"g{g}b", list(range(g * 100, g * 100 + 8)) + [7, 7])) for g in range(3)]
    assert again == first  # 8/10 = 0.8 > 0.3


def test_on_tick_evicts_every_interval() -> None:
    policy = SmgCacheAware(SmgCacheAwareConfig(max_tree_size=4, eviction_interval_s=120.0))
    seed(policy, "w0", range(10))
    policy.on_tick(0.0)  # starts the clock
    policy.on_tick(119.0)
    assert policy.tree("m").tenant_size["w0"] == 10
    policy.on_tick(120.0)  # 10 > 4: its only leaf [0..9] goes whole
    assert policy.tree("m").tenant_size["w0"] == 0
