"""llmd_scorer: llm-d's default profile 2 x queue + 2 x kv-utilisation + 3 x approximate prefix, max score wins."""

from __future__ import annotations

import pytest
from factories import make_fleet, make_requests, make_stats

from switchyard.router.policies.base import Decision, WorkerId
from switchyard.router.policies.llmd_scorer import ApproxPrefixIndex, LlmdScorer, LlmdScorerConfig

# r0, r1: 64 tokens = 4 blocks of 16, the first 2 blocks shared
R = make_requests(2, prompt_len=64, shared_prefix=32)

# (case, waiting per worker, KV blocks used of 1000, worker that was sent r0, expected (total, queue, kv, prefix)
#  rows, expected pick)
CASES = [
    # queue: max 4, min 0 -> w0 (4-4)/4 = 0, w1 (4-0)/4 = 1, w2 (4-2)/4 = 0.5; kv: 1 - 0.1/0.5/0.2;
    # prefix: w0 holds r1's first 2 of 4 blocks = 0.5
    # w0 = 2x0 + 2x0.9 + 3x0.5 = 3.3; w1 = 2x1 + 2x0.5 + 0 = 3.0; w2 = 2x0.5 + 2x0.8 + 0 = 2.6 -> w0
    ("prefix outweighs queue", [4, 0, 2], [100, 500, 200], "w0",
     [(3.3, 0.0, 0.9, 0.5), (3.0, 1.0, 0.5, 0.0), (2.6, 0.5, 0.8, 0.0)], "w0"),
    # same, but w0's KV at 0.9: w0 = 0 + 2x0.1 + 1.5 = 1.7 -> w1 (3.0)
    ("full KV loses the prefix", [4, 0, 2], [900, 500, 200], "w0",
     [(1.7, 0.0, 0.1, 0.5), (3.0, 1.0, 0.5, 0.0), (2.6, 0.5, 0.8, 0.0)], "w1"),
    # equal queues -> neutral 1.0 everywhere: w0 = 2 + 2x0.5 + 1.5 = 4.5, w1 = 2 + 2x0.8 = 3.6, w2 = 2 + 2 = 4.0
    ("equal queues score 1", [3, 3, 3], [500, 200, 0], "w0",
     [(4.5, 1.0, 0.5, 0.5), (3.6, 1.0, 0.8, 0.0), (4.0, 1.0, 1.0, 0.0)], "w0"),
]


@pytest.mark.parametrize(("case", "waiting", "kv_used", "warm", "want_rows", "want"), CASES,
                         ids=[c[0] for c in CASES])
def test_weighted_sum_worked_examples(case: str, waiting: list[int], kv_used: list[int], warm: str,
                                      want_rows: list[tuple], want: str) -> None:
    fleet, policy = make_fleet(3), LlmdScorer()
    for i, (q, kv) in enumerate(zip(waiting, kv_used, strict=True)):
        fleet.apply_stats(WorkerId(f"w{i}"), make_stats(num_waiting=q, kv_blocks_used=kv), now=0.0)
    policy.on_dispatch(R[0], Decision(worker_id=WorkerId(warm)), 0.0)
    rows = policy.scores(R[1], list(fleet.routable("m")))
    for got, exp in zip(rows, want_rows, strict=True):
        assert got == pytest.approx(exp)
    d = policy.select(R[1], fleet, 0.0)
    assert d is not None and d.worker_id == want


def test_greedy_longest_prefix_scan() -> None:
    idx = ApproxPrefixIndex()
    idx.add("w0", [1, 2], capacity=10)
    idx.add("w1", [1, 3], capacity=10)
    # blocks [1, 2, 3]: 1 {w0, w1}, 2 {w0}, 3 {w1} -> each worker counts the scanned blocks it holds (llm-d's
    # greedy loop; it does not require a per-worker contiguous run)
    assert idx.match_longest_prefix([1, 2, 3]) == {"w0": 2, "w1": 2}
    # the scan stops at the first block nobody holds
    assert idx.match_longest_prefix([1, 9, 2]) == {"w0": 1, "w1": 1}


def test_per_worker_lru_capacity() -> None:
    idx = ApproxPrefixIndex()
    idx.add("w0", [1, 2], capacity=2)
    idx.add("w0", [1], capacity=2)  # touch 1: 2 is now the oldest
    idx.add("w0", [3], capacity=2)  # evicts 2
    assert idx.num_blocks("w0") == 2
    assert idx.match_longest_prefix([1, 2]) == {"w0": 1}
    assert idx.match_longest_prefix([3]) == {"w0": 1}


def test_auto_tune_sizes_the_lru_from_worker_kv_blocks() -> None:
    fleet, policy = make_fleet(1, kv_capacity_blocks=3), LlmdScorer()
    ctx = make_requests(1, prompt_len=80)[0]  # 5 blocks
    d = policy.select(ctx, fleet, 0.0)
    assert d is not None
    policy.on_dispatch(ctx, d, 0.0)
    assert policy._index["m"].num_blocks("w0") == 3  # autoTune: capacity = 3 KV blocks
    fixed = LlmdScorer(LlmdScorerConfig(auto_tune=False))
    fixed.on_dispatch(ctx, Decision(worker_id=WorkerId("w0")), 0.0)
    assert fixed._index["m"].num_blocks("w0") == 5  # 31250 default capacity


def test_prefix_considers_at_most_max_prefix_blocks() -> None:
    fleet, policy = make_fleet(2), LlmdScorer(LlmdScorerConfig(max_prefix_blocks=2))
    a, b = make_requests(2, prompt_len=64, shared_prefix=32)  # first 2 of 4 blocks shared
    policy.on_dispatch(a, Decision(worker_id=WorkerId("w1")), 0.0)
    rows = policy.scores(b, list(fleet.routable("m")))
    assert [r[3] for r in rows] == [0.0, 1.0]  # 2 matched / min(4, 2) blocks
    # queue 1 + kv 1 for both: w1 = 2 + 2 + 3 x 1 = 7 beats w0 = 4
    assert policy.select(b, fleet, 0.0).worker_id == "w1"  # type: ignore[union-attr]
