"""The discrete-event simulator: a tiny run completes every request, is deterministic, and feeds the fleet view
only after the modelled Stats-poll interval and KV-event lag."""

from __future__ import annotations

import dataclasses
import json

import pytest

from switchyard.bench import sim
from switchyard.bench.metrics import OK
from switchyard.bench.workloads import WorkloadSpec, make_workload
from switchyard.router.policies.least_request import LeastRequest

PROFILE = "llama2-70b-h100-tp4"  # 4k context


def _workload(n: int = 50, groups: int = 2):
    # 50 requests at 8 req/s, prompts 300..1500 tokens of which 512 are one of 2 shared system prompts
    spec = WorkloadSpec(
        rate=8.0,
        num_requests=n,
        prompt_len="uniform:300:1500",
        output_len="uniform:2:40",
        prefix_groups=groups,
        prefix_len=512,
    )
    return make_workload(spec, seed=11)


def _cfg(**kw):
    return sim.SimConfig(**{"policy": "round_robin", "num_workers": 2, "profile": PROFILE, **kw})


def test_tiny_run_completes_every_request():
    trace = _workload()
    res = sim.Simulator(trace, _cfg()).run()
    assert len(res.records) == 50
    assert all(r.status == OK for r in res.records), {r.status for r in res.records}
    for r, t in zip(res.records, trace.requests, strict=True):
        assert r.request_id == t.request_id
        assert r.arrival_s == pytest.approx(t.arrival_s)
        assert r.num_output_tokens == t.num_output_tokens  # ignore_eos=False + target = the trace's length
        assert 0 < r.ttft_s <= r.e2e_s
        assert r.arrival_s <= r.dispatch_s < r.first_token_s <= r.finish_s
    m = res.summary(slo_ttft_s=2.0, slo_tpot_s=0.1)
    assert m["num_completed"] == 50
    # 2 groups of a 512-token prefix = 32 blocks each: every request after the first of its group on a worker
    # can hit up to 32 blocks
    assert m["prefix_cache_hit_ratio"] > 0.0
    assert sum(m["requests_per_worker"].values()) == 50
    assert m["requests_per_worker"] == {"w0": 25, "w1": 25}  # round robin


def test_trace_windows_from_the_cli(tmp_path):
    # a named trace gets its default window (Mooncake's first 600 s); a file gets the flags' window, re-based
    p = sim.build_parser()
    t = sim.load_workload(p.parse_args(["--trace", "mooncake-conversation"]))
    assert 0 < len(t.requests) < 12_031 and t.requests[-1].arrival_s < 600.0
    f = tmp_path / "burst.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 + "".join(f"{s},ChatGPT,{100 + s},{s},{100 + 2 * s},Conversation log\n" for s in range(0, 100, 5)))
    t = sim.load_workload(p.parse_args(["--trace", str(f), "--start", "12", "--duration", "20"]))
    assert [(r.arrival_s, r.num_prompt_tokens) for r in t.requests] == [(0.0, 115), (5.0, 120), (10.0, 125), (15.0, 130)]
    # Azure 2024's week files, by their published names, get their 2023 counterparts' windows (code: 600 s)
    week = tmp_path / "AzureLLMInferenceTrace_code_1week.csv"
    week.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2024-05-10 00:{m:02d}:00.000000+00:00,{100 + m},5\n" for m in range(0, 20, 2)))
    t = sim.load_workload(p.parse_args(["--trace", str(week)]))
    assert [r.arrival_s for r in t.requests] == [0.0, 120.0, 240.0, 360.0, 480.0]


def test_a_large_slice_gets_a_hint(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sim, "LARGE_SLICE", 2)  # the threshold, not the behaviour: 100,000 rows would be slow here
    f = tmp_path / "t.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "0,ChatGPT,50,2,52,x\n1,ChatGPT,60,2,62,x\n2,ChatGPT,70,2,72,x\n")
    argv = ["--trace", str(f), "--workers", "1", "--policies", "round_robin", "--out", str(tmp_path / "o"),
            "--no-plots"]
    assert sim.main(argv) == 0
    assert "3 requests per run; --duration or --max-requests replays a part" in capsys.readouterr().err
    assert sim.main([*argv, "--max-requests", "3"]) == 0
    assert "replays a part" not in capsys.readouterr().err


