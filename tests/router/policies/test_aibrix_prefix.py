"""aibrix_prefix: AIBrix prefix-cache routing: load gate, match percent, mean + k*std bound, least-request fallback."""

from __future__ import annotations

import pytest
from factories import make_fleet, make_requests

from switchyard.router.policies.aibrix_prefix import AibrixPrefix, AibrixPrefixConfig, PrefixHashTable
from switchyard.router.policies.base import Decision, WorkerId

# r0..r3: 64 tokens = 4 blocks; the first 2 blocks shared
R = make_requests(4, prompt_len=64, shared_prefix=32)


def test_match_percent_is_integer_of_deepest_block() -> None:
    t = PrefixHashTable(capacity=100)
    t.add([1, 2, 3], "p0", 0.0)
    t.add([1, 2], "p1", 0.0)
    # 4 blocks [1, 2, 3, 9]: p0 holds 3 -> 3 x 100 // 4 = 75; p1 holds 2 -> 50
    assert t.match([1, 2, 3, 9], {"p0", "p1", "p2"}) == {"p0": 75, "p1": 50}
    assert t.match([1, 2, 3, 9], {"p1"}) == {"p1": 50}  # only ready pods count
    assert t.match([5, 1], {"p0"}) == {}  # must match from the first block


# (case, in-flight per worker, worker that got R[0] (100% match for R[0] again), worker that got R[1] (50% for R[0]),
#  expected pick, reason prefix)
CASES = [
    # loads 0,0,0,0: no gate, mean 0, std 0, bound 0 -> w0 (100%, load 0)
    ("highest match wins when balanced", [0, 0, 0, 0], "w0", "w1", "w0", "prefix_match 100%"),
    # loads 2,0,0,0: mean 0.5, std sqrt((1.5^2 + 3 x 0.5^2)/4) = sqrt(0.75) = 0.866 -> bound 1.366;
    # w0 (100%, load 2) > bound -> next: w1 (50%, load 0) fits
    ("stddev bound skips the hot holder", [2, 0, 0, 0], "w0", "w1", "w1", "prefix_match 50%"),
    # loads 4,0,0,0: mean 1, std sqrt((9 + 3)/4) = 1.732 -> bound 2.732; w0 (4) is the only holder and is over ->
    # least-request fallback among w1..w3 (gate: 4 > 2 x (1 + 1) = 4 is false)
    ("no holder within bound -> least request", [4, 0, 0, 0], "w0", None, None, "prefix_match_skipped load=0"),
    # loads 10,0,0,1: mean 2.75; 10 > 2 x 3.75 = 7.5 and 10 - 0 >= 8 -> gate: only w1, w2 (load 0) may match;
    # w1 holds 50% -> w1 (load 0 <= 2.75 + 4.02)
    ("load gate restricts to least loaded", [10, 0, 0, 1], "w0", "w1", "w1", "prefix_match 50%"),
    # loads 9,1,1,1: mean 3; 9 > 2 x 4 = 8 but 9 - 1 = 8 >= 8 -> gate to w1..w3; no holder there -> fallback
    ("gate with no holder -> least request", [9, 1, 1, 1], "w0", None, None, "least_request_fallback load=1"),
]


@pytest.mark.parametrize(("case", "loads", "full", "half", "want", "why"), CASES, ids=[c[0] for c in CASES])
def test_worked_examples(case: str, loads: list[int], full: str, half: str | None, want: str | None,
                         why: str) -> None:
    fleet, policy = make_fleet(4), AibrixPrefix()
    policy.on_dispatch(R[0], Decision(worker_id=WorkerId(full)), 0.0)
    if half:
        policy.on_dispatch(R[1], Decision(worker_id=WorkerId(half)), 0.0)
    for i, n in enumerate(loads):
        for _ in range(n):
            fleet.note_dispatch(WorkerId(f"w{i}"))
    d = policy.select(R[0], fleet, 0.0)
    assert d is not None and d.reason.startswith(why)
    least = [f"w{i}" for i, n in enumerate(loads) if n == min(loads)]
    assert d.worker_id == want if want else d.worker_id in least


def test_older_rule_is_configurable() -> None:
    # specs/peers.md's older rule: max - min > 16 -> least running; 2 sigma. Gate: factor 0 -> max > 0 always
    cfg = AibrixPrefixConfig(imbalance_factor=0.0, imbalance_min_gap=17, stddev_factor=2.0)
    fleet, policy = make_fleet(4), AibrixPrefix(cfg)
    policy.on_dispatch(R[0], Decision(worker_id=WorkerId("w0")), 0.0)
    for _ in range(16):
        fleet.note_dispatch(WorkerId("w0"))  # 16 - 0 = 16 < 17: not gated
    # mean 4, std sqrt((144 + 3 x 16)/4) = 6.93 -> bound 4 + 2 x 6.93 = 17.86 >= 16 -> w0 keeps affinity
    assert policy.select(R[0], fleet, 0.0).worker_id == "w0"  # type: ignore[union-attr]
    fleet.note_dispatch(WorkerId("w0"))  # 17 - 0 >= 17 -> gated to the idle pods
    assert policy.select(R[0], fleet, 0.0).worker_id != "w0"  # type: ignore[union-attr]


def test_ttl_eviction_on_tick_and_lru_capacity() -> None:
    policy = AibrixPrefix(AibrixPrefixConfig(eviction_duration_s=1200.0))
    policy.on_dispatch(R[0], Decision(worker_id=WorkerId("w0")), 0.0)  # 4 hashes at t=0
    policy.on_dispatch(R[1], Decision(worker_id=WorkerId("w1")), 600.0)  # 2 shared touched again + 2 new at t=600
    policy.on_tick(1199.0)
    assert len(policy._tables["m"]) == 6
    policy.on_tick(1201.0)  # r0's own 2 blocks (t=0) are stale; the shared 2 were touched at 600
    assert len(policy._tables["m"]) == 4
    t = PrefixHashTable(capacity=2)
    t.add([1, 2, 3], "p0", 0.0)  # one LRU over hashes: 1 is dropped
    assert len(t) == 2 and t.match([1], {"p0"}) == {}
