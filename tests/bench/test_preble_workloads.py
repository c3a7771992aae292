"""Preble's workload generators against its Table 1 (specs/preble.md §7.1), their sharing structure, determinism,
the Azure 2023 mixed replay (×0.7, code → ToolBench, conversation → VideoQA), and the `bench sim` names."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.bench import preble_workloads as pw
from switchyard.bench import sim
from switchyard.bench.metrics import OK
from switchyard.bench.traces import NS_UNIQUE, Trace, TraceRequest, load_trace
from switchyard.bench.workloads import WorkloadSpec, make_workload


def _stats(short: str, seed: int = 0, **kw) -> pw.WorkloadStats:
    spec = pw.PrebleSpec(num_requests=pw.TABLE1_SIZES[short], **kw)
    return pw.workload_stats(pw.make_preble_trace(f"preble-{short}", spec, seed))


# Per workload: Table 1 means must be met within these tolerances (lengths: relative; fractions: absolute points).
# Stds of lengths within 20% (relative). Programming's requests-per-key-portion is checked separately (below).
@pytest.mark.parametrize("short", ["toolbench", "agent", "programming", "videoqa", "loogle"])
def test_generator_matches_table1(short: str) -> None:
    s, p = _stats(short), pw.TABLE1[short]
    assert s.num_requests == pw.TABLE1_SIZES[short]
    assert s.prompt_tokens[0] == pytest.approx(p.prompt_tokens[0], rel=0.08)
    assert s.prompt_tokens[1] == pytest.approx(p.prompt_tokens[1], rel=0.20)
    assert s.output_tokens[0] == pytest.approx(p.output_tokens[0], rel=0.08)
    assert s.output_tokens[1] == pytest.approx(p.output_tokens[1], rel=0.20)
    assert s.shared_prefix_frac[0] == pytest.approx(p.shared_prefix_frac[0], abs=0.035)
    assert s.key_portion_frac[0] == pytest.approx(p.key_portion_frac[0], abs=0.035)
    if short != "programming":
        assert s.requests_per_key_portion[0] == pytest.approx(p.requests_per_key_portion[0], rel=0.15)


def test_programming_key_portions() -> None:
    # problems carry ~100 samples each; the paper's mean of 126 (std 2157) is pulled up by the system prompt
    # being the key portion of the problems shorter than it: one key shared by every request
    t = pw.make_preble_trace("preble-programming", pw.PrebleSpec(num_requests=10000), 0)
    per_problem: dict[int, int] = {}
    for r in t.requests:
        per_problem[r.segments[1][1]] = per_problem.get(r.segments[1][1], 0) + 1
    assert np.mean(list(per_problem.values())) == pytest.approx(100, rel=0.1)
    s = pw.workload_stats(t)
    assert 100 <= s.requests_per_key_portion[0] <= 300 and s.requests_per_key_portion[1] > 1000


@pytest.mark.parametrize("name", pw.GENERATORS)
def test_generators_are_deterministic_and_seeded(name: str) -> None:
    spec = pw.PrebleSpec(num_requests=300, rate=5.0)
    a, b, c = (pw.make_preble_trace(name, spec, seed) for seed in (3, 3, 4))
    assert a == b and a != c
    assert len(a.requests) == 300 and a.has_prefix_identity and a.requests[0].arrival_s == 0.0
    assert all(x.arrival_s <= y.arrival_s for x, y in zip(a.requests, a.requests[1:], strict=False))
    assert all(r.num_prompt_tokens == sum(s[2] for s in r.segments) for r in a.requests)
    # same (namespace, key) always has the same length: a segment is one fixed run of tokens
    seg_len: dict[tuple[int, int], int] = {}
    for r in a.requests:
        for ns, key, n in r.segments:
            assert seg_len.setdefault((ns, key), n) == n
    if name != "preble-programming":  # programming's arrivals come in bursts of one problem's samples
        assert a.mean_rate == pytest.approx(5.0, rel=0.2)


def test_toolbench_structure_and_zipf() -> None:
    uniform = pw.make_toolbench(pw.PrebleSpec(num_requests=4000, num_tools=200), 0)
    skewed = pw.make_toolbench(pw.PrebleSpec(num_requests=4000, num_tools=200, zipf=1.1), 0)
    for t in (uniform, skewed):
        assert {tuple(s[0] for s in r.segments) for r in t.requests} == {(pw.NS_SYSTEM, pw.NS_TOOL, NS_UNIQUE)}

    def top_share(t: Trace) -> float:
        counts = np.bincount([r.segments[1][1] for r in t.requests], minlength=200)
        return counts.max() / counts.sum()

    # uniform: ~1/200 = 0.5% (max of 200 ~Poisson(20) counts: ~2%); Zipf 1.1 over 200: 1 / H(200, 1.1) ~ 20%
    assert top_share(uniform) < 0.03 and top_share(skewed) > 0.15
    many = pw.make_toolbench(pw.PrebleSpec(num_requests=3000, num_tools=1500), 0)
    assert len({r.segments[1][1] for r in many.requests}) > 1000  # ~1500 * (1 - e^-2) = 1297 tools used


def test_agent_chains_extend_the_previous_prompt() -> None:
    t = pw.make_agent(pw.PrebleSpec(num_requests=500), 0)
    by_episode: dict[int, list[TraceRequest]] = {}
    for r in t.requests:
        by_episode.setdefault(r.segments[0][1], []).append(r)
    for steps in by_episode.values():
        for prev, nxt in zip(steps, steps[1:], strict=False):
            # request t+1 = request t's prompt + its output + one observation
            assert nxt.segments[: len(prev.segments)] == prev.segments
            assert len(nxt.segments) == len(prev.segments) + 2
            assert nxt.segments[len(prev.segments)][2] == prev.num_output_tokens
            assert nxt.arrival_s >= prev.arrival_s


def test_programming_samples_arrive_together() -> None:
    t = pw.make_programming(pw.PrebleSpec(num_requests=1000), 0)
    arrivals: dict[int, set[float]] = {}
    for r in t.requests:
        arrivals.setdefault(r.segments[1][1], set()).add(r.arrival_s)
    assert all(len(a) == 1 for a in arrivals.values())
    spread = pw.make_programming(pw.PrebleSpec(num_requests=1000, samples_together=False), 0)
    assert len({r.arrival_s for r in spread.requests}) == 1000


@pytest.mark.parametrize("name", pw.GENERATORS)
def test_clipped_to_max_model_len(name: str) -> None:
    # the 70B profile allows 4096 tokens: LooGLE's documents and VideoQA's videos must be cut, keeping sharing
    t = pw.make_preble_trace(name, pw.PrebleSpec(num_requests=400, max_model_len=4096, num_tools=20), 0)
    assert max(r.num_prompt_tokens + r.num_output_tokens for r in t.requests) <= 4096
    assert pw.workload_stats(t).shared_prefix_frac[0] > 0.6


def test_stats_on_a_hand_made_trace() -> None:
    # a: S(10) K(40) q(5); b: S K q'(5); c: S(10) u(100)
    s, k = (pw.NS_SYSTEM, 0, 10), (pw.NS_TOOL, 0, 40)
    reqs = (
        TraceRequest("a", 0.0, 55, 2, (s, k, (NS_UNIQUE, 0, 5))),
        TraceRequest("b", 1.0, 55, 4, (s, k, (NS_UNIQUE, 1, 5))),
        TraceRequest("c", 2.0, 110, 6, (s, (NS_UNIQUE, 2, 100))),
    )
    st = pw.workload_stats(Trace("hand", reqs))
    # shared: a 0/55, b 50/55, c 10/110
    assert st.shared_prefix_frac[0] == pytest.approx((0 + 50 / 55 + 10 / 110) / 3)
    # key portions: a, b -> K (40 > 10), count 2; c -> its own 100-token tail (100 > 10), count 1
    assert st.key_portion_frac[0] == pytest.approx((40 / 55 + 40 / 55 + 100 / 110) / 3)
    assert st.requests_per_key_portion == (1.5, 0.5)
    assert st.output_tokens[0] == 4.0


def test_azure_mix_maps_code_to_tools_and_conversation_to_videos() -> None:
    t = pw.azure_mix(pw.PrebleSpec(num_tools=50), seed=0, duration_s=120.0)
    code = load_trace("azure-code")
    raw_conv = load_trace("azure-conv")
    # the merged trace starts at the conversation file's first row (18:15:46), code starts 77.3 s later
    offset = pw._first_stamp_s("azure-code") - pw._first_stamp_s("azure-conv")
    assert offset == pytest.approx(77.2994, abs=1e-3)
    n_conv = sum(1 for r in raw_conv.requests if r.arrival_s < 120.0)
    n_code = sum(1 for r in code.requests if r.arrival_s + offset < 120.0)
    kinds = [r.segments[0][0] for r in t.requests]
    assert kinds.count(pw.NS_VIDEO) == n_conv and kinds.count(pw.NS_SYSTEM) == n_code
    assert set(kinds) == {pw.NS_VIDEO, pw.NS_SYSTEM}  # toolbench prompts open with the system prompt
    # inter-arrivals x 0.7: the first code arrival moves from 77.3 s to 0.7 x 77.3 s
    first_code = next(r for r in t.requests if r.segments[0][0] == pw.NS_SYSTEM)
    assert first_code.arrival_s == pytest.approx(0.7 * offset, abs=1e-6)
    assert t.duration_s < 0.7 * 120.0
    uniques = [s[1] for r in t.requests for s in r.segments if s[0] == NS_UNIQUE]
    assert len(uniques) == len(set(uniques))  # the two generators' unique keys do not collide
    assert t == pw.azure_mix(pw.PrebleSpec(num_tools=50), seed=0, duration_s=120.0)


def test_sim_cli_names_and_flags() -> None:
    p = sim.build_parser()
    args = p.parse_args(["--trace", "preble-toolbench", "--num-requests", "50", "--zipf", "1.1", "--num-tools",
                         "10", "--rate", "8", "--engine-scheduling", "preble_groups", "--num-priority-groups", "5"])
    t = sim.load_workload(args)
    assert t.name == "preble-toolbench" and len(t.requests) == 50
    assert len({r.segments[1][1] for r in t.requests}) <= 10
    cfg = sim.sim_config(args, "round_robin")
    assert cfg.engine_overrides == {"scheduling": "preble_groups", "num_priority_groups": 5}
    for name in pw.TRACE_NAMES:
        args = p.parse_args(["--trace", name, "--max-requests", "30"])
        assert len(sim.load_workload(args).requests) == 30
    # the poisson default stays 200 requests
    assert len(sim.load_workload(p.parse_args(["--trace", "poisson"])).requests) == 200


def test_tiny_sim_run_with_priority_groups() -> None:
    trace = pw.make_toolbench(pw.PrebleSpec(num_requests=60, num_tools=4, rate=20.0, max_model_len=4096), 0)
    cfg = sim.SimConfig(policy="round_robin", num_workers=2, profile="llama2-70b-h100-tp4",
                        engine_overrides={"scheduling": "preble_groups"})
    res = sim.Simulator(trace, cfg).run()
    assert all(r.status == OK for r in res.records)
    assert sum(s.prefix_cache_hits for s in res.engine_stats) > 0
    # unchanged default: the plain synthetic workload still runs FCFS
    plain = make_workload(WorkloadSpec(num_requests=5), seed=0)
    assert sim.Simulator(plain, sim.SimConfig(num_workers=1)).cores[0].config.scheduling == "fcfs"


def test_sim_samples_apart_flag() -> None:
    """`--samples-apart`: a programming problem's samples arrive one by one instead of at one instant."""
    p = sim.build_parser()
    common = ["--trace", "preble-programming", "--num-requests", "400", "--rate", "8"]
    for extra, together in (([], True), (["--samples-apart"], False)):
        t = sim.load_workload(p.parse_args([*common, *extra]))
        by_problem: dict[int, set[float]] = {}
        for r in t.requests:
            by_problem.setdefault(r.segments[1][1], set()).add(r.arrival_s)
        assert all(len(times) == 1 for times in by_problem.values()) == together
