"""SGLang's longest-prefix-match-first admission (`scheduling="lpm"`): order by cached tokens, stable ties, the
128-request sort limit, and the starvation Preble's priority groups bound (specs/preble.md §5.6, claim 9). Fast-forward
under lpm is checked with the other schedulings in test_engine_fast_forward."""

from __future__ import annotations

import pytest
from engine_testlib import make_engine, make_request

SHARED = list(range(3, 19))  # 16 tokens = 4 blocks of 4


def _warm(eng, prompt: list[int]) -> None:
    """Run one request to completion alone, so its prompt blocks stay in the prefix cache."""
    eng.add_request(make_request("warm", prompt, max_tokens=1))
    s = eng.scheduler
    s.update_from_step(s.schedule())
    assert not s.has_unfinished()


def _admitted(plan) -> list[str]:
    return [r.request_id for r, _ in plan.scheduled[len(plan.scheduled) - plan.num_new_reqs :]]


def test_admits_longest_cached_prefix_first_ties_in_arrival_order() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=400, scheduling="lpm")
    _warm(eng, SHARED + [7])
    eng.add_request(make_request("cold", list(range(500, 520))))  # nothing cached
    eng.add_request(make_request("half", SHARED[:8] + list(range(600, 612))))  # 2 blocks = 8 tokens cached
    eng.add_request(make_request("full-a", SHARED + [700, 701, 702, 703]))  # 16 cached
    eng.add_request(make_request("full-b", SHARED + [800, 801, 802, 803]))  # 16 cached, arrived after full-a
    plan = eng.scheduler.schedule()
    assert _admitted(plan) == ["full-a", "full-b", "half", "cold"]
    fcfs = make_engine(block_size=4, num_kv_blocks=400)
    _warm(fcfs, SHARED + [7])
    for rid in ("cold", "half", "full-a"):
        fcfs.add_request(make_request(rid, {"cold": list(range(500, 520)), "half": SHARED[:8] + [600] * 12,
                                            "full-a": SHARED + [700, 701, 702, 703]}[rid]))
    assert _admitted(fcfs.scheduler.schedule()) == ["cold", "half", "full-a"]


def _starvation_run(scheduling: str, steps: int = 30) -> int | None:
    """Two admissions per step (max_num_seqs 2, one-token answers finish in their step), two fully cached arrivals
    per step on top of a backlog, one uncached request behind the backlog: the step it is admitted, or None."""
    eng = make_engine(block_size=4, num_kv_blocks=20000, max_num_seqs=2, max_model_len=64, scheduling=scheduling,
                      num_priority_groups=10, priority_group_quota=1)
    _warm(eng, SHARED + [7])
    n = 0

    def hot() -> None:
        nonlocal n
        eng.add_request(make_request(f"hot{n}", SHARED + [100 + n], max_tokens=1))
        n += 1

    for _ in range(6):
        hot()
    eng.add_request(make_request("cold", list(range(9000, 9017)), max_tokens=1))
    s = eng.scheduler
    for step in range(1, steps + 1):
        hot()
        hot()
        plan = s.schedule()
        if "cold" in _admitted(plan):
            return step
        s.update_from_step(plan)
    return None


def test_lpm_starves_an_uncached_request_that_fcfs_and_priority_groups_serve() -> None:
    assert _starvation_run("fcfs") == 4  # 6 older requests ahead of it, two a step
    assert _starvation_run("lpm") is None  # cached arrivals always sort ahead: never admitted in 30 steps
    groups = _starvation_run("preble_groups")
    assert groups is not None and groups <= 10  # every non-empty group is served within P = 10 steps


def test_sort_is_skipped_while_more_than_lpm_max_queue_wait() -> None:
    eng = make_engine(block_size=4, num_kv_blocks=4000, max_num_seqs=1, max_model_len=64, scheduling="lpm",
                      lpm_max_queue=3)
    _warm(eng, SHARED + [7])
    eng.add_request(make_request("cold", list(range(500, 517)), max_tokens=1))
    eng.add_request(make_request("cold2", list(range(600, 617)), max_tokens=1))
    for i in range(2):
        eng.add_request(make_request(f"hot{i}", SHARED + [100 + i], max_tokens=1))
    s = eng.scheduler
    plan = s.schedule()  # 4 wait > 3: no sort, the queue's order
    assert _admitted(plan) == ["cold"]
    s.update_from_step(plan)
    plan = s.schedule()  # cold2, hot0, hot1: 3 wait, sorted: the cached ones go first
    assert _admitted(plan) == ["hot0"]
    assert [r.request_id for r in s.waiting] == ["hot1", "cold2"]


def test_unknown_scheduling_rejected() -> None:
    with pytest.raises(ValueError):
        make_engine(scheduling="sjf")
