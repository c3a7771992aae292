"""Smoke tests of `bench decisions` and `bench suite` at toy sizes (a few seconds together)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from switchyard.bench import sim, suite
from switchyard.bench.micro import decisions


def test_decisions_smoke(tmp_path: Path) -> None:
    rc = decisions.main(["--num-requests", "60", "--workloads", "toolbench-200", "--workers", "2",
                         "--policies", "e2,e2-py,round_robin", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    rows = json.loads((tmp_path / "decisions.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["e2", "e2-py", "round_robin"]
    assert all(r["requests"] == 60 and r["decisions_per_s"] > 0 and r["paper_decisions_per_s"] == 634 for r in rows)
    assert rows[0]["state_kind"] == "tree nodes" and rows[0]["state_size"] > 0
    assert rows[0]["state_size"] == rows[1]["state_size"]  # the Cython and Python trees grow alike
    for r in rows:  # the hooks by kind add up to all of them (each rounded to 0.1 µs)
        kinds = [r["kv_events_us_per_request"], r["first_token_us_per_request"], r["finish_us_per_request"]]
        assert abs(sum(kinds) - r["hooks_us_per_request"]) <= 0.2
    assert rows[0]["kv_events_us_per_request"] > 0 and rows[0]["first_token_us_per_request"] > 0  # e2's do work
    assert "| toolbench-200 | 2 | e2 |" in (tmp_path / "decisions.md").read_text()


def test_decisions_preload_grows_the_tree(tmp_path: Path) -> None:
    """--preload-nodes: the run starts with that many more tree nodes (cold resident prompts, as KV events)."""
    rc = decisions.main(["--num-requests", "30", "--workloads", "toolbench-200", "--workers", "2",
                         "--policies", "e2", "--preload-nodes", "500", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    row = json.loads((tmp_path / "decisions.json").read_text())["rows"][0]
    assert row["state_size_at_start"] == 500 and row["state_size"] >= 500


def test_suite_smoke(tmp_path: Path) -> None:
    rc = suite.main(["--quick", "--num-requests", "40", "--ladder-requests", "30", "--workloads", "toolbench",
                     "--policies", "e2,switchyard,smg_cache_aware,dynamo_kv,oracle_partition,round_robin", "--sections",
                     "a,b,c,e,f,g", "--jobs", "1",
                     "--rates", "toolbench=5,10", "toolbench-zipf1.1=8", "no-sharing=2", "--no-plots",
                     "--out", str(tmp_path)])
    assert rc == 0
    text = (tmp_path / "summary.md").read_text()
    assert "e2 / best peer" in text and "switchyard / best peer" in text
    assert "## b. Ablation" in text and "## c. No sharing" in text and "## e. Fairness" in text
    data = json.loads((tmp_path / "summary.json").read_text())
    assert {r["policy"] for r in data["fairness"]["runs"]} == {"e2 + fcfs", "e2 + lpm", "e2 + preble_groups"}
    loads = data["workloads"]["toolbench"]["loads"]
    assert [x["rate"] for x in loads] == [5.0, 10.0]
    tb = data["workloads"]["toolbench"]
    assert 0 < tb["pooled_lru_hit"] <= tb["prefix_hit_bound"] < 1
    for load in loads:  # no policy beats the load's floor, so the most a router could gain is the best peer / it
        floor = load["ttft_floor"]
        for r in load["runs"]:
            for key, stat in (("ttft_s", "mean"), ("ttft_s", "p99"), ("ttft_warm_s", "p99")):
                assert r["metrics"][key][stat] >= floor[key][stat] > 0
        cmp = load["vs_best_peer"]["e2"]
        assert load["best_peer_over_floor"]["TTFT p99"] == pytest.approx(
            cmp["TTFT p99"]["best_peer_value"] / floor["ttft_s"]["p99"])
    assert "best peer / TTFT floor" in text
    cmp = loads[0]["vs_best_peer"]["e2"]["hit ratio"]  # per request, counted once (not the engines' counters)
    assert cmp["ours"] == next(r for r in loads[0]["runs"] if r["policy"] == "e2")["metrics"]["prompt_cached_tokens_frac"]
    assert "Where the mean TTFT goes" in text
    for ours in ("e2", "switchyard"):
        cmp = loads[0]["vs_best_peer"][ours]
        assert cmp["TTFT mean"]["best_peer"] == "smg_cache_aware"
        assert cmp["warm TTFT p99"]["ours"] == next(r for r in loads[0]["runs"] if r["policy"] == ours)["metrics"][
            "ttft_warm_s"]["p99"]
        oracle = next(r for r in loads[0]["runs"] if r["policy"] == "oracle_partition")["metrics"]["e2e_s"]["mean"]
        assert cmp["E2E mean"]["vs_oracle_partition"] == pytest.approx(cmp["E2E mean"]["ours"] / oracle)
    assert {r["policy"] for r in data["ablation"]["runs"]} == {"oracle_partition", "e2_base", "e2_rebal", "e2",
                                                                "e2 + preble_groups"}
    assert (tmp_path / "workloads" / "toolbench" / "results.json").is_file()
    assert "## f. Skew (claim 7)" in text
    assert "## g. Router replicas" in text and "| toolbench | 10 | switchyard-no_mirror |" in text
    replicas = data["replicas"]["toolbench"]
    assert replicas["rate"] == 10.0  # the workload's highest load
    assert {(r["policy"], r["router_replicas"]) for r in replicas["runs"]} == {
        (p, k) for p in ("e2", "switchyard", "switchyard-no_mirror", "smg_cache_aware", "smg_mesh", "dynamo_kv",
                         "dynamo_kv_sync")
        for k in (1, suite.REPLICAS)}
    skew = data["skew"]["runs"]
    assert data["skew"]["rates"] == [8.0, 12.0]  # 1 and 1.5 x the Zipf-1.1 load
    assert {(r["zipf"], round(r["rate"], 6)) for r in skew} == {(z, rate) for z in suite.SKEW_ZIPFS for rate in (8, 12)}
    assert {r["policy"] for r in skew} == set(suite.SKEW_POLICIES)
    for r in skew:  # E2's counters; none for a peer; the default policy's spills (its placement reads no redirect)
        assert set(r["metrics"]["policy_counters"]) == {"smg_cache_aware": set(), "switchyard": {"prefix_spills"}}.get(
            r["policy"], {"rebalance_redirects", "replications"})


def test_decisions_repeat_reports_the_median_run(tmp_path: Path) -> None:
    """--repeat N: one row per policy, the run with the median select p50, listing every run's figures."""
    rc = decisions.main(["--num-requests", "30", "--workloads", "toolbench-200", "--workers", "2",
                         "--policies", "e2,round_robin", "--repeat", "3", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    rows = json.loads((tmp_path / "decisions.json").read_text())["rows"]
    assert [r["policy"] for r in rows] == ["e2", "round_robin"]
    for r in rows:
        p50s = r["runs"]["select_p50_us"]
        assert len(p50s) == 3 and r["select_p50_us"] == sorted(p50s)[1]
        assert len(r["runs"]["decisions_per_s"]) == 3


def test_steal_share_from_cpu_times() -> None:
    assert decisions.steal_frac((10, 1000), (40, 1100)) == 0.3
    assert decisions.steal_frac(None, (40, 1100)) is None and decisions.steal_frac((0, 5), (0, 5)) is None


def test_decisions_refuses_a_policy_listed_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rows are grouped by name, so `e2,e2` would fold two instances into one row: refused, with the way out."""
    rc = decisions.main(["--num-requests", "10", "--workloads", "toolbench-200", "--workers", "2", "--paired",
                         "--policies", "e2,e2", "--out", str(tmp_path), "--no-plot"])
    assert rc == 2 and "NAME@HEAD" in capsys.readouterr().err
    assert not (tmp_path / "decisions.json").exists()


def test_balanced_ratio_cancels_the_order_they_ran_in() -> None:
    """Whoever runs first pays ×1.5 (the cache misses), so per-request ratios have one mode per order; the balanced
    ratio reads the true one, for two policies and for three."""
    rng = np.random.default_rng(0)
    n = 3000
    for k, true in ((2, 1.0), (2, 0.8), (3, 1.25)):
        work = rng.lognormal(np.log(10_000), 0.3, n)  # each request's own cost, shared by the policies
        first = np.arange(n) % k  # which policy runs first at request i
        base = work * np.where(first == 0, 1.5, 1.0) * rng.lognormal(0.0, 0.05, n)
        other = true * work * np.where(first == 1, 1.5, 1.0) * rng.lognormal(0.0, 0.05, n)
        assert abs(decisions.balanced_ratio(other, base, k) - true) < 0.02 * true, (k, true)


def test_decisions_paired_runs_every_policy_on_the_first_ones_decisions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--paired: one pass per cyclic shift of the policies' positions; in each, every policy selects on the same
    states and gets the first-listed policy's decision, in an order that rotates by request from the pass's first
    position; a row's ratio is the geometric mean of its passes'."""
    selected: dict[str, list[str]] = {}
    dispatched: dict[str, list[str]] = {}
    dispatch_order: list[str] = []
    built: list[str] = []
    make = decisions.make_bench_policy

    def recording(name: str) -> Any:
        built.append(name)
        pol = make(name)
        select, on_dispatch = pol.select, pol.on_dispatch

        def sel(ctx: Any, fleet: Any, now: float) -> Any:
            d = select(ctx, fleet, now)
            selected.setdefault(name, []).append(d.worker_id)
            return d

        def dis(ctx: Any, decision: Any, now: float) -> None:
            dispatched.setdefault(name, []).append(decision.worker_id)
            dispatch_order.append(name)
            on_dispatch(ctx, decision, now)

        pol.select, pol.on_dispatch = sel, dis  # type: ignore[method-assign]
        return pol

    monkeypatch.setattr(decisions, "make_bench_policy", recording)
    rc = decisions.main(["--num-requests", "40", "--workloads", "toolbench-200", "--workers", "4", "--paired",
                         "--policies", "round_robin,e2,e2-py", "--out", str(tmp_path), "--no-plot"])
    assert rc == 0
    names = ["round_robin", "e2", "e2-py"]
    shifted = [names, names[1:] + names[:1], names[2:] + names[:2]]
    assert built[3:] == [n for order in shifted for n in order]  # (the first 3: main's check of the names)
    assert len(selected["round_robin"]) == 3 * 40
    assert selected["round_robin"] == dispatched["round_robin"] == dispatched["e2"] == dispatched["e2-py"]
    assert selected["e2"] == selected["e2-py"]  # one policy, two tree builds, the same states: the same picks
    assert selected["e2"] != selected["round_robin"]  # so the check above is not vacuous
    rows = json.loads((tmp_path / "decisions.json").read_text())["rows"]
    assert [r["paired_with"] for r in rows] == ["round_robin"] * 3
    assert rows[0]["paired_select_ratio"] == rows[0]["paired_dispatch_ratio"] == 1.0
    # the dispatches rotate as the selects do, from each pass's first position: none always runs first
    for p, order in enumerate(shifted):
        got = dispatch_order[p * 3 * 40 : p * 3 * 40 + 9]
        assert got == order + order[1:] + order[:1] + order[2:] + order[:2], p
    for r in rows:
        assert r["runs"]["paired_shift"] == [0, 1, 2]
        for key in ("paired_select_ratio", "paired_dispatch_ratio"):
            assert r[key] == pytest.approx(float(np.exp(np.mean(np.log(r["runs"][key])))), abs=2e-3)
    assert rows[1]["state_size"] == rows[2]["state_size"]
    assert "| toolbench-200 | 4 | e2 | round_robin |" in (tmp_path / "decisions.md").read_text()


def test_suite_loads_follow_the_capacity_policys_knee(tmp_path: Path) -> None:
    """`--capacity-policy`: section a's loads are the fractions of that policy's ladder capacity, not round_robin's."""
    rc = suite.main(["--quick", "--num-requests", "20", "--ladder-requests", "20", "--workloads", "videoqa",
                     "--policies", "e2,smg_cache_aware", "--sections", "a", "--jobs", "1", "--workers", "2",
                     "--capacity-policy", "smg_cache_aware", "--load-fractions", "0.7,1.0", "--no-plots",
                     "--out", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "summary.json").read_text())
    cap = data["capacity"]["videoqa"]
    assert cap["policy"] == "smg_cache_aware" and data["config"]["capacity_policy"] == "smg_cache_aware"
    assert data["workloads"]["videoqa"]["rates"] == [round(f * cap["capacity_req_s"], 3) for f in (0.7, 1.0)]
    assert "x smg_cache_aware's capacity" in (tmp_path / "summary.md").read_text()
    # a ladder that never saturated reports its top rung as a lower bound; fixed rates have no capacity
    assert suite.capacity_text({"capacity_req_s": 512.0, "capped": True}) == ">= 512.00"
    assert suite.capacity_text({"capacity_req_s": 22.627, "capped": False}) == "22.63"
    assert suite.capacity_text({"fixed_rates": [5.0, 10.0]}) == "-"


def test_the_spread_mooncake_workload_replays_no_step_as_one_burst() -> None:
    # asked for by name (`--workloads mooncake-conversation-spread`): the same trace, its 3 s clock steps spread
    argv = suite.WORKLOADS["mooncake-conversation-spread"]
    assert "mooncake-conversation-spread" in suite.OPT_IN_WORKLOADS
    spread = sim.load_workload(suite.sim_args([*argv, "--max-requests", "200"]))
    plain = sim.load_workload(suite.sim_args([*suite.WORKLOADS["mooncake-conversation"], "--max-requests", "200"]))
    assert len({r.arrival_s for r in plain.requests}) < len(plain.requests) / 5  # ~10 requests a stamp
    assert len({r.arrival_s for r in spread.requests}) == len(spread.requests)
    assert [r.request_id for r in spread.requests] == [r.request_id for r in plain.requests]
