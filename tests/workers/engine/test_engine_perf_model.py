"""Performance profiles: the stored coefficients reproduce a fresh fit from shared/data (<= 10% median error
inside every table), KV capacity arithmetic, and the extrapolation terms."""

from __future__ import annotations

import dataclasses

import pytest
from engine_testlib import make_engine, make_request

from switchyard.workers.engine.perf_model import find_data_dir, fit_coeffs, table_errors
from switchyard.workers.engine.profiles import PROFILES, get_profile, load_profile_tables

DATA = find_data_dir()
needs_data = pytest.mark.skipif(DATA is None, reason="shared/data not found (set SWITCHYARD_DATA_DIR)")


@needs_data
@pytest.mark.parametrize("name", sorted(PROFILES))
def test_stored_coefficients_match_a_refit_within_tolerance(name: str) -> None:
    prof = PROFILES[name]
    tables = load_profile_tables(prof, DATA)
    refit = dataclasses.replace(
        prof, coeffs=fit_coeffs(tables, prof.model, prof.decode_ctx_floor_ms_per_ktok, range(0, 1025, 16))
    )
    for t in tables:
        med, p90, _ = table_errors(prof, t)
        med_refit, _, _ = table_errors(refit, t)
        assert med <= 10.0, (t.name, med)
        assert abs(med - med_refit) < 0.5, (t.name, med, med_refit)  # stored = the fit, up to rounding


def test_kv_capacity_from_architecture() -> None:
    p8 = get_profile("llama3-8b-a100")
    # 2 x 32 layers x 8 KV heads x 128 dims x 2 B = 131,072 B per token
    assert p8.model.kv_bytes_per_token == 131072
    # (2 x 80 GiB x 0.9 - 16.06e9 B - 2 x 2 GiB) / 131,072 = 1,024,351 tokens
    assert p8.kv_capacity_tokens == 1024351
    assert p8.num_kv_blocks(16) == 1024351 // 16 + 1  # + vLLM's null block
    p70 = get_profile("llama2-70b-h100-tp4")
    assert p70.model.kv_bytes_per_token == 327680
    assert p70.kv_capacity_tokens == 496483
    assert (p8.max_model_len, p70.max_model_len) == (131072, 4096)


def test_extrapolation_grows_quadratically_with_prompt_length() -> None:
    p = get_profile("llama3-8b-a100")

    def prefill_ms(n: int) -> float:
        return p.iteration_time_ms(n, n * (n + 1) // 2, 0, 0)

    # inside the table: 8192 tokens ~ 542 ms measured
    assert 480 < prefill_ms(8192) < 600
    # 126k tokens in one go: linear 0.0582 ms x 126k ~ 7.3 s, attention adds ~ 3.26e-5 x 126k^2 / 2 x 0.0582 ~ 15 s
    assert prefill_ms(126_000) > 2.5 * 126_000 / 8192 * prefill_ms(8192) / 2
    # decode: batch 1 ~ 8.5 ms, batch 32 ~ 16 ms (SageServe TP2)
    assert p.iteration_time_ms(0, 0, 1, 600) == pytest.approx(8.5, rel=0.05)
    assert p.iteration_time_ms(0, 0, 32, 32 * 600) == pytest.approx(16.1, rel=0.05)
    # the decode-context term never falls below the bandwidth floor
    for prof in PROFILES.values():
        assert prof.coeffs.decode_ctx_ms_per_ktok >= prof.decode_ctx_floor_ms_per_ktok


@needs_data
def test_bench_profiles_main_runs(tmp_path, capsys) -> None:
    from switchyard.bench.profiles import main

    out = tmp_path / "r.json"
    assert main(["--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "llama3-8b-a100" in text and "median=" in text
    assert out.exists()


def _isolated_ttft_s(engine, prompt: list[int], warm: int) -> tuple[float, int]:
    """(TTFT, cached tokens) of `prompt` alone on an idle engine whose cache holds its first `warm` tokens."""
    now = 0.0
    if warm:
        engine.add_request(make_request("warm", prompt[:warm], max_tokens=1))
        while engine.has_unfinished():
            res = engine.step(now)
            now += res.duration_s
    engine.add_request(make_request("r", prompt, max_tokens=2, arrival_s=now))
    t0 = now
    while True:
        res = engine.step(now)
        now += res.duration_s
        out = [o for o in res.outputs if o.request_id == "r" and o.new_token_ids]
        if out:
            return now - t0, out[0].num_cached_tokens


@pytest.mark.parametrize("profile", sorted(PROFILES))
@pytest.mark.parametrize(("length", "warm", "budget"), [(900, 0, 8192), (900, 512, 8192), (3000, 1024, 1024),
                                                        (2500, 0, 512)])
def test_first_token_floor_is_met_alone_in_one_chunk_and_bounds_a_chunked_prompt(profile, length, warm, budget):
    """The floor equals an idle engine's TTFT when the computed tokens fit one iteration, and is at most that (by
    at most one knee of linear work: the last chunk's shortfall) when they need several."""
    engine = make_engine(profile=profile, max_num_batched_tokens=budget, num_kv_blocks=512)
    ttft, cached = _isolated_ttft_s(engine, list(range(3, 3 + length)), warm)
    assert cached == warm
    p = get_profile(profile)
    floor = p.first_token_floor_s(length - warm, warm, budget)
    if length - warm <= budget:
        assert floor == pytest.approx(ttft, rel=1e-12)
    else:
        slack = 0.001 * p.coeffs.lin_ms_per_tok * p.coeffs.knee_tokens
        assert floor * (1 - 1e-12) <= ttft <= floor + slack


def test_first_token_floor_takes_the_cheapest_chunking():
    """Where an iteration's fixed cost is below a knee of linear work, more (knee-sized) chunks are cheaper than
    the fewest, and the floor is the least over every chunk count (checked by brute force)."""
    p = get_profile("llama3-8b-a100")
    cheap = dataclasses.replace(p, coeffs=dataclasses.replace(p.coeffs, step_ms=1.0, prefill_ms=0.5))
    c = cheap.coeffs
    for n, budget in ((5000, 8192), (20000, 8192), (401, 8192), (3000, 1000)):
        fewest = -(-n // budget)
        brute = min(m * (c.step_ms + c.prefill_ms) + c.lin_ms_per_tok * max(0, n - m * c.knee_tokens)
                    for m in range(fewest, n + 1))
        attn = c.lin_ms_per_tok * cheap.model.attn_pair_ratio * (n * (n + 1) // 2)
        assert cheap.first_token_floor_s(n, 0, budget) == pytest.approx(0.001 * (brute + attn), rel=1e-12)
    one_chunk = c.step_ms + c.prefill_ms + c.lin_ms_per_tok * (
        5000 - c.knee_tokens + cheap.model.attn_pair_ratio * (5000 * 5001 // 2))
    assert cheap.first_token_floor_s(5000, 0, 8192) < 0.001 * one_chunk  # not the single chunk
    slow_mix = dataclasses.replace(p, mixed_batch_factor=0.9)
    assert slow_mix.first_token_floor_s(900, 0, 8192) == pytest.approx(0.9 * p.first_token_floor_s(900, 0, 8192))
