"""Claim 13 (spec §10): after augmentation every length bucket holds >= 0.25 * S samples (or the documented cap),
and augmented copies keep their label and differ from the original in about 15% of words."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from switchyard.router.predictor.augment import (
    AugmentConfig,
    augment,
    bucket_counts,
    bucket_edges,
    bucket_of,
    percentile,
)
from switchyard.router.predictor.data import LengthSample
from switchyard.router.predictor.synonyms import WORDNET_DIR, load_synonyms


class _Reverse:
    def synonyms(self, word: str) -> tuple[str, ...]:
        return ("zz" + word.lower()[::-1],)


def _prompt(rng: random.Random, n: int = 40) -> str:
    return " ".join("".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(n))


def _skewed(rng: random.Random) -> list[LengthSample]:
    # 10 buckets of width 100 over [0, 1000]: counts 400, 200, 120, 50, 20, 9, 3, 1, 0, 1
    counts = [400, 200, 120, 50, 20, 9, 3, 1, 0, 1]
    out = []
    for b, c in enumerate(counts):
        for k in range(c):
            out.append(LengthSample(f"b{b}s{k}", _prompt(rng), 12, b * 100 + 1 + rng.randrange(98)))
    return out


def test_every_bucket_reaches_quarter_of_the_largest_or_the_cap() -> None:
    samples = _skewed(random.Random(0))
    cfg = AugmentConfig(num_buckets=10, upper=1000, mu=0.25, max_copies=8, seed=0)
    out = augment(samples, cfg, _Reverse())
    edges = bucket_edges([s.output_tokens for s in samples], 10, 1000)
    before = bucket_counts(samples, edges)
    after = bucket_counts(out, edges)
    target = math.ceil(0.25 * max(before))  # S = 400 -> 100
    assert target == 100
    for b, (n0, n1) in enumerate(zip(before, after, strict=True)):
        if n0 == 0:
            assert n1 == 0  # nothing to copy from
        elif n0 >= target:
            assert n1 == n0, f"bucket {b} was already full"
        else:
            assert n1 == min(target, n0 * (1 + cfg.max_copies)), f"bucket {b}: {n0} -> {n1}"
    # 50 -> 100, 20 -> 100, 9 -> 81 (cap: 9 * 9), 3 -> 27, 1 -> 9
    assert after == [400, 200, 120, 100, 100, 81, 27, 9, 0, 9]


def test_copies_keep_the_label_and_change_15_percent_of_words() -> None:
    samples = _skewed(random.Random(1))
    out = augment(samples, AugmentConfig(num_buckets=10, upper=1000, seed=1), _Reverse())
    assert out[: len(samples)] == samples  # originals first, untouched
    by_id = {s.conv_id: s for s in samples}
    copies = out[len(samples) :]
    assert copies
    per_original: dict[str, int] = {}
    for c in copies:
        base_id, _, tag = c.conv_id.partition("+aug")
        assert tag.isdigit()
        orig = by_id[base_id]
        per_original[base_id] = per_original.get(base_id, 0) + 1
        assert c.output_tokens == orig.output_tokens and c.prompt_tokens == orig.prompt_tokens
        a, b = orig.prompt.split(), c.prompt.split()
        assert len(a) == len(b) == 40
        assert sum(x != y for x, y in zip(a, b, strict=True)) == 6  # round(0.15 * 40) = 15%
    assert max(per_original.values()) <= 8  # the cap per original


def test_augmentation_is_seeded() -> None:
    samples = _skewed(random.Random(2))
    cfg = AugmentConfig(num_buckets=10, upper=1000, seed=5)
    assert augment(samples, cfg, _Reverse()) == augment(samples, cfg, _Reverse())


def test_bucket_edges_default_to_the_p99_range() -> None:
    labels = list(range(1, 1001))  # P99 = 990.01 (linear interpolation, as numpy)
    assert percentile(labels, 99) == pytest.approx(float(np.percentile(labels, 99)))
    edges = bucket_edges(labels, 20)
    assert len(edges) == 21 and edges[0] == 0 and edges[-1] == pytest.approx(990.01)
    assert bucket_of(0, edges) == 0
    assert bucket_of(4000, edges) == 19  # beyond the range: the last bucket
    assert bucket_edges(labels, 4, upper=4096) == [0, 1024, 2048, 3072, 4096]


@pytest.mark.skipif(
    not (WORDNET_DIR / "data.noun").exists(), reason="Debian wordnet-base not installed (make sysdeps)"
)
def test_real_synonym_copies_differ_in_about_15_percent_of_words() -> None:
    text = (
        "Please write a detailed essay explaining how modern marketing strategies help small companies grow "
        "their business quickly and describe the main problems they usually face when they begin selling "
        "products online to new customers in different countries"
    )
    samples = [LengthSample(f"c{i}", text, 40, 10) for i in range(40)] + [LengthSample("rare", text, 40, 900)]
    out = augment(samples, AugmentConfig(num_buckets=10, upper=1000), load_synonyms("wordnet"))
    copies = [s for s in out if s.conv_id.startswith("rare+aug")]
    assert len(copies) == 8  # the one sample of its bucket, copied up to the cap (target would be 10)
    words = text.split()
    for c in copies:
        changed = sum(a != b for a, b in zip(words, c.prompt.split(), strict=True)) / len(words)
        assert 0.1 <= changed <= 0.2
        assert c.output_tokens == 900
