"""ServeGen's per-client arrival fits and length PMFs turned into a trace (`bench/servegen.py`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from switchyard.bench import servegen, sim
from switchyard.bench.servegen import WINDOW_S, Window, servegen_trace, window_arrivals


def test_a_window_sends_its_rate_with_its_fitted_burstiness():
    rng = np.random.default_rng(0)
    t = window_arrivals(Window(0.0, 5.0, "Gamma", 0.25, 1.0), rng)  # shape 1/4: gaps of CV 2
    assert len(t) == 3000 and (np.diff(t) >= 0).all() and t[0] >= 0 and t[-1] < WINDOW_S
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.15)
    w = window_arrivals(Window(0.0, 5.0, "Weibull", 0.2, 1e-4), rng)  # ServeGen's m-mid: far burstier
    assert len(w) == 3000 and np.diff(w).std() / np.diff(w).mean() > 5
    p = window_arrivals(Window(0.0, 5.0, "", 0.0, 0.0), rng)  # no fit: Poisson
    assert np.diff(p).std() / np.diff(p).mean() == pytest.approx(1.0, rel=0.15)
    assert len(window_arrivals(Window(0.0, 0.0, "", 0.0, 0.0), rng)) == 0  # an idle window
    # a fractional count is rounded by a draw, so the mean count is rate x 600
    counts = [len(window_arrivals(Window(0.0, 0.0025, "Gamma", 1.0, 1.0), rng)) for _ in range(400)]
    assert set(counts) == {1, 2} and np.mean(counts) == pytest.approx(1.5, abs=0.1)


def _write_model(root, model="m-x"):
    d = root / "servegen" / "data" / "language" / model
    d.mkdir(parents=True)
    # client 7: 1 req/s in its first window, idle in its second, 2 req/s in its third; client 9 has no length file
    (d / "chunk-7-trace.csv").write_text("0,1.0,1.0,Gamma,1.0,1.0\n600,0,0,,0,0\n1200,2.0,1.0,Weibull,1.0,1.0\n")
    (d / "chunk-9-trace.csv").write_text("0,50.0,1.0,Gamma,1.0,1.0\n")
    (d / "chunk-7-dataset.json").write_text(json.dumps({
        "0": {"input_tokens": "{100: 0.5, 300: 0.5}", "output_tokens": "{7: 1.0}"},
        "21600": {"input_tokens": "{}", "output_tokens": "{}"},
    }))
    return root


def test_a_trace_of_the_clients_with_lengths_in_the_slice(tmp_path):
    root = _write_model(tmp_path)
    t = servegen_trace("m-x", 0.0, 1800.0, seed=1, data_dir=root)
    assert t.name == "servegen-m-x" and "clients [7]" in t.source  # client 9 has no lengths: left out
    times = [r.arrival_s for r in t.requests]
    assert times[0] == 0.0 and times == sorted(times)
    assert len(t.requests) == 600 + 1200  # rate x 600 in each window
    assert {r.num_prompt_tokens for r in t.requests} == {100, 300}
    assert {r.num_output_tokens for r in t.requests} == {7}
    assert len({r.segments for r in t.requests}) == len(t.requests)  # unique prompts: no prefix identity
    # the slice cuts windows by arrival; the same seed gives the same trace, another seed another
    part = servegen_trace("m-x", 300.0, 1200.0, seed=1, data_dir=root)
    assert 800 < len(part.requests) < 1000  # ~300 of the first window's, ~600 of the third's (2 req/s)
    assert servegen_trace("m-x", 0.0, 1800.0, seed=1, data_dir=root) == t
    assert servegen_trace("m-x", 0.0, 1800.0, seed=2, data_dir=root) != t
    assert len(servegen_trace("m-x", 0.0, 1800.0, seed=1, max_requests=10, data_dir=root).requests) == 10
    # a window without lengths takes the nearest earlier one's (21600 here is empty: 0's)
    late = tmp_path / "late"
    _write_model(late)
    csv = late / "servegen" / "data" / "language" / "m-x" / "chunk-7-trace.csv"
    csv.write_text("21600,1.0,1.0,Gamma,1.0,1.0\n")
    assert {r.num_output_tokens for r in servegen_trace("m-x", 21600.0, 600.0, data_dir=late).requests} == {7}
    with pytest.raises(FileNotFoundError, match="no ServeGen data"):
        servegen_trace("m-none", data_dir=root)


def test_the_published_m_large_clients_at_20h():
    t = servegen_trace("m-large", 72000.0, 600.0, seed=0)
    assert "clients [61, 143]" in t.source
    assert len(t.requests) == pytest.approx((7.405 + 17.59) * 600, abs=2)  # the two clients' rates at 72000 s
    assert max(r.num_prompt_tokens for r in t.requests) <= 3001  # client 61's largest prompt in that window


def test_bench_sim_replays_servegen_rescaled(tmp_path, capsys):
    out = tmp_path / "o"
    argv = ["--trace", "servegen-m-large", "--start", "72000", "--max-requests", "60", "--workers", "2",
            "--policies", "round_robin", "--rate", "8", "--out", str(out), "--no-plots"]
    assert sim.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["trace"]["num_requests"] == 60 and data["runs"][0]["rate"] == pytest.approx(8.0)
    assert data["runs"][0]["metrics"]["num_completed"] == 60
    capsys.readouterr()
    assert sim.main([*argv, "--where", "type=text"]) == 2
    assert "servegen-m-large is generated" in capsys.readouterr().err
    assert set(servegen.NAMES) <= set(sim.GENERATED)
