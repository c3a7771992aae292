"""Evaluation metrics and baselines on hand-made numbers."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.router.predictor.evaluate import (
    BucketClassifier,
    EmbeddingRegressor,
    clamp_tokens,
    fit_line,
    learning_curve,
    length_metrics,
    markdown_table,
    paper_rows,
)


def test_mae_and_acc_k_by_hand() -> None:
    # errors: 0, 30, 100, 50, 25
    m = length_metrics([100, 130, 200, 0, 75], [100, 100, 100, 50, 100])
    assert m["n"] == 5
    assert m["mae"] == pytest.approx((0 + 30 + 100 + 50 + 25) / 5)  # 41
    assert m["acc25"] == pytest.approx(40.0)  # 0, 25 (inclusive)
    assert m["acc50"] == pytest.approx(80.0)  # 0, 30, 50, 25
    assert m["acc100"] == pytest.approx(100.0)


def test_metrics_reject_mismatched_inputs() -> None:
    with pytest.raises(ValueError):
        length_metrics([1, 2], [1])
    with pytest.raises(ValueError):
        length_metrics([], [])


def test_fit_line_recovers_an_exact_line_and_clamps() -> None:
    a, b = fit_line([0, 1, 2, 10], [3, 5, 7, 23])  # y = 3 + 2x
    assert a == pytest.approx(3.0) and b == pytest.approx(2.0)
    assert clamp_tokens(np.array([-5.0, 10.0, 9000.0])).tolist() == [1.0, 10.0, 4096.0]


def test_bucket_classifier_predicts_bucket_medians() -> None:
    pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    # two separable clusters: labels 10..30 (bucket 0 of [0, 100)) and 410..430 (bucket 4)
    x = np.concatenate([rng.normal(-3, 0.3, (60, 4)), rng.normal(3, 0.3, (60, 4))]).astype(np.float32)
    y = np.concatenate([rng.integers(10, 31, 60), rng.integers(410, 431, 60)]).astype(float)
    clf = BucketClassifier(edges=[0, 100, 200, 300, 400, 500], epochs=60).fit(x, y)
    pred = clf.predict(np.array([[-3, -3, -3, -3], [3, 3, 3, 3]], dtype=np.float32))
    assert pred.tolist() == [np.median(y[:60]), np.median(y[60:])]
    assert clf.medians[2] == 250.0  # an empty bucket predicts its midpoint


def _clusters(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Two separable clusters of features: labels 10..30 and 410..430."""
    x = np.concatenate([rng.normal(-3, 0.3, (n, 4)), rng.normal(3, 0.3, (n, 4))]).astype(np.float32)
    y = np.concatenate([rng.integers(10, 31, n), rng.integers(410, 431, n)]).astype(float)
    return x, y


def test_regression_head_learns_lengths_from_features() -> None:
    pytest.importorskip("torch")
    x, y = _clusters(np.random.default_rng(1), 80)
    head = EmbeddingRegressor(epochs=100, lr=0.05).fit(x, y)  # toy data: large steps
    pred = head.predict(np.array([[-3] * 4, [3] * 4, [30] * 4], dtype=np.float32))
    assert abs(pred[0] - 20) < 10 and abs(pred[1] - 420) < 10  # each cluster's median (the L1 optimum), roughly
    assert 1.0 <= pred[2] <= 4096.0  # clamped like every predictor


def test_learning_curve_trains_on_growing_subsets() -> None:
    pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x, y = _clusters(rng, 100)
    tx, ty = _clusters(rng, 20)
    curve = learning_curve(x, y, tx, ty, fractions=(0.05, 1.0), epochs=100, lr=0.05)
    assert [c["train"] for c in curve] == [10, 200]
    assert curve[1]["mae"] < 15 and curve[1]["n"] == 40  # the whole set learns both clusters
    # the whole-split point reuses the main row's predictions instead of training again
    given = np.full(len(ty), 7.0)
    again = learning_curve(x, y, tx, ty, fractions=(0.05, 1.0), epochs=100, lr=0.05, full_pred=given)
    assert again[0] == curve[0] and again[1] == {"fraction": 1.0, "train": 200, **length_metrics(given, ty)}


def test_table_prints_preserve_table_2_beside_ours() -> None:
    rows = [{"method": "ours", **length_metrics([100], [90])}, *paper_rows()]
    table = markdown_table(rows)
    assert "| ours | 10.00 | 100.00% | 100.00% | 100.00% | 1 |" in table
    assert "| PreServe (paper) | 78.25 | 56.77% | 68.79% | 77.95% | — |" in table
    assert "| μ-Serve (paper) | 355.59 | 32.31% | 49.35% | 65.25% | — |" in table
