"""`bench routing` (PreServe RQ3): the simulator's length-prediction modes, the normalized-latency SLO, the
isolated-request reference, the goal figure, and a smoke run of the command on a tiny synthetic sample set."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from switchyard.bench import routing, sim
from switchyard.bench.metrics import (
    OK,
    REJECTED_QUEUE_FULL,
    RequestRecord,
    norm_latency_slo,
    summarize,
    warm_start_s,
)
from switchyard.bench.sharegpt_workload import TokenizedPrompts, make_sharegpt_workload
from switchyard.bench.workloads import WorkloadSpec, make_workload
from switchyard.router.policies.least_request import LeastRequest
from switchyard.router.predictor.fallback import LengthFallback

# NOTE: the tiny exported-predictor fixture lives in tests/router/predictor/; pytest puts this file's own folder
# on sys.path (no __init__.py), which is where the sample factory comes from.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router" / "predictor"))
from onnx_fixture import expected_length, make_predictor_dir  # noqa: E402
from test_sharegpt_workload import synthetic_samples  # noqa: E402

PROFILE = "llama2-70b-h100-tp4"


class Recorder(LeastRequest):
    """least_request that records the prediction each request arrived with."""

    def __init__(self) -> None:
        self.seen: dict[str, int | None] = {}

    def select(self, ctx, fleet, now):  # type: ignore[no-untyped-def]
        self.seen[ctx.request_id] = ctx.predicted_output_tokens
        return super().select(ctx, fleet, now)


def _trace(n: int = 40, output_len: str = "uniform:2:60"):
    spec = WorkloadSpec(rate=10.0, num_requests=n, prompt_len="uniform:20:400", output_len=output_len)
    return make_workload(spec, seed=4)


def _run(predictor: str, trace=None, predictions=None):  # type: ignore[no-untyped-def]
    trace = trace or _trace()
    spy = Recorder()
    cfg = sim.SimConfig(num_workers=2, profile=PROFILE, predictor=predictor)
    res = sim.Simulator(trace, cfg, policy=spy, predictions=predictions).run()
    assert all(r.status == OK for r in res.records)
    return trace, res, spy.seen


# ---------------------------------------------------------------------------------------------------- sim modes
def test_default_is_no_prediction() -> None:
    assert sim.SimConfig().predictor == "none"
    trace, _, seen = _run("none")
    assert len(seen) == len(trace.requests) and set(seen.values()) == {None}


def test_oracle_puts_the_true_length_in_the_context() -> None:
    trace, _, seen = _run("oracle")
    assert seen == {r.request_id: r.num_output_tokens for r in trace.requests}


def test_fallback_predicts_at_arrival_and_learns_at_each_finish() -> None:
    trace, res, seen = _run("fallback")
    # replay the daemon's order: a request's prediction reflects exactly the finishes before its arrival
    done = sorted(res.records, key=lambda r: r.finish_s)
    for req in trace.requests:
        ref = LengthFallback()
        for r in done:
            if r.finish_s <= req.arrival_s:
                ref.observe(sim.MODEL, r.num_prompt_tokens, r.num_output_tokens)
        assert seen[req.request_id] == ref.predict(sim.MODEL, req.num_prompt_tokens), req.request_id
    assert seen["r0"] == 256  # the prior: nothing finished yet
    # every output here is 2..60 tokens: once requests finished, the predictions fall far below the prior
    assert max(seen[r.request_id] for r in trace.requests[-10:]) < 100


def test_table_predictions_come_from_the_table() -> None:
    trace = _trace(n=20)
    table = {r.request_id: 1000 + i for i, r in enumerate(trace.requests)}
    _, _, seen = _run("table", trace, table)
    assert seen == table
    with pytest.raises(KeyError, match="r19"):
        _run("table", trace, {k: v for k, v in table.items() if k != "r19"})


def test_predictor_mode_errors() -> None:
    with pytest.raises(ValueError, match="unknown predictor 'psychic'"):
        sim.make_length_source("psychic")
    with pytest.raises(ValueError, match="needs a predictions table"):
        sim.make_length_source("table")
    with pytest.raises(ValueError, match="only goes with predictor 'table'"):
        sim.make_length_source("oracle", {"r0": 1})


# ---------------------------------------------------------------------------------------------------- metrics
def _rec(rid: str, e2e: float, out: int, status: str = OK) -> RequestRecord:
    r = RequestRecord(rid, arrival_s=1.0, num_prompt_tokens=10, max_tokens=out, status=status)
    if status == OK:
        r.first_token_s, r.finish_s, r.num_output_tokens = 1.05, 1.0 + e2e, out
    return r


def test_normalized_latency_slo_on_hand_made_records() -> None:
    recs = [_rec("a", 1.0, 10), _rec("b", 2.0, 10), _rec("c", 0.3, 1), _rec("d", 0, 5, REJECTED_QUEUE_FULL)]
    # normalized latency: a 1.0/10 = 0.1, b 2.0/10 = 0.2, c 0.3/1 = 0.3 s/token; d never finished
    assert [r.norm_latency_s for r in recs[:3]] == pytest.approx([0.1, 0.2, 0.3])
    one = norm_latency_slo(recs, 0.2)  # a and b meet 0.2 (b exactly), c misses, d is a miss
    assert one == {"attainment": 0.5, "num_met": 2, "num_violations": 2, "num_requests": 4}
    per = norm_latency_slo(recs, {"a": 0.05, "b": 0.25, "c": 0.9, "d": 10.0})  # a misses; b, c meet
    assert per["attainment"] == 0.5 and per["num_met"] == 2
    m = summarize(recs, ["w0"], 0, 0, 0, math.inf, math.inf)
    assert m["norm_latency_s_per_token"]["mean"] == pytest.approx(0.2)


def test_warm_ttft_leaves_out_the_first_quarter_of_arrivals() -> None:
    """ttft_warm_s: TTFT over arrivals from the 25% arrival quantile on; a cold burst shows in ttft_s only."""
    recs = []
    for i in range(100):
        r = RequestRecord(f"r{i}", arrival_s=float(i), num_prompt_tokens=10, max_tokens=1, status=OK)
        r.first_token_s = r.finish_s = i + (5.0 if i < 25 else 0.1)  # the first 25 arrivals wait 5 s
        r.num_output_tokens = 1
        recs.append(r)
    recs.append(RequestRecord("late-reject", arrival_s=99.5, num_prompt_tokens=10, max_tokens=1,
                              status=REJECTED_QUEUE_FULL))
    assert warm_start_s(recs) == pytest.approx(25.0)  # np.quantile over all 101 arrivals, rejected included
    m = summarize(recs, ["w0"], 0, 0, 0, math.inf, math.inf)
    assert m["warm_start_s"] == pytest.approx(25.0)
    assert m["ttft_warm_s"]["mean"] == pytest.approx(0.1) and m["ttft_warm_s"]["p99"] == pytest.approx(0.1)
    assert m["ttft_s"]["mean"] == pytest.approx((25 * 5.0 + 75 * 0.1) / 100)
    assert m["ttft_s"]["max"] == pytest.approx(5.0) and m["ttft_s"]["n"] == 100


def test_low_hit_ttft_is_over_requests_with_under_half_their_prompt_cached() -> None:
    recs = []
    for i, (cached, ttft) in enumerate([(0, 3.0), (4, 2.0), (5, 0.2), (10, 0.1)]):  # of 10 prompt tokens
        r = RequestRecord(f"r{i}", arrival_s=0.0, num_prompt_tokens=10, max_tokens=1, status=OK)
        r.first_token_s = r.finish_s = ttft
        r.num_output_tokens, r.num_cached_tokens = 1, cached
        recs.append(r)
    m = summarize(recs, ["w0"], 0, 0, 0, math.inf, math.inf)
    assert m["ttft_low_hit_s"]["n"] == 2  # 0 and 4 of 10 cached; 5 of 10 is not under half
    assert m["ttft_low_hit_s"]["mean"] == pytest.approx(2.5) and m["ttft_low_hit_s"]["max"] == pytest.approx(3.0)


def test_isolated_latency_equals_a_lone_request_in_the_simulator() -> None:
    fleet = routing.FleetSetup(PROFILE, 1, 76216, "paper", True)
    iso = routing.isolated_latencies(fleet, {(300, 40), (2000, 3)})
    for p, o in ((300, 40), (2000, 3)):
        spec = WorkloadSpec(rate=1.0, num_requests=1, prompt_len=str(p), output_len=str(o))
        res = sim.Simulator(make_workload(spec), fleet.sim_config("round_robin", "none", 0)).run()
        (rec,) = res.records
        assert iso[(p, o)] == pytest.approx((rec.ttft_s, rec.e2e_s), rel=1e-9)
    # a 3-token answer after 2000 prompt tokens: normalized latency far above a 40-token answer's
    assert iso[(2000, 3)][1] / 3 > 2 * iso[(300, 40)][1] / 40


def test_slo_table_is_three_times_each_requests_isolated_value() -> None:
    wl = make_sharegpt_workload(synthetic_samples(10), rate=2.0, duration_s=5.0, seed=0)
    fleet = routing.FleetSetup(PROFILE, 1, 76216, "paper", True)
    iso = routing.isolated_latencies(
        fleet, {(r.num_prompt_tokens, r.num_output_tokens) for r in wl.trace.requests}
    )
    slo = routing.slo_table(wl, iso)
    for r in wl.trace.requests:
        assert slo[r.request_id] == pytest.approx(
            3 * iso[(r.num_prompt_tokens, r.num_output_tokens)][1] / r.num_output_tokens
        )


# ---------------------------------------------------------------------------------------------------- goal
def _row(policy: str, rate: float, slo: float, p99: float, predictor: str = "-") -> dict:
    return {
        "profile": "p",
        "policy": policy,
        "predictor": predictor,
        "rate": rate,
        "slo": {"attainment": slo},
        "norm_latency_s_per_token": {"p99": p99},
        "ttft_s": {"mean": 1.0},
    }


def test_goal_picks_the_highest_rate_a_baseline_still_serves() -> None:
    rows = [
        _row("round_robin", 10, 0.95, 0.10),
        _row("least_request", 10, 0.97, 0.09),
        _row("round_robin", 12, 0.80, 0.30),
        _row("least_request", 12, 0.86, 0.20),  # 12: only LR attains 85%
        _row("round_robin", 14, 0.50, 0.90),
        _row("least_request", 14, 0.70, 0.60),
        _row("preserve", 12, 0.96, 0.08, "oracle"),
        _row("preserve", 12, 0.90, 0.12, "fallback"),
        _row("preserve", 14, 0.90, 0.20, "oracle"),
    ]
    goal = routing.goal_summary(
        rows, ["p"], ["preserve", "round_robin", "least_request"], ["oracle", "fallback"]
    )
    by = {g["predictor"]: g for g in goal}
    assert by["oracle"]["rate"] == 12 and by["oracle"]["baseline"] == "least_request"
    assert by["oracle"]["p99_norm_reduction"] == pytest.approx(1 - 0.08 / 0.20)  # 60% lower: goal met
    assert by["oracle"]["violation_reduction"] == pytest.approx(1 - 0.04 / 0.14)
    assert by["oracle"]["goal_met"] and not by["fallback"]["goal_met"]  # 1 - 0.12 / 0.20 = 40%
    none = routing.goal_summary(
        [_row("round_robin", 10, 0.5, 1.0), _row("preserve", 10, 0.9, 0.1, "oracle")],
        ["p"],
        ["preserve", "round_robin"],
        ["oracle"],
    )
    assert none[0]["rate"] is None and "no baseline" in none[0]["note"]


# ---------------------------------------------------------------------------------------------------- command
def _write_samples(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in synthetic_samples(n)))
    return path


def test_quick_smoke_writes_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    samples = _write_samples(tmp_path / "samples.jsonl", 60)
    model = make_predictor_dir(tmp_path / "tiny-predictor")
    out = tmp_path / "out"
    argv = [
        "--quick",
        "--profiles",
        PROFILE,
        "--workers",
        "2",
        "--duration",
        "12",
        "--probe-duration",
        "8",
        "--load-fractions",
        "0.3,0.6",
        "--policies",
        "preserve,round_robin,least_request",
        "--predictors",
        "trained,fallback,oracle",
        "--predictor-name",
        str(model),
        "--samples",
        str(samples),
        "--jobs",
        "1",
        "--out",
        str(out),
    ]
    assert routing.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["capacity"][PROFILE]["capacity_req_s"] > 0
    rates = sorted({r["rate"] for r in data["runs"]})
    assert len(rates) == 2
    # per rate: 2 baselines once + preserve under each of 3 predictors
    assert len(data["runs"]) == 2 * (2 + 3)
    assert {(r["policy"], r["predictor"]) for r in data["runs"]} == {
        ("round_robin", "-"),
        ("least_request", "-"),
        ("preserve", "trained"),
        ("preserve", "fallback"),
        ("preserve", "oracle"),
    }
    assert all(
        0 <= r["slo"]["attainment"] <= 1 and r["num_completed"] == r["num_requests"] for r in data["runs"]
    )
    # the trained table ran the fixture model once over the prompts and was cached beside the results
    cache = json.loads((out / "predictions" / "tiny-fixture.json").read_text())
    some_key, some_value = next(iter(cache["predictions"].items()))
    prompt = next(
        json.loads(line)["prompt"]
        for line in samples.read_text().splitlines()
        if json.loads(line)["conv_id"] == some_key
    )
    assert some_value == expected_length(prompt)
    assert data["predictors"]["trained"]["cached"] is False
    assert sorted((g["policy"], g["predictor"]) for g in data["goal"]) == [
        ("preserve", "fallback"),
        ("preserve", "oracle"),
        ("preserve", "trained"),
    ]
    for name in ("results.md", "ttft_mean_vs_rate.png", "norm_p99_vs_rate.png", "slo_vs_rate.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "results.md").read_text()
    assert "preserve [trained]" in md and "### Goal" in md
    assert "| preserve [oracle] |" in capsys.readouterr().out

    # a second run reuses the cached table; with no model at all the mode is skipped, never substituted
    assert routing.main([*argv[:-2], "--out", str(out), "--no-plots", "--rates", "2"]) == 0
    assert json.loads((out / "results.json").read_text())["predictors"]["trained"]["cached"] is True
    argv_missing = [
        *argv[:-2],
        "--out",
        str(tmp_path / "out2"),
        "--no-plots",
        "--rates",
        "2",
        "--predictor-name",
        str(tmp_path / "nowhere"),
    ]
    argv_missing += ["--param", "preserve.t_mem=0.7"]
    assert routing.main(argv_missing) == 0
    data2 = json.loads((tmp_path / "out2" / "results.json").read_text())
    assert data2["config"]["policy_params"] == {"preserve": {"t_mem": "0.7"}}
    assert "no trained predictor" in data2["predictors"]["trained"]["skipped"]
    assert {r["predictor"] for r in data2["runs"]} == {"-", "fallback", "oracle"}
    assert "Predictor 'trained' skipped" in (tmp_path / "out2" / "results.md").read_text()


def test_unknown_policy_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert routing.main(["--policies", "preserve,telepathy"]) == 2
    err = capsys.readouterr().err
    assert "telepathy" in err and "round_robin" in err and "least_request" in err
    assert routing.main(["--policies", "preserve", "--param", "preserve.t_memory=0.7"]) == 2
    assert "policy 'preserve': unknown parameters t_memory; its keys: t_mem" in capsys.readouterr().err


def test_paper_kv_sizes() -> None:
    # (48 GiB x 0.9 - 13.48e9 B weights - 2 GiB) / 524,288 B per token (LLaMA-2-7B: 2 x 32 x 4096 x 2 B)
    assert routing.PAPER_KV_TOKENS == {"llama3-8b-a100": 58666, "llama2-70b-h100-tp4": 76216}
    assert routing.kv_tokens_for("llama3-8b-a100", "profile")[0] > 1_000_000
    assert routing.kv_tokens_for(PROFILE, "12345") == (12345, "fixed")


def test_tokenized_prompts_reject_a_conflicting_workload() -> None:
    s = synthetic_samples(10)
    a = make_sharegpt_workload(s, rate=2.0, duration_s=5.0, seed=0)
    b = make_sharegpt_workload(s, rate=2.0, duration_s=5.0, seed=1)
    with pytest.raises(ValueError, match="differs between workloads"):
        TokenizedPrompts([a, b], 16)


def test_parse_rates_per_profile_and_rejects_unknown_keys() -> None:
    profiles = ["llama3-8b-a100", "llama2-70b-h100-tp4"]
    assert routing.parse_rates("20,30", profiles) == {p: [20.0, 30.0] for p in profiles}
    assert routing.parse_rates("llama3-8b-a100=27.7;llama2-70b-h100-tp4=19.5", profiles) == {
        "llama3-8b-a100": [27.7], "llama2-70b-h100-tp4": [19.5]}
    with pytest.raises(ValueError, match="not one of the profiles"):  # a comma instead of ';' between items
        routing.parse_rates("llama3-8b-a100=27.7,llama2-70b-h100-tp4=19.5", profiles)
