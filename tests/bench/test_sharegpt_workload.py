"""The RQ3 ShareGPT workload: Poisson arrivals at the asked rate, one seeded request sequence at every rate, the
real tokenization, exactly the true output length from the engine, and reuses of the small split salted."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.bench import sim
from switchyard.bench.metrics import OK
from switchyard.bench.sharegpt_workload import (
    SALT_TOKEN_BASE,
    TokenizedPrompts,
    eligible,
    make_sharegpt_workload,
    sample_keys,
    unit_arrivals,
)
from switchyard.router.predictor.data import LengthSample
from switchyard.workers.tokenizer import load_tokenizer

TOPICS = (
    "the sea",
    "a router",
    "why the sky is blue",
    "prime numbers",
    "a long poem",
    "Paris",
    "tea",
    "rust",
)


def synthetic_samples(n: int, seed: int = 0) -> list[LengthSample]:
    """n prompts with real Mistral token counts; outputs 1..300 tokens; every fifth id repeats an earlier id."""
    tok = load_tokenizer()
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        text = f"I want you to act as a guide. Tell me about {TOPICS[i % len(TOPICS)]} " * int(
            rng.integers(1, 6)
        )
        text += f"(question {i})"
        conv = f"c{i - 1}" if i % 5 == 4 else f"c{i}"
        out.append(LengthSample(conv, text, len(tok.encode(text)), int(rng.integers(1, 300))))
    return out


SAMPLES = synthetic_samples(40)


def test_poisson_arrivals_at_the_asked_rate() -> None:
    wl = make_sharegpt_workload(SAMPLES, rate=20.0, duration_s=600.0, seed=3)
    t = np.array([r.arrival_s for r in wl.trace.requests])
    assert np.all(np.diff(t) >= 0) and t[0] >= 0 and t[-1] < 600.0
    # N ~ Poisson(12000): sd 110, so +-3% is > 3 sd
    assert abs(len(t) - 12000) < 360
    gaps = np.diff(t)
    assert gaps.mean() == pytest.approx(1 / 20, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # exponential gaps: CV 1


def test_one_request_sequence_at_every_rate() -> None:
    slow = make_sharegpt_workload(SAMPLES, rate=5.0, duration_s=60.0, seed=1)
    fast = make_sharegpt_workload(SAMPLES, rate=10.0, duration_s=60.0, seed=1)
    assert len(fast.trace.requests) > len(slow.trace.requests)
    for a, b in zip(slow.trace.requests, fast.trace.requests, strict=False):
        assert a.request_id == b.request_id and a.num_output_tokens == b.num_output_tokens
        assert a.arrival_s == pytest.approx(2 * b.arrival_s)  # unit-rate arrivals / rate
    assert slow.keys == fast.keys[: len(slow.keys)]


def test_seeded_reproducibility() -> None:
    a = make_sharegpt_workload(SAMPLES, rate=8.0, duration_s=30.0, seed=7)
    b = make_sharegpt_workload(SAMPLES, rate=8.0, duration_s=30.0, seed=7)
    c = make_sharegpt_workload(SAMPLES, rate=8.0, duration_s=30.0, seed=8)
    assert a.trace == b.trace and a.keys == b.keys and a.passes == b.passes
    assert [r.arrival_s for r in a.trace.requests] != [r.arrival_s for r in c.trace.requests]
    assert a.keys != c.keys


def test_samples_in_shuffled_passes_with_unique_keys() -> None:
    keys = sample_keys(SAMPLES)
    assert len(set(keys)) == len(SAMPLES)
    assert keys[4] == "c3#1" and keys[3] == "c3"  # the repeated id gets a suffix
    wl = make_sharegpt_workload(SAMPLES, rate=10.0, duration_s=12.0, seed=0)
    n = len(SAMPLES)
    assert len(wl.keys) > n  # more requests than samples: a second pass
    assert sorted(wl.keys[:n]) == sorted(keys)  # the first pass uses every sample once
    assert wl.passes[:n] == (0,) * n and set(wl.passes[n : 2 * n]) == {1}


def test_samples_beyond_the_context_are_left_out() -> None:
    too_long = LengthSample("big", "hello " * 10, 4000, 200)  # 4200 > 4096
    assert eligible([*SAMPLES[:3], too_long], 4096) == SAMPLES[:3]
    wl = make_sharegpt_workload([*SAMPLES[:3], too_long], rate=5.0, duration_s=10.0, seed=0)
    assert "big" not in wl.keys and wl.num_eligible == 3
    with pytest.raises(ValueError, match="no sample fits"):
        make_sharegpt_workload([too_long], rate=5.0, duration_s=10.0)


def test_real_tokens_and_salted_reuses() -> None:
    tok = load_tokenizer()
    wl = make_sharegpt_workload(SAMPLES, rate=10.0, duration_s=12.0, seed=0)
    prompts = TokenizedPrompts([wl], block_size=16)
    by_key: dict[str, list[int]] = {}
    for i, (req, s, k) in enumerate(zip(wl.trace.requests, wl.samples, wl.passes, strict=True)):
        ids = prompts.tokens(req)
        real = tuple(tok.encode(s.prompt))
        assert req.num_prompt_tokens == len(ids) == s.prompt_tokens
        assert ids == real if k == 0 else ids == (SALT_TOKEN_BASE + k, *real[1:])
        by_key.setdefault(wl.keys[i], []).append(i)
    reused = next(
        v for v in by_key.values() if len(v) > 1 and wl.trace.requests[v[0]].num_prompt_tokens >= 16
    )
    first, again = (wl.trace.requests[i] for i in reused[:2])
    h1, h2 = prompts.block_hashes(first), prompts.block_hashes(again)
    assert len(h1) == len(h2) == first.num_prompt_tokens // 16
    assert not set(h1) & set(h2)  # the salt changes block 0, and so every chained hash after it


def test_engine_generates_exactly_the_true_length() -> None:
    wl = make_sharegpt_workload(SAMPLES, rate=6.0, duration_s=8.0, seed=2)
    cfg = sim.SimConfig(policy="round_robin", num_workers=2, profile="llama2-70b-h100-tp4")
    res = sim.Simulator(wl.trace, cfg, TokenizedPrompts([wl], 16)).run()
    assert len(res.records) == len(wl.samples) > 20
    for rec, s in zip(res.records, wl.samples, strict=True):
        assert rec.status == OK
        assert rec.num_output_tokens == s.output_tokens  # ignore_eos semantics: no early stop, no overrun


def test_unit_arrivals_cover_long_horizons() -> None:
    u = unit_arrivals(0, 5000.0)
    assert u[-1] < 5000.0 and abs(len(u) - 5000) < 300
