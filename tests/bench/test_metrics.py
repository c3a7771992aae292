"""`load_imbalance`: Preble's per-worker load L over a sliding window H, and max L / min L (claim 7's measure)."""

from __future__ import annotations

import pytest

from switchyard.bench.metrics import OK, RequestRecord, load_imbalance


def rec(i: int, worker: str, t: float, work: float) -> RequestRecord:
    # the work rides in num_prompt_tokens: the test's work function reads it back
    return RequestRecord(f"r{i}", arrival_s=t, num_prompt_tokens=int(work), max_tokens=1, status=OK,
                         worker_id=worker, dispatch_s=t)


def work(r: RequestRecord) -> float:
    return float(r.num_prompt_tokens)


def test_ratio_of_the_windowed_sums() -> None:
    # one request per second on each worker, a's three times b's work: L_a / L_b = 3 in every window
    records = [rec(2 * s, "a", float(s), 3) for s in range(20)] + [rec(2 * s + 1, "b", float(s), 1) for s in range(20)]
    out = load_imbalance(records, ["a", "b"], work, window_s=5.0, threshold=1.5)
    assert out["n"] == 15  # samples at 5, 6, ..., 19 s: the first full window to the last dispatch
    assert out["p50"] == out["p90"] == out["max"] == pytest.approx(3.0)
    assert out["frac_over"] == 1.0 and out["num_idle"] == 0
    assert load_imbalance(records, ["a", "b"], work, window_s=5.0, threshold=3.5)["frac_over"] == 0.0


def test_the_window_forgets_old_work() -> None:
    # a is heavy for the first 10 s, then both carry the same work: windows past 10 s + H see a ratio of 1
    records = [rec(i, "a", float(s), 4 if s < 10 else 1) for i, s in enumerate(range(30))]
    records += [rec(100 + s, "b", float(s), 1) for s in range(30)]
    out = load_imbalance(records, ["a", "b"], work, window_s=4.0, threshold=1.5)
    # samples at 4..29 s; the window (t - 4, t] holds only light work from t = 13 on: 17 of 26 samples at 1.0
    assert out["n"] == 26
    assert out["max"] == pytest.approx(4.0) and out["p50"] == pytest.approx(1.0)
    assert out["frac_over"] == pytest.approx(9 / 26)


def test_an_idle_worker_counts_as_over_and_is_left_out_of_the_ratio() -> None:
    records = [rec(s, "a", float(s), 1) for s in range(10)] + [rec(100, "b", 9.0, 1)]
    out = load_imbalance(records, ["a", "b", "c"], work, window_s=2.0, threshold=1.5)
    assert out["n"] == 8 and out["num_idle"] == 8 and out["frac_over"] == 1.0  # c never got a request
    assert out["p50"] == 0.0  # no sample with every worker busy


def test_failed_requests_and_short_runs() -> None:
    records = [rec(s, "a", float(s), 1) for s in range(10)] + [rec(10 + s, "b", float(s), 1) for s in range(10)]
    assert load_imbalance(records, ["a", "b"], work, window_s=30.0, threshold=1.5)["n"] == 0  # shorter than H
    records[0].status = "rejected_queue_full"
    records[0].num_prompt_tokens = 1000  # not served: its work counts nowhere
    out = load_imbalance(records, ["a", "b"], work, window_s=2.0, threshold=1.5)
    assert out["max"] == pytest.approx(1.0)
