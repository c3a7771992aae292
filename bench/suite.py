"""The simulator campaign in one command (`switchyard bench suite`): every workload x policy at two loads set
from round_robin's saturation point, Preble's ablation, the no-sharing check and 2 -> 4 worker scaling; one
combined markdown summary plus each sweep's own JSON/markdown/PNGs (`bench sim`'s report) under results/suite/.

Sections (specs/preble.md §8, §10):
  a. workloads: preble toolbench (uniform, and Zipf 1.1), agent, programming, videoqa, loogle, mooncake-conversation,
     preble-azure-mix; policies e2 and its peers (smg_cache_aware, smg_least_load, dynamo_kv, llmd_scorer,
     aibrix_prefix) plus Preble's oracle partition (claim 6), round_robin and least_request; 4 workers. Beside each
     workload: its hit bound (the most any routing can reuse); beside each load, its TTFT floor (the least TTFT
     any router can give each request: its prompt computed in the fewest iterations after the blocks that can be
     stored for it by its arrival) and the best peer / that floor, the most any router can still gain. Profiles:
     toolbench/agent/programming on llama2-70b-h100-tp4; videoqa/loogle/azure-mix on llama3-8b-a100 with 20,000 KV
     blocks per worker (their ~10k-25k-token prompts exceed the 70B's 4096 limit; 20k blocks keep the cache
     contended); mooncake on llama3-8b-a100 (its full KV).
  b. ablation (claim 8) on toolbench Zipf 1.1: oracle_partition -> e2_base (E2) -> e2_rebal -> e2 -> e2 +
     --engine-scheduling preble_groups.
  c. no sharing (claim 3): poisson arrivals, unique prompts (lognormal 1024 / 128 tokens), llama3-8b-a100:
     e2 vs round_robin and least_request.
  e. fairness (claim 9) on toolbench Zipf 1.1: e2 routing, the engines admitting FCFS (vLLM), longest prefix first
     (SGLang's lpm) or by Preble's priority groups, with max_num_seqs 32 so that requests wait in the engines (at
     vLLM's 256 seqs and 8192 batched tokens the waiting queue drains every iteration at these loads and the order
     has nothing to reorder), at 1, 1.5 and 2 x round_robin's capacity. Low-hit = under half the prompt cached.
  d. scaling (claim 13): toolbench at 2 and 4 workers: each policy's capacity at both sizes, and latencies at
     rate r on 2 workers vs 2r on 4.
  f. skew (claim 7): toolbench with tool popularity Zipf 1.1, 1.5 and 2.0 (the hottest of 200 tools draws ~21%,
     ~40% and ~61% of requests) at 1 and 1.5 x the Zipf-1.1 loads' highest, runs spanning 3 x E2's window H (so L's
     window fills and the TTFT-doubling detector has two halves): e2_base (no skew rules) -> e2_rebal (+
     rebalancing, replication) -> e2, against switchyard and smg_cache_aware. Per run: Preble's per-worker load
     imbalance max L / min L over H (`load_imbalance`, from what the engines did) and how often the rules fired.
  g. router replicas: each workload at its highest load, one router and REPLICAS routers side by side over the same
     workers (`bench sim --router-replicas`: arrivals in turn, each replica with its own policy, queue and timers,
     all of them reading every worker's Stats and events): e2, switchyard and switchyard-no_mirror (each replica
     blind to the others' requests) against the peers at their defaults (only their own dispatches) and in their
     modes for replicas (smg_mesh: SMG's mesh; dynamo_kv_sync: Dynamo's --router-replica-sync; llmd_precise:
     llm-d's precise scorer).

Capacity: a geometric rate ladder (factor √2) of short round_robin runs; the "light" reference is the mean TTFT at
the lowest rung (load far below saturation); a rung is saturated when its mean TTFT exceeds
`--sat-factor` (4) x the light reference, or a request did not complete. Capacity = the highest rung below the first
saturated one. The two loads are `--load-fractions` (0.5, 1.0) x capacity: half load, and round_robin's knee, where
cache-aware placement should matter most. `--rates WORKLOAD=R1,R2` skips the ladder for that workload.
`--capacity-policy P` runs the ladder with P instead: on the prefix-heavy workloads round_robin's knee is a light
load for a prefix-aware fleet (videoqa on 8 workers: 11.3 req/s for round_robin, 22.6 for smg_cache_aware), so
`--capacity-policy smg_cache_aware --load-fractions 0.7,1.0` measures issue #3's "at >= 70% of fleet capacity"
against the best peer's own knee.

Full (about 28 min on 2 cores, 5 of them section f's long runs, 3 section g's): `switchyard bench suite`. Quick (about 2 min,
300-request runs): `switchyard bench suite --quick`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import redirect_stdout
from io import StringIO
from pathlib import Path
from typing import Any

from switchyard.bench import report, sim
from switchyard.bench.traces import PromptFactory, prefix_hit_bound
from switchyard.router.policies.preble_e2 import E2Config
from switchyard.workers.engine.profiles import get_profile

PEERS = ("smg_cache_aware", "smg_least_load", "dynamo_kv", "llmd_scorer", "aibrix_prefix")
ORACLE = "oracle_partition"  # Preble's oracle baseline (claims 6, 8): needs the trace, so simulator only
POLICIES = ("e2", "switchyard", *PEERS, ORACLE, "round_robin", "least_request")

P70 = ["--profile", "llama2-70b-h100-tp4"]
P8_20K = ["--profile", "llama3-8b-a100", "--num-kv-blocks", "20000"]
WORKLOADS: dict[str, list[str]] = {
    "toolbench": ["--trace", "preble-toolbench", *P70],
    "toolbench-zipf1.1": ["--trace", "preble-toolbench", "--zipf", "1.1", *P70],
    "agent": ["--trace", "preble-agent", *P70],
    "programming": ["--trace", "preble-programming", *P70],
    "videoqa": ["--trace", "preble-videoqa", *P8_20K],
    "loogle": ["--trace", "preble-loogle", *P8_20K],
    "mooncake-conversation": ["--trace", "mooncake-conversation", "--profile", "llama3-8b-a100"],
    "azure-mix": ["--trace", "preble-azure-mix", *P8_20K],
    # the conversation trace's 3 s clock steps spread (traces.spread_ties); asked for by name, not run by default
    "mooncake-conversation-spread": ["--trace", "mooncake-conversation", "--profile", "llama3-8b-a100",
                                     "--spread-ties"],
}
OPT_IN_WORKLOADS = ("mooncake-conversation-spread",)
NO_SHARING = ["--trace", "poisson", "--profile", "llama3-8b-a100"]
ABLATION_WORKLOAD = "toolbench-zipf1.1"
FAIRNESS_SCHEDULINGS = ("fcfs", "lpm", "preble_groups")
FAIRNESS_MAX_NUM_SEQS = 32
FAIRNESS_LOAD_FACTORS = (1.0, 1.5, 2.0)  # x the workload's highest load (round_robin's capacity by default)
SCALING_WORKLOAD = "toolbench"
SKEW_ZIPFS = (1.1, 1.5, 2.0)
SKEW_POLICIES = ("e2_base", "e2_rebal", "e2", "switchyard", "smg_cache_aware")
SKEW_LOAD_FACTORS = (1.0, 1.5)  # x the ablation workload's highest load
SKEW_SPAN_H = 3.0  # arrivals span this many E2 windows H: L over H is sampled over the last two
REPLICAS = 3  # section g: router replicas side by side
PEER_HA_MODES = {  # section g: each run beside the default
    "smg_cache_aware": "smg_mesh", "dynamo_kv": "dynamo_kv_sync", "llmd_scorer": "llmd_precise",
}
LADDER = [0.125 * math.sqrt(2) ** k for k in range(23)]  # 0.125 .. 256 req/s (x workers / 4)


def sim_args(extra: list[str]) -> argparse.Namespace:
    return sim.build_parser().parse_args(extra)


def run_sweep(argv: list[str], out: Path | None, plots: bool, floor: bool = True) -> dict[str, Any]:
    """One `bench sim` sweep (its own progress lines go to a buffer); its report into `out` when given."""
    args = sim_args(argv)
    base = sim.load_workload(args)
    buf = StringIO()
    with redirect_stdout(buf):
        result = sim.run_sweep(args, base, floor)
    if out is not None:
        report.write_report(result, out, plots=plots)
    return result


def _m(run: dict[str, Any], *path: str) -> float:
    v: Any = run["metrics"]
    for k in path:
        v = v[k]
    return float(v)


# ---------------------------------------------------------------------------------------------------- capacity
def capacity(argv: list[str], policy: str, sat_factor: float, workers: int) -> dict[str, Any]:
    """The saturation rate of `policy` on a rate ladder (see the module docstring): rungs run two at a time."""
    scale = workers / 4
    rungs = [r * scale for r in LADDER]
    points: list[dict[str, float]] = []
    light = None
    i = 0
    batch = 4  # rungs per sweep; stop at the first saturated rung
    while i < len(rungs):
        rates = rungs[i : i + batch]
        res = run_sweep([*argv, "--policies", policy, "--rates", ",".join(f"{r:.4g}" for r in rates)], None, False,
                        floor=False)
        done = False
        for run in sorted(res["runs"], key=lambda r: r["rate"]):
            ttft = _m(run, "ttft_s", "mean")
            complete = run["metrics"]["num_completed"] == run["metrics"]["num_requests"]
            if light is None:
                light = ttft
            sat = ttft > sat_factor * light or not complete
            points.append({"rate": run["rate"], "ttft_mean_s": ttft, "ttft_p99_s": _m(run, "ttft_s", "p99"),
                           "saturated": sat})
            if sat:
                done = True
                break
        if done:
            break
        i += batch
    ok = [p["rate"] for p in points if not p["saturated"]]
    cap = max(ok) if ok else points[0]["rate"]
    return {"policy": policy, "workers": workers, "capacity_req_s": cap, "light_ttft_s": light,
            "sat_factor": sat_factor, "ladder": points,
            "capped": not any(p["saturated"] for p in points)}  # no rung saturated: the capacity is at least this


def capacity_text(cap: dict[str, Any]) -> str:
    """A ladder's capacity for the tables, '>= ' before it when no rung saturated (`capped`); '-' for fixed rates."""
    if "capacity_req_s" not in cap:
        return "-"
    return f"{'>= ' if cap.get('capped') else ''}{cap['capacity_req_s']:.2f}"


