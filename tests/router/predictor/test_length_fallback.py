"""The predictor of last resort: running means per (model, prompt-length bucket)."""

from __future__ import annotations

import pytest

from switchyard.router.predictor.fallback import LengthFallback


def test_unseen_model_answers_the_prior() -> None:
    assert LengthFallback(prior=300).predict("m", 100) == 300


def test_learns_each_prompt_bucket_separately() -> None:
    f = LengthFallback(prior=300, half_life=1e9)
    for _ in range(50):
        f.observe("m", 20, 40)  # short prompts -> short answers
        f.observe("m", 2000, 900)  # long prompts -> long answers
    assert f.predict("m", 20) == pytest.approx(40, abs=5)
    assert f.predict("m", 2000) == pytest.approx(900, abs=40)
    # A bucket never seen borrows the model's overall mean, not the prior.
    assert f.predict("m", 200) == pytest.approx(470, abs=5)
    assert f.predict("other-model", 20) == 300


def test_a_thin_bucket_is_shrunk_towards_the_model_mean() -> None:
    f = LengthFallback(prior=300, half_life=1e9, min_weight=3.0)
    for _ in range(100):
        f.observe("m", 100, 100)
    f.observe("m", 4000, 1100)  # one sample in its bucket: weight 1 of the 3 that make it trusted
    overall = (100 * 100 + 1100) / 101
    assert f.predict("m", 4000) == round(1 / 3 * 1100 + 2 / 3 * overall)


def test_follows_a_drifting_workload() -> None:
    f = LengthFallback(half_life=20)
    for _ in range(200):
        f.observe("m", 50, 100)
    for _ in range(200):
        f.observe("m", 50, 500)
    assert f.predict("m", 50) == pytest.approx(500, abs=10)


def test_ignores_empty_outputs_and_rejects_bad_settings() -> None:
    f = LengthFallback(prior=10)
    f.observe("m", 5, 0)
    assert f.predict("m", 5) == 10
    with pytest.raises(ValueError):
        LengthFallback(prior=0)