def test_where_replays_one_model_of_a_mixed_trace(tmp_path, capsys):
    f = tmp_path / "t.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "0,ChatGPT,50,2,52,x\n1,GPT-4,60,2,62,x\n2,ChatGPT,70,2,72,x\n")
    out = tmp_path / "o"
    argv = ["--trace", str(f), "--workers", "1", "--policies", "round_robin", "--out", str(out), "--no-plots"]
    assert sim.main([*argv, "--where", "Model=ChatGPT"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["trace"]["num_requests"] == 2 and data["trace"]["where"] == {"Model": ["ChatGPT"]}
    assert data["runs"][0]["metrics"]["num_completed"] == 2
    capsys.readouterr()
    assert sim.main([*argv, "--where", "Model=gpt4"]) == 2  # a value no row has: an error, not an empty replay
    assert "no row has Model in ['gpt4']" in capsys.readouterr().err
    assert sim.main(["--trace", "poisson", "--where", "Model=ChatGPT", "--out", str(out)]) == 2
    assert "--where selects rows of a trace file; poisson is generated" in capsys.readouterr().err
    assert sim.main(["--trace", "preble-azure-mix", "--where", "Model=ChatGPT", "--out", str(out)]) == 2
    assert "preble-azure-mix is generated" in capsys.readouterr().err


def test_spread_ties_replays_a_coarse_clock_s_steps_spread_out(tmp_path, capsys):
    # Mooncake-shaped rows on a 3 s clock: with --spread-ties each step's requests arrive apart, inside the step
    f = tmp_path / "m.jsonl"
    rows = [{"timestamp": 3000 * (i // 3), "input_length": 40, "output_length": 2, "hash_ids": [i]} for i in range(9)]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "o"
    argv = ["--trace", str(f), "--workers", "1", "--policies", "round_robin", "--out", str(out), "--no-plots",
            "--block-size", "16"]
    assert sim.main(argv) == 0
    plain = json.loads((out / "results.json").read_text())["trace"]
    assert plain["spread_ties"] is False and plain["slice_duration_s"] == 6.0  # stamps 0, 3 and 6 s
    assert sim.main([*argv, "--spread-ties"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["trace"]["spread_ties"] is True and data["runs"][0]["metrics"]["num_completed"] == 9
    moved = data["trace"]["slice_duration_s"]  # the first and last stamps' requests moved within their steps
    assert 3.0 < moved < 9.0 and moved != 6.0
    capsys.readouterr()
    assert sim.main(["--trace", "preble-toolbench", "--spread-ties", "--out", str(out)]) == 2
    assert "--spread-ties spreads a trace file's coarse clock; preble-toolbench is generated" in capsys.readouterr().err


def test_a_batch_job_without_output_lengths_is_paced_and_filled(tmp_path, capsys):
    # ACDC's content-hash jobs (alibaba/ServeGen data/offline): no timestamp and no output_length. As written the
    # whole job arrives at once; with --rate it is a Poisson stream at that rate, and --output-len draws the lengths
    f = tmp_path / "trace_b.jsonl"
    rows = [{"request_id": i, "type": "text", "input_length": 200 + i,
             "hash_ids": [*range(10), *range(100 * i, 100 * i + 3 + i // 16)], "img_ids": []} for i in range(40)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "o"
    argv = ["--trace", str(f), "--workers", "2", "--policies", "round_robin", "--out", str(out), "--no-plots",
            "--output-len", "uniform:3:9"]
    assert sim.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["trace"]["slice_duration_s"] == 0.0
    assert "40 output lengths drawn from uniform:3:9" in data["trace"]["source"]
    assert data["runs"][0]["metrics"]["num_completed"] == 40
    assert sim.main([*argv, "--rate", "5"]) == 0
    data = json.loads((out / "results.json").read_text())
    assert "a batch job sent as a Poisson stream" in data["trace"]["source"]
    assert data["runs"][0]["rate"] == pytest.approx(5.0) and data["runs"][0]["metrics"]["num_completed"] == 40
    assert data["runs"][0]["metrics"]["prefix_cache_hit_ratio"] > 0  # the 10 shared blocks are 16 tokens each
    capsys.readouterr()


def test_the_report_says_what_became_of_requests_not_completed(tmp_path, capsys):
    # a prompt over the model's length is rejected at admission: the table's "done" counts 2/3, and the line
    # under it (printed and in results.md) names the outcome
    f = tmp_path / "long.csv"
    f.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                 "0,ChatGPT,500,4,504,x\n1,ChatGPT,300000,4,300004,x\n2,ChatGPT,700,4,704,x\n")
    assert sim.main(["--trace", str(f), "--workers", "1", "--policies", "round_robin", "--out", str(tmp_path / "o"),
                     "--no-plots"]) == 0
    line = "Not completed: round_robin time_scale=1: 1 rejected_too_long."
    assert line in capsys.readouterr().out
    md = (tmp_path / "o" / "results.md").read_text()
    assert "| 2/3 |" in md and line in md


def test_unique_prompts_have_no_prefix_hits():
    res = sim.Simulator(_workload(n=20, groups=0), _cfg()).run()
    assert res.summary(2.0, 0.1)["prefix_cache_hit_ratio"] == 0.0


def _run_cli(tmp_path, name, *extra):
    out = tmp_path / name
    argv = [
        "--trace",
        "poisson",
        "--rate",
        "6",
        "--num-requests",
        "30",
        "--prefix-groups",
        "3",
        "--prompt-len",
        "uniform:200:1200",
        "--output-len",
        "uniform:1:30",
        "--workers",
        "2",
        "--profile",
        PROFILE,
        "--policies",
        "round_robin,power_of_two",
        "--seed",
        "5",
        "--out",
        str(out),
        "--no-plots",
        *extra,
    ]
    assert sim.main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    for run in data["runs"]:
        run.pop("timing")  # wall-clock numbers are the only nondeterministic part
    return data


def test_same_seed_same_json(tmp_path, capsys):
    a = _run_cli(tmp_path, "a")
    b = _run_cli(tmp_path, "b")
    assert a == b
    assert _run_cli(tmp_path, "c", "--jobs", "2") == a  # one process per run: same numbers
    assert [r["policy"] for r in a["runs"]] == ["round_robin", "power_of_two"]
    md = (tmp_path / "a" / "results.md").read_text()
    assert md.count("\n|") == 3  # header, rule, 2 rows
    floor = a["runs"][0]["ttft_floor"]  # the load's TTFT floor: below every run's TTFT, and under the table
    assert all(r["ttft_floor"] == floor and r["metrics"]["ttft_s"]["p99"] >= floor["ttft_s"]["p99"] > 0
               for r in a["runs"])
    assert f"p99 {floor['ttft_s']['p99']:.3f} s" in md
    assert f"p99 {floor['ttft_s']['p99']:.3f} s" in capsys.readouterr().out  # and under the printed table


class SpyPolicy(LeastRequest):
    """least_request that records when it saw which signal (the simulator's clock is the router's)."""

    def __init__(self) -> None:
        self.clock = None
        self.kv_deliveries: list[tuple[float, float]] = []  # (router now, batch.ts = step end)
        self.stats_seen: list[tuple[float, float]] = []  # (select now, stats sample time of a worker)
        self.ticks: list[float] = []

    def select(self, ctx, fleet, now):
        for w in fleet.workers(ctx.model):
            self.stats_seen.append((now, now - w.stats_age_s))
        return super().select(ctx, fleet, now)

    def on_kv_events(self, worker_id, batch):
        self.kv_deliveries.append((self.clock.now(), batch.ts))

    def on_tick(self, now):
        self.ticks.append(now)


def test_fleet_sees_signals_only_after_the_modelled_lag():
    spy = SpyPolicy()
    s = sim.Simulator(_workload(n=30), _cfg(event_lag_s=0.05, stats_interval_s=0.25), policy=spy)
    spy.clock = s.clock
    s.run()
    assert spy.kv_deliveries
    for now, ts in spy.kv_deliveries:
        assert now == pytest.approx(ts + 0.05)  # delivered exactly event_lag after the producing step ended
    assert spy.stats_seen
    for now, stats_at in spy.stats_seen:
        assert 0.0 <= now - stats_at < 0.25 + 1e-9  # at most one poll interval old
        k = round(stats_at / 0.25)
        assert stats_at == pytest.approx(k * 0.25)  # and only ever from a poll
    assert spy.ticks[:3] == pytest.approx([0.1, 0.2, 0.3])


def test_a_peer_polls_load_as_often_as_its_own_deployment(tmp_path):
    # llm-d's EPP refreshes metrics every 50 ms: with llmd_scorer the simulated router polls Stats at that period,
    # as the daemon's registry does, and at the configured one (the daemon's 0.2 s, or --stats-interval) otherwise
    def period(policy, configured=0.2):
        return sim.Simulator(_workload(n=2), _cfg(policy=policy, stats_interval_s=configured)).stats_interval_s

    assert period("llmd_scorer") == period("llmd_precise") == 0.05
    assert period("switchyard") == 0.2 and period("switchyard", 0.3) == 0.3 and period("llmd_scorer", 0.3) == 0.05
    assert period("llmd_scorer", 0.01) == 0.01  # a cap, not a setting
    spy = SpyPolicy()
    spy.load_poll_s = 0.05
    s = sim.Simulator(_workload(n=30), _cfg(stats_interval_s=0.25), policy=spy)
    spy.clock = s.clock
    s.run()
    assert spy.stats_seen and all(now - at < 0.05 + 1e-9 for now, at in spy.stats_seen)  # polled every 50 ms
    out = tmp_path / "o"
    assert sim.main(["--trace", "poisson", "--num-requests", "20", "--workers", "2", "--policies",
                     "round_robin,llmd_scorer", "--out", str(out), "--no-plots"]) == 0
    runs = json.loads((out / "results.json").read_text())["runs"]
    assert [(r["policy"], r["stats_interval_s"]) for r in runs] == [("round_robin", 0.2), ("llmd_scorer", 0.05)]


class InFlightSpy(LeastRequest):
    def __init__(self) -> None:
        self.fleet = None
        self.max_in_flight = 0

    def on_dispatch(self, ctx, decision, now):
        self.max_in_flight = max(self.max_in_flight, self.fleet.get(decision.worker_id).in_flight)


def test_router_queue_holds_while_every_worker_is_saturated():
    # 40 requests at 8 req/s onto 2 workers that run at most 2 sequences each: the daemon's hold condition
    # (in_flight >= max_num_seqs on every worker) must queue them, and the queue releases them FCFS
    spy = InFlightSpy()
    s = sim.Simulator(_workload(n=40), _cfg(engine_overrides={"max_num_seqs": 2}), policy=spy)
    spy.fleet = s.fleet
    res = s.run()
    assert all(r.status == OK for r in res.records)
    held = [r for r in res.records if r.dispatch_s > r.arrival_s]
    assert len(held) > 10
    dispatch_order = sorted(res.records, key=lambda r: (r.dispatch_s, int(r.request_id[1:])))
    assert [r.request_id for r in dispatch_order] == [r.request_id for r in res.records]  # FCFS
    assert spy.max_in_flight <= 2  # released only when some worker has room, and least_request picks it
    m = res.summary(2.0, 0.1)
    assert m["num_held"] == len(held) and m["queue_wait_s"]["mean"] > 0


def test_no_queue_routes_at_arrival():
    res = sim.Simulator(_workload(n=40), _cfg(use_queue=False, engine_overrides={"max_num_seqs": 2})).run()
    assert all(r.status == OK and r.dispatch_s == r.arrival_s for r in res.records)


def test_param_sets_one_policys_knob_and_is_recorded(tmp_path, capsys):
    trace = make_workload(WorkloadSpec(arrival="poisson", rate=5.0, num_requests=5), seed=1)
    cfg = sim.SimConfig(policy="switchyard", num_workers=2, profile=PROFILE, policy_params={"externality_weight": "1"})
    assert sim.Simulator(trace, cfg).policy.sy.externality_weight == 1.0
    assert sim.Simulator(trace, sim.SimConfig(policy="switchyard")).policy.sy.externality_weight == 0.1
    data = _run_cli(tmp_path, "p", "--policies", "round_robin,e2", "--param", "e2.history_window_s=30")
    assert data["config"]["policy_params"] == {"e2": {"history_window_s": "30"}}
    assert sim.main(["--trace", "poisson", "--policies", "e2", "--param", "e2.nope=1"]) == 2
    assert "policy 'e2': nope: Extra inputs are not permitted" in capsys.readouterr().err


@pytest.mark.parametrize("mirror", [True, False])
def test_router_replicas_each_take_arrivals_in_turn_and_learn_the_others_from_the_workers(mirror):
    """Three replicas over the same workers: arrivals reach them in turn, each request is served once, and with
    the mirror each replica's E2 load history H holds every request the fleet served (its own by id, the others'
    from the workers' request events, namespaced); without it, only its own third."""
    from switchyard.router.peer_mirror import peer_key

    trace = _workload(n=30)  # 30 requests over ~4 s, inside H (180 s): nothing expires
    s = sim.Simulator(trace, _cfg(policy="e2", router_replicas=3, policy_params={"mirror_peers": mirror}))
    res = s.run()
    assert all(r.status == OK for r in res.records)
    ids = [r.request_id for r in trace.requests]
    for i, router in enumerate(s.routers):
        own = ids[i::3]
        seen = {e.request_id for h in router.policy.history.values() for e in h.entries}
        peers = {peer_key(f"r{j}", rid) for j in range(3) if j != i for rid in ids[j::3]}
        assert seen == (set(own) | peers if mirror else set(own))
        assert not router.policy.in_flight and len(router.mirror) == 0  # every request ended everywhere


def test_router_replicas_are_rows_of_their_own(tmp_path):
    runs = _run_cli(tmp_path, "replicas", "--router-replicas", "1,2", "--policies", "e2")["runs"]
    assert [(r["policy"], r.get("router_replicas", 1)) for r in runs] == [("e2", 1), ("e2", 2)]
    assert "| e2 x2 routers |" in (tmp_path / "replicas" / "results.md").read_text()
    with pytest.raises(ValueError, match="router_replicas"):
        sim.Simulator(_workload(n=2), _cfg(router_replicas=0))
    with pytest.raises(ValueError, match="one router"):
        sim.Simulator(_workload(n=2), _cfg(router_replicas=2), policy=LeastRequest())


def _programming(n: int):
    """Preble's program generation: bursts of samples of one problem arriving together, sharing its long prefix."""
    from switchyard.bench import preble_workloads as preble
    from switchyard.workers.engine.profiles import get_profile

    spec = preble.PrebleSpec(num_requests=n, rate=64.0, max_model_len=get_profile(PROFILE).max_model_len)
    return preble.make_preble_trace("preble-programming", spec, seed=2)


@pytest.mark.parametrize(("policy", "engine", "bursts"), [
    ("round_robin", {}, False),
    ("e2", {"scheduling": "preble_groups"}, False),
    ("switchyard", {"scheduling": "lpm", "max_num_seqs": 4}, False),
    ("smg_cache_aware", {"num_kv_blocks": 260, "max_num_batched_tokens": 512}, False),  # evicts and chunks
    ("e2", {}, True),
    ("least_request", {"max_num_batched_tokens": 1024}, True),
])
def test_no_request_beats_its_ttft_floor(policy, engine, bursts):
    """`ttft_floors` bounds every request's TTFT from below, under queueing, chunking, preemption, reordering and
    eviction: prompts sharing prefixes, arriving faster than two workers serve them, or in bursts that share a
    prefix none of them holds yet."""
    from switchyard.bench.traces import PromptFactory, ttft_floors
    from switchyard.workers.engine.core import EngineConfig
    from switchyard.workers.engine.profiles import get_profile

    trace = _programming(160) if bursts else make_workload(WorkloadSpec(
        rate=40.0, num_requests=120, prompt_len="uniform:100:1800", output_len="uniform:2:60", prefix_groups=3,
        prefix_len=768), seed=5)
    res = sim.Simulator(trace, _cfg(policy=policy, engine_overrides=engine)).run()
    budget = engine.get("max_num_batched_tokens", EngineConfig().max_num_batched_tokens)
    floors = ttft_floors(trace, PromptFactory(16, seed=0), get_profile(PROFILE), budget)
    ttfts = [r.ttft_s for r in res.records]
    assert all(r.status == OK for r in res.records)
    assert min(t - f for t, f in zip(ttfts, floors, strict=True)) >= -1e-9
    assert sum(ttfts) > 1.5 * sum(floors)  # it queued: the bound was not met trivially
    assert any(r.num_cached_tokens for r in res.records)
    # TTFT = router queue + engine wait + prefill span, each request and so each mean
    for r in res.records:
        assert r.arrival_s <= r.dispatch_s <= r.first_scheduled_s < r.first_token_s
    m = res.summary(2.0, 0.2)
    assert m["queue_wait_s"]["mean"] + m["engine_wait_s"]["mean"] + m["prefill_span_s"]["mean"] == pytest.approx(
        m["ttft_s"]["mean"])
    assert m["engine_wait_s"]["mean"] > 0


def test_ttft_floor_covers_the_requests_the_admission_lets_through():
    """A prompt past the engines' max_model_len is rejected and has no TTFT, so the floor leaves it out too."""
    trace = make_workload(WorkloadSpec(rate=8.0, num_requests=40, prompt_len="uniform:2000:6000",
                                       output_len="uniform:2:10"), seed=3)
    args = sim.build_parser().parse_args(["--profile", PROFILE, "--workers", "2"])
    floor = sim.ttft_floor(args, trace)
    res = sim.Simulator(trace, sim.sim_config(args, "round_robin")).run()
    done = [r for r in res.records if r.status == OK]
    assert 0 < len(done) < len(trace.requests)  # some prompts are over the 70B's 4,096 tokens
    assert floor["ttft_s"]["n"] == len(done)
    ttft = [r.ttft_s for r in done]
    assert floor["ttft_s"]["max"] <= max(ttft) and floor["ttft_s"]["mean"] <= sum(ttft) / len(ttft)


def test_a_burst_pays_for_the_prefix_it_shares():
    """Samples arriving together share a prefix none of them can find cached (it is stored one prefill iteration
    after the first of them arrives at the earliest), so their floor is above the arrival-order bound's; a request
    that arrives later than that finds it."""
    from switchyard.bench.traces import PromptFactory, bound_cached_tokens, ttft_floors
    from switchyard.workers.engine.profiles import get_profile

    trace, profile = _programming(160), get_profile(PROFILE)
    floors = ttft_floors(trace, PromptFactory(16, seed=0), profile, 8192)
    cached = bound_cached_tokens(trace, PromptFactory(16, seed=0))
    by_order = [profile.first_token_floor_s(r.num_prompt_tokens - c, c, 8192)
                for r, c in zip(trace.requests, cached, strict=True)]
    assert all(f >= b - 1e-12 for f, b in zip(floors, by_order, strict=True))
    together = [i for i, r in enumerate(trace.requests) if i and r.arrival_s == trace.requests[i - 1].arrival_s]
    assert together and all(floors[i] > by_order[i] for i in together if cached[i])
    # the same requests 10 s apart: every prefix an earlier one brought is ready in time
    spread = dataclasses.replace(trace, requests=tuple(dataclasses.replace(r, arrival_s=10.0 * i)
                                                       for i, r in enumerate(trace.requests)))
    assert list(ttft_floors(spread, PromptFactory(16, seed=0), profile, 8192)) == pytest.approx(by_order, rel=1e-12)


def test_a_mixed_fleet_runs_each_worker_on_its_own_profile(capsys):
    # 2 H100 and 2 A100 workers of one model: each engine iterates at its profile's speed and announces it, so
    # the router prices it; round_robin spreads the same requests evenly, and the A100s decode them slower
    spec = "llama2-70b-h100-tp4:2,llama2-70b-a100-tp4:2"
    names = sim.fleet_profiles(spec)
    assert names == ["llama2-70b-h100-tp4"] * 2 + ["llama2-70b-a100-tp4"] * 2
    assert sim.describe_fleet(names) == "2 x llama2-70b-h100-tp4 + 2 x llama2-70b-a100-tp4"
    assert sim.fleet_profiles("llama3-8b-a100", 3) == ["llama3-8b-a100"] * 3 and sim.fleet_profiles("llama3-8b-a100:1", 1) == ["llama3-8b-a100"]
    s = sim.Simulator(_workload(n=40, groups=0), _cfg(num_workers=4, profile=spec))
    assert [s.fleet.get(w).info.perf_profile for w in s.worker_ids] == names
    res = s.run()
    tpot: dict[str, list[float]] = {"h100": [], "a100": []}
    for r in res.records:
        if r.status == OK and r.num_output_tokens > 1:
            kind = "h100" if r.worker_id in ("w0", "w1") else "a100"
            tpot[kind].append((r.finish_s - r.first_token_s) / (r.num_output_tokens - 1))
    h, a = (sum(v) / len(v) for v in (tpot["h100"], tpot["a100"]))
    assert a > 1.3 * h  # the A100's decode iteration: 43 ms bare against the H100's 29 ms
    # counts must add up to --workers; one fleet serves one model
    for bad, match in (("llama2-70b-h100-tp4:2,llama3-8b-a100:2", "a fleet serves one model"),
                       ("llama2-70b-h100-tp4:0", "NAME:COUNT"), ("llama2-70b-h100-tp4,llama2-70b-a100-tp4", "NAME:COUNT")):
        with pytest.raises(ValueError, match=match):
            sim.fleet_profiles(bad)
    with pytest.raises(ValueError, match="makes 4 workers, --workers says 8"):
        sim.fleet_profiles(spec, 8)
    with pytest.raises(ValueError, match="unknown profile"):
        sim.fleet_profiles("h200:2")


def test_a_policy_at_a_revision_runs_beside_today_s_in_one_sweep(tmp_path):
    # `NAME@REV` (bench/micro/revision.py) in bench sim: HEAD's copy of round_robin places as today's does, in
    # its own row; --param reaches the copy's config
    out = tmp_path / "o"
    argv = ["--trace", "poisson", "--num-requests", "30", "--rate", "10", "--workers", "2", "--no-plots",
            "--policies", "switchyard@HEAD,switchyard", "--out", str(out)]
    assert sim.main(argv) == 0
    runs = {r["policy"]: r["metrics"] for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"switchyard@HEAD", "switchyard"}
    assert runs["switchyard@HEAD"]["ttft_s"] == runs["switchyard"]["ttft_s"]
    assert sim.build_policy("switchyard@HEAD", {"decode_fill": "false"}).sy.decode_fill is False
    with pytest.raises(ValueError, match="unknown policy 'nope@HEAD'"):
        sim.parse_policies("nope@HEAD")
    with pytest.raises(ValueError, match="twice"):
        sim.parse_policies("switchyard,switchyard")