# ---------------------------------------------------------------------------------------------------- tables
# The suite's hit ratio: each request's cached prompt tokens at its first admission / its prompt tokens (the
# engines' counters, as vLLM's, also count a preempted request's re-admission).
HIT = "prompt_cached_tokens_frac"


def policy_table(runs: list[dict[str, Any]], label_of: Any = None) -> str:
    lines = ["| policy | req/s | done | TTFT mean s | TTFT p99 s | warm TTFT mean s | warm TTFT p99 s | E2E mean s "
             "| E2E p99 s | hit ratio |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        m = r["metrics"]
        name = label_of(r) if label_of else r["policy"]
        lines.append(f"| {name} | {r['rate']:.2f} | {m['num_completed']}/{m['num_requests']} "
                     f"| {_m(r, 'ttft_s', 'mean'):.3f} | {_m(r, 'ttft_s', 'p99'):.3f} | {_m(r, 'ttft_warm_s', 'mean'):.3f} "
                     f"| {_m(r, 'ttft_warm_s', 'p99'):.3f} | {_m(r, 'e2e_s', 'mean'):.2f} "
                     f"| {_m(r, 'e2e_s', 'p99'):.2f} | {m[HIT]:.3f} |")
    return "\n".join(lines)


METRICS = (("TTFT mean", ("ttft_s", "mean")), ("TTFT p99", ("ttft_s", "p99")),
           ("warm TTFT mean", ("ttft_warm_s", "mean")), ("warm TTFT p99", ("ttft_warm_s", "p99")),
           ("E2E mean", ("e2e_s", "mean")), ("E2E p99", ("e2e_s", "p99")))
FLOOR_METRICS = tuple(m for m in METRICS if m[0] in ("TTFT mean", "TTFT p99", "warm TTFT p99"))
OURS = ("e2", "switchyard")  # Switchyard's policies, each compared with the best peer


def ours_vs_peers(runs: list[dict[str, Any]], ours: str, peers: tuple[str, ...] = PEERS) -> dict[str, Any]:
    """`ours`' latency / the best peer's (lowest of `peers`), per metric; < 1 = ours better. Also vs round_robin
    and the oracle partition (`vs_round_robin`, `vs_oracle_partition`) where they ran."""
    by = {r["policy"]: r for r in runs}
    me = by.get(ours)
    out: dict[str, Any] = {}
    if me is None:
        return out
    for label, path in METRICS:
        rows = [(_m(by[p], *path), p) for p in peers if p in by]
        if rows:
            best, who = min(rows)
            out[label] = {"ours": _m(me, *path), "best_peer": who, "best_peer_value": best,
                          "ratio": _m(me, *path) / best if best > 0 else float("nan")}
        for ref in ("round_robin", ORACLE):
            if ref in by and _m(by[ref], *path) > 0:
                out.setdefault(label, {})[f"vs_{ref}"] = _m(me, *path) / _m(by[ref], *path)
    hits = [(by[p]["metrics"][HIT], p) for p in peers if p in by]
    if hits:
        best, who = max(hits)
        out["hit ratio"] = {"ours": me["metrics"][HIT], "best_peer": who,
                            "best_peer_value": best}
    return out


def over_floor(cmp: dict[str, Any], floor: dict[str, dict[str, float]]) -> dict[str, float]:
    """The best peer's TTFT / the floor, per TTFT metric: the most any router can still gain on it (>= 1)."""
    out: dict[str, float] = {}
    for label, (key, stat) in FLOOR_METRICS:
        if label in cmp and floor[key][stat] > 0:
            out[label] = cmp[label]["best_peer_value"] / floor[key][stat]
    return out


def floor_text(gain: dict[str, float]) -> str:
    """'x1.61, x1.35 (x1.37)': best peer / floor for TTFT mean, p99 (warm p99); '-' when no peer ran."""
    if not all(label in gain for label, _ in FLOOR_METRICS):
        return "-"
    mean, p99, warm_p99 = (gain[label] for label, _ in FLOOR_METRICS)
    return f"x{mean:.2f}, x{p99:.2f} (x{warm_p99:.2f})"


def ratio_line(cmp: dict[str, Any], ours: str) -> str:
    parts = []
    for label, _ in METRICS:
        c = cmp.get(label)
        if c and "ratio" in c:
            parts.append(f"{label} x{c['ratio']:.2f} (best peer {c['best_peer']})")
    return f"{ours} / best peer: " + "; ".join(parts) if parts else ""


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench suite", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="300-request runs, 200-request capacity ladders (~2 min)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per run (default 1500; --quick 300)")
    ap.add_argument("--ladder-requests", type=int, default=None,
                    help="requests per capacity-ladder run (default 500; --quick 200)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--workloads", default=",".join(w for w in WORKLOADS if w not in OPT_IN_WORKLOADS),
                    help=f"comma-separated (default: all but {','.join(OPT_IN_WORKLOADS)}); known: {','.join(WORKLOADS)}")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sections", default="a,b,c,d,e,f,g",
                    help="a workloads, b ablation, c no-sharing, d scaling, e fairness, f skew, g router replicas")
    ap.add_argument("--rates", nargs="*", default=[], metavar="WORKLOAD=R1,R2",
                    help="fixed loads for a workload (skips its capacity ladder); 'no-sharing' for section c")
    ap.add_argument("--load-fractions", default="0.5,1.0", help="loads as fractions of the capacity policy's capacity")
    ap.add_argument("--capacity-policy", default="round_robin",
                    help="whose knee sets the loads (default round_robin; e.g. smg_cache_aware: the load relative to "
                         "a fleet routed with prefix awareness, where round_robin's knee is light)")
    ap.add_argument("--sat-factor", type=float, default=4.0, help="saturated: mean TTFT > this x the light rung's")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/suite"))
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    n = args.num_requests or (300 if args.quick else 1500)
    n_ladder = args.ladder_requests or (200 if args.quick else 500)
    fractions = [float(x) for x in args.load_fractions.split(",")]
    fixed: dict[str, list[float]] = {}
    for item in args.rates:
        key, _, vals = item.partition("=")
        fixed[key] = [float(v) for v in vals.split(",") if v]
    names = [w for w in args.workloads.split(",") if w]
    for w in names:
        if w not in WORKLOADS:
            print(f"bench suite: unknown workload {w!r}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
    policies = [p for p in args.policies.split(",") if p]
    sections = set(args.sections.split(","))
    plots = not args.no_plots
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    common = ["--workers", str(args.workers), "--seed", str(args.seed), "--jobs", str(args.jobs)]

    def sized(k: int) -> list[str]:
        return ["--num-requests", str(k), "--max-requests", str(k)]

    t_start = time.perf_counter()
    data: dict[str, Any] = {"config": {"num_requests": n, "ladder_requests": n_ladder, "workers": args.workers,
                                       "capacity_policy": args.capacity_policy,
                                       "load_fractions": fractions, "sat_factor": args.sat_factor,
                                       "policies": policies, "quick": args.quick, "seed": args.seed},
                            "capacity": {}, "workloads": {}, "ablation": {}, "no_sharing": {}, "scaling": {},
                            "fairness": {}, "skew": {}}
    md: list[str] = []

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    cap_policy = args.capacity_policy
    cap_label = "RR" if cap_policy == "round_robin" else cap_policy

    def loads_for(key: str, argv_w: list[str], policy: str = cap_policy, workers: int | None = None) -> list[float]:
        if key in fixed:
            data["capacity"][key] = {"fixed_rates": fixed[key]}
            return fixed[key]
        nw = workers or args.workers
        wl_argv = [*argv_w, *sized(n_ladder), "--workers", str(nw), "--seed", str(args.seed), "--jobs", str(args.jobs)]
        cap = capacity(wl_argv, policy, args.sat_factor, nw)
        data["capacity"][key] = cap
        log(f"{key}: {policy} capacity {capacity_text(cap)} req/s on {nw} workers "
            f"(light TTFT {cap['light_ttft_s']:.3f} s, {len(cap['ladder'])} rungs)")
        return [round(f * cap["capacity_req_s"], 3) for f in fractions]

    # ------------------------------------------------------------------ a. workloads
    if "a" in sections:
        md.append("## a. Workloads x policies\n")
        ours_run = [p for p in OURS if p in policies]
        md.append(f"{args.workers} workers; {n} requests per run; loads = {fractions} x {cap_policy}'s capacity "
                  f"(ladder of {n_ladder}-request runs, saturated when mean TTFT > {args.sat_factor:g} x the lightest "
                  "rung's). Ratios: ours (" + ", ".join(ours_run) + ") / the best of " + ", ".join(PEERS)
                  + " (< 1 = ours better). Warm: requests after the first quarter of arrivals (the cold-cache "
                  "warm-up excluded). Hit bound: one unbounded cache serving the trace in order (`prefix_hit_bound`), "
                  "the most any routing can reuse; pooled LRU: one LRU cache of the whole fleet's KV blocks, a reference for "
                  "what the capacity allows. Hit ratio: each request's cached prompt tokens / its prompt tokens "
                  "(the engines' counters also count a preempted request's re-admission, so under preemption they "
                  "can pass the bound). TTFT floor, per load: each request's prompt computed in the fewest "
                  "iterations after the blocks that can be stored for it by its arrival (`ttft_floors`: a burst's "
                  "shared prefix is none of its requests'), so no router's TTFT mean or p99 is below it: best peer "
                  "/ floor is the most any router can still gain on that metric.\n")
        overview = [f"| workload | load | req/s | {cap_label} capacity | ours | " + " | ".join(label for label, _ in METRICS)
                    + " | our hit | best peer hit | hit bound | pooled LRU | ours / RR TTFT mean "
                    "| ours / oracle E2E mean, p99 | best peer / TTFT floor: mean, p99 (warm p99) |",
                    "|" + "---|" * (12 + len(METRICS))]
        detail: list[str] = []
        for w in names:
            argv_w = WORKLOADS[w]
            rates = loads_for(w, argv_w)
            t0 = time.perf_counter()
            res = run_sweep([*argv_w, *sized(n), *common, "--policies", ",".join(policies),
                             "--rates", ",".join(f"{r:g}" for r in rates)], out / "workloads" / w, plots)
            cap = data["capacity"][w].get("capacity_req_s")
            wl_args = sim_args([*argv_w, *sized(n), "--seed", str(args.seed)])
            wl_trace = sim.load_workload(wl_args)
            wl_prompts = PromptFactory(wl_args.block_size, seed=args.seed)  # both bounds: its memo hashes once
            bound = prefix_hit_bound(wl_trace, wl_prompts)
            fleet_blocks = args.workers * (
                wl_args.num_kv_blocks or get_profile(wl_args.profile).num_kv_blocks(wl_args.block_size)
            )
            pooled = prefix_hit_bound(wl_trace, wl_prompts, fleet_blocks)
            entry = {"rates": rates, "capacity_req_s": cap, "prefix_hit_bound": bound,
                     "pooled_lru_hit": pooled, "fleet_kv_blocks": fleet_blocks, "loads": []}
            for j, rate in enumerate(rates):
                runs = [r for r in res["runs"] if abs(next(iter(r["load"].values())) - rate) < 1e-9]
                cmps = {ours: ours_vs_peers(runs, ours) for ours in ours_run}
                floor = runs[0]["ttft_floor"]  # the load's: it moves with the arrival times
                entry["loads"].append({"rate": rate, "fraction": fractions[j] if j < len(fractions) else None,
                                       "ttft_floor": floor,
                                       "runs": [{"policy": r["policy"], "rate": r["rate"], "metrics": {
                                           k: r["metrics"][k] for k in ("ttft_s", "ttft_warm_s", "e2e_s", "tpot_s",
                                                                         "prefix_cache_hit_ratio", HIT, "queue_wait_s",
                                                                         "engine_wait_s", "prefill_span_s", "num_completed",
                                                                         "num_requests")}} for r in runs],
                                       "vs_best_peer": cmps,
                                       "best_peer_over_floor": over_floor(next(iter(cmps.values()), {}), floor)})
                frac = f"{fractions[j]:g}x" if j < len(fractions) else "fixed"
                detail.append(f"### {w} @ {rate:g} req/s ({frac} {cap_label} capacity)\n")
                detail.append(policy_table(runs))
                detail.append("\nTTFT floor: " + ", ".join(f"{label} {floor[key][stat]:.3f} s"
                                                          for label, (key, stat) in FLOOR_METRICS))
                detail.append("\nWhere the mean TTFT goes (router queue + engine wait + prefill span, s): " + "; ".join(
                    f"{r['policy']} {_m(r, 'queue_wait_s', 'mean'):.3f} + {_m(r, 'engine_wait_s', 'mean'):.3f} + "
                    f"{_m(r, 'prefill_span_s', 'mean'):.3f}" for r in runs if r["policy"] in (*OURS, *PEERS)))
                for ours, cmp in cmps.items():
                    detail.append("\n" + ratio_line(cmp, ours))
                    if "hit ratio" not in cmp:  # no peer ran
                        continue
                    rr = cmp["TTFT mean"].get("vs_round_robin", float("nan"))
                    orc = [cmp[m].get(f"vs_{ORACLE}", float("nan")) for m in ("E2E mean", "E2E p99")]
                    overview.append(
                        f"| {w} | {frac} | {rate:g} | {capacity_text(data['capacity'][w])} | {ours} "
                        + "".join(f"| x{cmp[label]['ratio']:.2f} " for label, _ in METRICS)
                        + f"| {cmp['hit ratio']['ours']:.3f} | {cmp['hit ratio']['best_peer_value']:.3f} "
                          f"({cmp['hit ratio']['best_peer']}) | {bound:.3f} | {pooled:.3f} | x{rr:.2f} "
                          f"| x{orc[0]:.2f}, x{orc[1]:.2f} | {floor_text(entry['loads'][-1]['best_peer_over_floor'])} |")
                detail.append("")
            data["workloads"][w] = entry
            log(f"{w}: {len(res['runs'])} runs in {time.perf_counter() - t0:.0f} s")
        md.append("ours / best peer per metric (< 1 = ours better):\n")
        md.extend(["\n".join(overview), "", *detail])

    # ------------------------------------------------------------------ b. ablation
    if "b" in sections:
        w = ABLATION_WORKLOAD
        rates = data["workloads"][w]["rates"] if w in data["workloads"] else loads_for(w, WORKLOADS[w])
        rs = ",".join(f"{r:g}" for r in rates)
        base_argv = [*WORKLOADS[w], *sized(n), *common, "--rates", rs]
        t0 = time.perf_counter()
        res1 = run_sweep([*base_argv, "--policies", f"{ORACLE},e2_base,e2_rebal,e2"], out / "ablation" / "policies",
                         plots)
        res2 = run_sweep([*base_argv, "--policies", "e2", "--engine-scheduling", "preble_groups"],
                         out / "ablation" / "preble_groups", plots)
        for r in res2["runs"]:
            r["policy"] = "e2 + preble_groups"
        md.append(f"## b. Ablation (claim 8), {w}\n")
        md.append("oracle_partition -> e2_base (E2 only) -> e2_rebal (+ rebalancing, replication) -> e2 (+ P/D "
                  "balancing) -> e2 + preble_groups (+ the engines' local priority groups).\n")
        data["ablation"] = {"workload": w, "rates": rates, "runs": []}
        for rate in rates:
            runs = [r for r in res1["runs"] + res2["runs"] if abs(next(iter(r["load"].values())) - rate) < 1e-9]
            md.append(f"### {w} @ {rate:g} req/s\n")
            md.append(policy_table(runs) + "\n")
            data["ablation"]["runs"] += [{"policy": r["policy"], "rate": r["rate"], "metrics": r["metrics"]}
                                         for r in runs]
        log(f"ablation: {len(res1['runs']) + len(res2['runs'])} runs in {time.perf_counter() - t0:.0f} s")

    # ------------------------------------------------------------------ e. fairness
    if "e" in sections:
        w = ABLATION_WORKLOAD
        base = data["workloads"][w]["rates"] if w in data["workloads"] else loads_for(w, WORKLOADS[w])
        # from round_robin's knee up: only where e2's engines queue does the admission order have work to do
        rates = [round(max(base) * f, 3) for f in FAIRNESS_LOAD_FACTORS]
        t0 = time.perf_counter()
        runs = []
        for sched in FAIRNESS_SCHEDULINGS:
            res = run_sweep([*WORKLOADS[w], *sized(n), *common, "--policies", "e2", "--max-num-seqs",
                             str(FAIRNESS_MAX_NUM_SEQS), "--engine-scheduling", sched,
                             "--rates", ",".join(f"{r:g}" for r in rates)], out / "fairness" / sched, plots)
            for r in res["runs"]:
                r["policy"] = f"e2 + {sched}"
            runs += res["runs"]
        md.append(f"## e. Fairness (claim 9), {w}, max_num_seqs {FAIRNESS_MAX_NUM_SEQS}\n")
        md.append("Local admission order: fcfs (vLLM), lpm (SGLang: longest cached prefix first), preble_groups. "
                  "Low-hit: requests with under half their prompt cached.\n")
        lines = ["| scheduling | req/s | TTFT mean s | TTFT p99 s | low-hit n | low-hit TTFT p99 s | low-hit TTFT max s "
                 "| hit ratio |", "|---|---|---|---|---|---|---|---|"]
        for r in sorted(runs, key=lambda r: (r["rate"], r["policy"])):
            m, lo = r["metrics"], r["metrics"]["ttft_low_hit_s"]
            lines.append(f"| {r['policy']} | {r['rate']:g} | {m['ttft_s']['mean']:.3f} | {m['ttft_s']['p99']:.3f} "
                         f"| {lo['n']} | {lo['p99']:.3f} | {lo['max']:.3f} | {m[HIT]:.3f} |")
        md.append("\n".join(lines) + "\n")
        data["fairness"] = {"workload": w, "rates": rates, "max_num_seqs": FAIRNESS_MAX_NUM_SEQS,
                            "runs": [{"policy": r["policy"], "rate": r["rate"], "metrics": r["metrics"]} for r in runs]}
        log(f"fairness: {len(runs)} runs in {time.perf_counter() - t0:.0f} s")

    # ------------------------------------------------------------------ f. skew
    if "f" in sections:
        w = ABLATION_WORKLOAD
        base = data["workloads"][w]["rates"] if w in data["workloads"] else loads_for(w, WORKLOADS[w])
        rates = [round(max(base) * f, 3) for f in SKEW_LOAD_FACTORS]
        window_s = E2Config().history_window_s
        t0 = time.perf_counter()
        runs = []
        for z in SKEW_ZIPFS:
            for rate in rates:
                k = n if args.quick else max(n, math.ceil(SKEW_SPAN_H * window_s * rate))
                res = run_sweep(["--trace", "preble-toolbench", "--zipf", f"{z:g}", *P70, *sized(k), *common,
                                 "--policies", ",".join(SKEW_POLICIES), "--rates", f"{rate:g}"],
                                out / "skew" / f"zipf{z:g}-{rate:g}", plots)
                for r in res["runs"]:
                    r["zipf"] = z
                runs += res["runs"]
        md.append("## f. Skew (claim 7), toolbench, Zipf tool popularity\n")
        md.append(f"Runs span {SKEW_SPAN_H:g} x H = {SKEW_SPAN_H * window_s:g} s of arrivals. L max/min: Preble's "
                  f"per-worker load L (Σ PREFILLTIME + DECODETIME of the requests dispatched in the last H = "
                  f"{window_s:g} s, from the engines' real cache hits and output lengths) sampled every second "
                  "once a full window has passed; p50 over the samples, and the share of samples over Th_bal = "
                  f"{E2Config().rebalance_threshold:g}. Redirects, replicas: how often E2's rules fired.\n")
        lines = ["| zipf | req/s | policy | TTFT mean s | TTFT p99 s | E2E p99 s | hit ratio | L max/min p50 "
                 "| share > Th_bal | redirects | replicas |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            m, li, c = r["metrics"], r["metrics"]["preble_load_imbalance"], r["metrics"]["policy_counters"]
            lines.append(f"| {r['zipf']:g} | {r['rate']:g} | {r['policy']} | {m['ttft_s']['mean']:.3f} "
                         f"| {m['ttft_s']['p99']:.3f} | {m['e2e_s']['p99']:.2f} | {m[HIT]:.3f} "
                         + (f"| {li['p50']:.2f} | {li['frac_over']:.2f} " if li["n"] else "| - | - ")
                         + f"| {c.get('rebalance_redirects', '-')} | {c.get('replications', '-')} |")
        md.append("\n".join(lines) + "\n")
        data["skew"] = {"workload": "preble-toolbench", "zipfs": list(SKEW_ZIPFS), "rates": rates,
                        "runs": [{"policy": r["policy"], "zipf": r["zipf"], "rate": r["rate"],
                                  "metrics": r["metrics"]} for r in runs]}
        log(f"skew: {len(runs)} runs in {time.perf_counter() - t0:.0f} s")

    # ------------------------------------------------------------------ c. no sharing
    if "c" in sections:
        t0 = time.perf_counter()
        rates = loads_for("no-sharing", NO_SHARING)
        res = run_sweep([*NO_SHARING, *sized(n), *common, "--policies", "round_robin,least_request,e2",
                         "--rates", ",".join(f"{r:g}" for r in rates)], out / "no-sharing", plots)
        md.append("## c. No sharing (claim 3): poisson, unique prompts, llama3-8b-a100\n")
        md.append("Ratios in parentheses: / round_robin at the same load.\n")
        md.append(report.markdown_table(res) + "\n" + report.outcome_line(res))
        data["no_sharing"] = {"rates": rates, "runs": [{"policy": r["policy"], "rate": r["rate"],
                                                          "metrics": r["metrics"]} for r in res["runs"]]}
        log(f"no-sharing: {len(res['runs'])} runs in {time.perf_counter() - t0:.0f} s")

    # ------------------------------------------------------------------ d. scaling
    if "d" in sections:
        t0 = time.perf_counter()
        w = SCALING_WORKLOAD
        sc_policies = ["e2", "smg_cache_aware", "round_robin"]
        caps: dict[str, dict[int, float]] = {}
        for p in sc_policies:
            for nw in (2, 4):
                c = capacity([*WORKLOADS[w], *sized(n_ladder), "--workers", str(nw), "--seed", str(args.seed),
                              "--jobs", str(args.jobs)], p, args.sat_factor, nw)
                caps.setdefault(p, {})[nw] = c["capacity_req_s"]
                data["scaling"].setdefault("capacity", []).append(c)
        r2 = caps["e2"][2]
        lat = []
        for nw, rate in ((2, r2), (4, 2 * r2)):
            res = run_sweep([*WORKLOADS[w], *sized(n), "--workers", str(nw), "--seed", str(args.seed), "--jobs",
                             str(args.jobs), "--policies", ",".join(sc_policies), "--rates", f"{rate:g}"],
                            out / "scaling" / f"{nw}-workers", plots)
            for r in res["runs"]:
                r["workers"] = nw
            lat += res["runs"]
        md.append(f"## d. Scaling (claim 13), {w}: 2 -> 4 workers\n")
        md.append("Capacity (same ladder and criterion, each policy against its own lightest rung):\n")
        md.append("| policy | 2 workers req/s | 4 workers req/s | ratio |\n|---|---|---|---|")
        for p in sc_policies:
            md.append(f"| {p} | {caps[p][2]:.2f} | {caps[p][4]:.2f} | x{caps[p][4] / caps[p][2]:.2f} |")
        md.append(f"\nLatency at e2's 2-worker capacity r = {r2:.2f} req/s on 2 workers, and 2r on 4 workers:\n")
        md.append(policy_table(lat, lambda r: f"{r['policy']} ({r['workers']}w)") + "\n")
        data["scaling"]["latency"] = [{"policy": r["policy"], "workers": r["workers"], "rate": r["rate"],
                                       "metrics": r["metrics"]} for r in lat]
        log(f"scaling: in {time.perf_counter() - t0:.0f} s")

    # ------------------------------------------------------------------ g. router replicas
    if "g" in sections:
        t0 = time.perf_counter()
        rep_policies = [p for p in policies if p in (*OURS, *PEERS)]
        if "switchyard" in rep_policies:
            rep_policies.insert(rep_policies.index("switchyard") + 1, "switchyard-no_mirror")
        for peer, mode in PEER_HA_MODES.items():
            if peer in rep_policies:
                rep_policies.insert(rep_policies.index(peer) + 1, mode)
        rep_peers = (*PEERS, *PEER_HA_MODES.values())
        md.append(f"## g. Router replicas: 1 and {REPLICAS} side by side\n")
        md.append(f"Each workload at its highest load; {REPLICAS} replicas take the arrivals in turn. Per policy: "
                  f"its {REPLICAS}-replica figure / its own 1-router figure; the last columns compare ours with the best "
                  f"peer, both at {REPLICAS} replicas (< 1 = ours better), its modes for replicas included "
                  f"({', '.join(PEER_HA_MODES.values())}). switchyard-no_mirror: the "
                  "default policy without the other replicas' requests (`mirror_peers=false`).\n")
        lines = ["| workload | req/s | policy | TTFT mean s (1 -> K) | TTFT p99 s (1 -> K) | hit ratio (1 -> K) "
                 "| K / 1 TTFT mean | K / 1 TTFT p99 |", "|---|---|---|---|---|---|---|---|"]
        vs_lines = ["| workload | ours | TTFT mean | TTFT p99 | warm TTFT p99 | our hit | best peer hit |",
                    "|---|---|---|---|---|---|---|"]
        for w in names:
            base = data["workloads"][w]["rates"] if w in data["workloads"] else loads_for(w, WORKLOADS[w])
            rate = max(base)
            res = run_sweep([*WORKLOADS[w], *sized(n), *common, "--policies", ",".join(rep_policies),
                             "--rates", f"{rate:g}", "--router-replicas", f"1,{REPLICAS}"], out / "replicas" / w, plots)
            by = {(r["policy"], r.get("router_replicas", 1)): r for r in res["runs"]}
            for p in rep_policies:
                one, k = by[(p, 1)], by[(p, REPLICAS)]
                lines.append(
                    f"| {w} | {rate:g} | {p} | {_m(one, 'ttft_s', 'mean'):.3f} -> {_m(k, 'ttft_s', 'mean'):.3f} "
                    f"| {_m(one, 'ttft_s', 'p99'):.3f} -> {_m(k, 'ttft_s', 'p99'):.3f} "
                    f"| {_m(one, HIT):.3f} -> {_m(k, HIT):.3f} "
                    f"| x{_m(k, 'ttft_s', 'mean') / _m(one, 'ttft_s', 'mean'):.2f} "
                    f"| x{_m(k, 'ttft_s', 'p99') / _m(one, 'ttft_s', 'p99'):.2f} |")
            at_k = [r for r in res["runs"] if r.get("router_replicas", 1) == REPLICAS]
            for ours in (o for o in OURS if o in rep_policies):
                cmp = ours_vs_peers(at_k, ours, rep_peers)
                if "hit ratio" in cmp:
                    vs_lines.append(
                        f"| {w} | {ours} | x{cmp['TTFT mean']['ratio']:.2f} | x{cmp['TTFT p99']['ratio']:.2f} "
                        f"| x{cmp['warm TTFT p99']['ratio']:.2f} | {cmp['hit ratio']['ours']:.3f} "
                        f"| {cmp['hit ratio']['best_peer_value']:.3f} ({cmp['hit ratio']['best_peer']}) |")
            data.setdefault("replicas", {})[w] = {
                "rate": rate, "replicas": REPLICAS,
                "runs": [{"policy": r["policy"], "router_replicas": r.get("router_replicas", 1), "rate": r["rate"],
                          "metrics": r["metrics"]} for r in res["runs"]]}
        md.extend(["\n".join(lines), "", f"Ours / the best peer, all at {REPLICAS} replicas:\n", "\n".join(vs_lines), ""])
        log(f"replicas: in {time.perf_counter() - t0:.0f} s")

    # ------------------------------------------------------------------ capacity appendix + write
    cap_lines = [f"## Capacity ladders ({cap_policy} unless noted)\n",
                 "| workload | capacity req/s | light TTFT s | rungs (rate: mean TTFT s, * = saturated) |",
                 "|---|---|---|---|"]
    for k, c in data["capacity"].items():
        if "fixed_rates" in c:
            cap_lines.append(f"| {k} | fixed --rates {c['fixed_rates']} | - | - |")
            continue
        rungs = ", ".join(f"{p['rate']:.3g}: {p['ttft_mean_s']:.2f}{'*' if p['saturated'] else ''}"
                          for p in c["ladder"])
        cap_lines.append(f"| {k} | {capacity_text(c)} | {c['light_ttft_s']:.3f} | {rungs} |")
    total = time.perf_counter() - t_start
    data["wall_s"] = total
    head = [f"# Switchyard simulator suite{' (quick)' if args.quick else ''}\n",
            f"Generated by `switchyard bench suite{' --quick' if args.quick else ''}` in {total:.0f} s "
            f"(--jobs {args.jobs}). Per-sweep JSON/markdown/PNGs in the subfolders.\n"]
    text = "\n".join([*head, *md, *cap_lines]) + "\n"
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps(data, indent=2, default=float) + "\n")
    print(text)
    print(f"wrote {out / 'summary.md'} and {out / 'summary.json'} ({total:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
