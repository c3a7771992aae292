"""Preble's local scheduler (`scheduling="preble_groups"`, specs/preble.md §5.6): the group of a cached fraction,
the (g + 1) × k quotas, one group per step round-robin downward, no starvation of an uncached request, and
fast-forward staying exact under it."""

from __future__ import annotations

import random

import pytest
from engine_testlib import make_engine, make_request
from test_engine_fast_forward import _run, _workload

from switchyard.workers.engine.scheduler import group_quota, priority_group


def _finish_prefill(eng, rid: str, prompt: list[int]) -> None:
    """Run one request alone until it has sampled a token, so its prompt blocks are cached."""
    eng.add_request(make_request(rid, prompt, max_tokens=2))
    s = eng.scheduler
    s.update_from_step(s.schedule())


@pytest.mark.parametrize(
    ("cached", "tokens", "group"),
    [
        (63, 100, 6),  # the paper's example: 63 of 100 cached, P = 10 -> ceil(6.3) - 1 = 6
        (0, 100, 0),  # nothing cached -> 0
        (1, 100, 0),  # ceil(0.1) - 1 = 0
        (10, 100, 0),  # ceil(1.0) - 1 = 0
        (11, 100, 1),  # ceil(1.1) - 1 = 1
        (70, 100, 6),  # exactly 7.0 -> 6 (7.000000000000001 in floats would give 7)
        (99, 100, 9),
        (100, 100, 9),  # fully cached -> P - 1
    ],
)
def test_priority_group_of_cached_fraction(cached: int, tokens: int, group: int) -> None:
    assert priority_group(cached, tokens, 10) == group


def test_quota_is_proportional_to_group_index() -> None:
    assert [group_quota(g, 10) for g in range(10)] == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert sum(group_quota(g, 10) for g in range(10)) == 550  # E6: the paper's "10 + 9 + ... + 1" is 55 units


def test_engine_example_63_of_100_cached_is_group_6() -> None:
    # block size 1: every token is its own block, so 63 cached tokens hit exactly
    eng = make_engine(block_size=1, num_kv_blocks=400, scheduling="preble_groups")
    base = list(range(3, 66))  # 63 tokens
    _finish_prefill(eng, "warm", base)
    eng.add_request(make_request("x", base + list(range(500, 537))))  # 63 + 37 = 100 tokens
    eng.add_request(make_request("cold", list(range(1000, 1100))))  # 100 tokens, none cached
    groups = eng.scheduler.waiting_groups()
    assert [[r.request_id for r in g] for g in groups] == [["cold"], [], [], [], [], [], ["x"], [], [], []]
    # the cursor starts at 0, so the first step scans down from 9: group 6 (x) is served, cold waits
    p = eng.scheduler.schedule()
    assert [(r.request_id, n) for r, n in p.scheduled] == [("warm", 1), ("x", 37)]  # 100 - 63 = 37 to compute
    assert p.admission_blocked == "priority_groups"
    p = eng.scheduler.schedule()  # next step: cursor 6 -> scan 5, 4, ..., 0: cold is served
    assert [r.request_id for r, _ in p.scheduled][-1] == "cold" and p.num_new_reqs == 1


def test_one_group_per_step_admits_at_most_its_quota_fcfs() -> None:
    # 150 fully cached requests (group 9, quota 100) and 15 uncached (group 0, quota 10); 16-token prompts
    eng = make_engine(block_size=4, num_kv_blocks=4000, max_num_seqs=1000, max_model_len=64,
                      scheduling="preble_groups")
    shared = list(range(3, 19))  # 16 tokens = 4 blocks
    _finish_prefill(eng, "warm", shared + [7])
    for i in range(150):
        eng.add_request(make_request(f"hot{i}", shared + [100 + i]))  # 17 tokens, 16 cached -> 16/17 -> group 9
    for i in range(15):
        eng.add_request(make_request(f"cold{i}", [5000 + 20 * i + j for j in range(17)]))  # group 0
    s = eng.scheduler
    p1 = s.schedule()
    admitted = [r.request_id for r, _ in p1.scheduled[-p1.num_new_reqs:]]
    assert admitted == [f"hot{i}" for i in range(100)]  # (9 + 1) x 10, in arrival order
    s.update_from_step(p1)
    p2 = s.schedule()  # cursor 9 -> 8, 7, ... empty -> group 0: (0 + 1) x 10 of the cold ones
    admitted = [r.request_id for r, _ in p2.scheduled[-p2.num_new_reqs:]]
    assert admitted == [f"cold{i}" for i in range(10)]
    s.update_from_step(p2)
    p3 = s.schedule()  # cursor 0 -> wraps to 9: the remaining 50 hot ones
    admitted = [r.request_id for r, _ in p3.scheduled[-p3.num_new_reqs:]]
    assert admitted == [f"hot{i}" for i in range(100, 150)]


def test_uncached_request_is_not_starved_by_a_stream_of_cached_ones() -> None:
    # every step 30 new fully cached requests arrive; FCFS-by-cache-hit ("prefix first") would never reach the
    # uncached one, the groups serve group 0 within P = 10 steps
    eng = make_engine(block_size=4, num_kv_blocks=20000, max_num_seqs=100000, max_model_len=64,
                      scheduling="preble_groups")
    shared = list(range(3, 19))
    _finish_prefill(eng, "warm", shared + [7])
    s = eng.scheduler
    n = 0
    for _ in range(5):  # a backlog of cached requests first
        for _ in range(30):
            eng.add_request(make_request(f"hot{n}", shared + [100 + n]))
            n += 1
    eng.add_request(make_request("cold", list(range(9000, 9017))))
    admitted_at = None
    for step in range(1, 21):
        for _ in range(30):
            eng.add_request(make_request(f"hot{n}", shared + [100 + n]))
            n += 1
        s.update_from_step(s.schedule())
        if admitted_at is None and s.requests["cold"] in s.running:
            admitted_at, waiting_then = step, len(s.waiting)
    # step 1 serves group 9 (100 of the backlog), step 2 scans 8, 7, ..., 0 and serves cold's group
    assert admitted_at == 2
    assert waiting_then == 150 + 60 - 100  # cached requests (older than cold, too) were still waiting


def test_default_scheduling_is_fcfs_and_unknown_rejected() -> None:
    eng = make_engine()
    assert eng.config.scheduling == "fcfs" and not eng.scheduler.by_groups
    with pytest.raises(ValueError):
        make_engine(scheduling="preble_groups", num_priority_groups=0)


@pytest.mark.parametrize("seed", range(12))
def test_fast_forward_matches_single_steps_under_groups(seed: int) -> None:
    rng = random.Random(1000 + seed)
    cfg = {
        "block_size": rng.choice([1, 4, 16]),
        "max_num_seqs": rng.choice([2, 4, 256]),
        "max_num_batched_tokens": rng.choice([16, 64, 8192]),
        "scheduling": "preble_groups",
        "num_priority_groups": rng.choice([2, 10]),
        "priority_group_quota": rng.choice([1, 10]),
        "max_model_len": 128,
    }
    cfg["num_kv_blocks"] = 1 + max(-(-128 // cfg["block_size"]), rng.choice([8, 20, 60]) * 16 // cfg["block_size"])
    reqs = _workload(rng)
    slow = _run(cfg, reqs, fast=False)
    fast = _run(cfg, reqs, fast=True)
    assert fast[:3] == slow[:3]  # tokens, finishes, KV events
    assert fast[4:6] == slow[4:6]  # iterations, final state
    assert fast[3] == pytest.approx(slow[3], rel=0, abs=1e-9)
