"""`switchyard bench routing`: PreServe RQ3 (specs/preserve.md §8.5, claims 17, 18, 21) in the simulator.

ShareGPT prompts from the 30% test split with their real output lengths (bench/sharegpt_workload.py), Poisson
arrivals at increasing rates, 4 simulated workers, once per engine profile (llama3-8b-a100 stands in for the
paper's LLaMA-2-7B, llama2-70b-h100-tp4 for LLaMA-2-13B: shared/data has no 7B/13B tables). Every policy runs on
the same requests; the anticipation policies (preserve, switchyard) once per length predictor:

  trained   the exported ONNX predictor, run once offline over the prompt texts (1 thread, batched); the table
            is cached under <out>/predictions/. Missing predictor: the mode is skipped, and the report says so.
  fallback  router/predictor/fallback.py, predicting at arrival and learning at each finish, as the daemon does
  oracle    the true output length (the upper bound)
  none      no prediction (the policy's own fallback)

Baselines (round_robin, least_request, min_usage, smg_least_load) never read a prediction: they run once per
rate and stand beside every predictor.

KV capacity (`--kv`): "paper" (default) gives each worker the KV slots of PreServe's testbed, computed like the
profiles' own (profiles.kv_capacity_tokens: 90% of GPU memory, minus weights and a 2 GiB reserve per GPU):
LLaMA-2-7B on one A40-48GB = 58,666 tokens for the small profile, LLaMA-2-13B TP2 on two A40s = 76,216 for the
large one (spec §9 estimates 40-55K and 60-75K). The iteration times stay the fitted profiles'. "profile" keeps
the profiles' own capacity (1.0M and 496K tokens: ShareGPT never fills it, so no request is ever preempted and
the memory term cannot matter); an integer sets the tokens.

Rates: a saturation probe per profile (least_request offered 1.5x an upper bound on the fleet's decode rate, a
small router queue, `--probe-duration` 120 s) measures the output tokens decoded per second over the second half
of its arrivals; / the mean output length = the fleet's capacity in req/s. The sweep is `--load-fractions`
(0.5, 0.7, 0.8, 0.9, 1.0) x capacity: the small profile's SLO knee sits near 0.75x (latency grows with the batch
before the KV fills), the large one's near 0.95x (KV-bound). `--rates` skips the probe.

Metrics per (profile, policy, predictor, rate): mean/p99 TTFT, mean/p99 normalized latency (E2E / output
tokens), SLO attainment, preemptions, throughput. SLO: normalized latency <= 3x the request's own isolated value,
measured by running that request alone through the same engine and profile (per request, not the paper's one
0.2 s: a 5-token answer after a 2k-token prompt has an isolated normalized latency many times a 500-token
answer's, so one threshold would fail some requests at zero load and never bind for others). The one-value
variant (3x the median isolated value, the paper's form) is reported beside it.

Goal (issue #4): at the highest rate where the best baseline still attains >= 85% SLO, the p99 normalized
latency of preserve (and switchyard) >= 50% below that baseline's (the baseline with the lowest p99 among those
attaining 85% there).

Full: `switchyard bench routing` (2 profiles x 5 rates x 10 policy/predictor pairs = 100 runs of 300 s of
arrivals; measured 34 min on 2 cores shared with other jobs, without the trained mode: 80 runs). The paper's
10 minutes: `--duration 600` (about twice that). Quick smoke (~1-1.5 min): `switchyard bench routing --quick`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench import sim
from switchyard.bench.metrics import OK, dist, norm_latency_slo, summarize
from switchyard.bench.sharegpt_workload import (
    DEFAULT_MAX_MODEL_LEN,
    ShareGPTWorkload,
    TokenizedPrompts,
    eligible,
    load_test_samples,
    make_sharegpt_workload,
    sample_keys,
)
from switchyard.router.policies.registry import POLICIES
from switchyard.workers.engine.perf_model import ModelSpec
from switchyard.workers.engine.profiles import get_profile, kv_capacity_tokens

BASELINES = ("round_robin", "least_request", "min_usage", "smg_least_load")
# policies that read RoutingContext.predicted_output_tokens (and switchyard's ablations, switchyard-no_*)
PREDICTIVE = ("preserve", "switchyard")
PREDICTORS = ("trained", "fallback", "oracle", "none")
PROFILES = ("llama3-8b-a100", "llama2-70b-h100-tp4")
SLO_FACTOR = 3.0  # normalized-latency SLO = 3x the isolated value (PreServe, after Splitwise)
GOAL_ATTAINMENT = 0.85
GOAL_REDUCTION = 0.5
BLOCK_SIZE = 16

# PreServe's testbed (spec §8.1): LLaMA-2-7B on one A40 and LLaMA-2-13B TP2 on two (48 GB each, §8.7)
LLAMA2_7B = ModelSpec(
    "Llama-2-7B", num_layers=32, num_q_heads=32, num_kv_heads=32, head_dim=128, num_params=6.74e9
)
LLAMA2_13B = ModelSpec(
    "Llama-2-13B", num_layers=40, num_q_heads=40, num_kv_heads=40, head_dim=128, num_params=13.02e9
)
PAPER_KV_TOKENS = {
    "llama3-8b-a100": kv_capacity_tokens(LLAMA2_7B, num_gpus=1, gpu_mem_gib=48.0),  # 58,666
    "llama2-70b-h100-tp4": kv_capacity_tokens(LLAMA2_13B, num_gpus=2, gpu_mem_gib=48.0),  # 76,216
}


def is_predictive(policy: str) -> bool:
    """preserve, switchyard and its ablations (switchyard-no_*) read the prediction; the baselines do not."""
    return policy in PREDICTIVE or policy.startswith("switchyard-")


# ---------------------------------------------------------------------------------------------------- set-up
@dataclass(frozen=True, slots=True)
class FleetSetup:
    """One profile's fleet as every run of it sees it."""

    profile: str
    workers: int
    kv_tokens: int
    kv_source: str  # "paper" | "profile" | "fixed"
    use_queue: bool

    def engine_overrides(self) -> dict[str, Any]:
        return {"num_kv_blocks": self.kv_tokens // BLOCK_SIZE + 1}  # + vLLM's null block

    def sim_config(self, policy: str, predictor: str, seed: int, **kw: Any) -> sim.SimConfig:
        return sim.SimConfig(
            policy=policy,
            num_workers=self.workers,
            profile=self.profile,
            block_size=BLOCK_SIZE,
            use_queue=self.use_queue,
            seed=seed,
            engine_overrides=self.engine_overrides(),
            predictor=predictor,
            **kw,
        )


def kv_tokens_for(profile: str, kv: str) -> tuple[int, str]:
    if kv == "paper":
        if profile not in PAPER_KV_TOKENS:
            raise ValueError(f"no PreServe KV size for profile {profile!r}; use --kv profile or --kv TOKENS")
        return PAPER_KV_TOKENS[profile], "paper"
    if kv == "profile":
        return get_profile(profile).kv_capacity_tokens, "profile"
    return int(kv), "fixed"


def parse_policies(spec: str) -> list[str]:
    names = [p.strip() for p in spec.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policies {unknown or spec!r}; known: {', '.join(sorted(POLICIES))}")
    return names


def parse_rates(spec: str | None, profiles: Sequence[str]) -> dict[str, list[float]]:
    """`R1,R2` for every profile, or `PROFILE=R1,R2` items separated by spaces/semicolons. A key that is not one
    of `profiles` is a ValueError (`a=1,b=2` reads as profile `a=1,b`: without the check the run would quietly
    fall back to the capacity probe)."""
    if not spec:
        return {}
    out: dict[str, list[float]] = {}
    for item in spec.replace(";", " ").split():
        key, sep, vals = item.rpartition("=")
        if sep and key not in profiles:
            raise ValueError(f"--rates: {key!r} is not one of the profiles {', '.join(profiles)} "
                             "(separate PROFILE=R1,R2 items with ';' or spaces)")
        rates = [float(v) for v in vals.split(",") if v]
        for p in [key] if sep else profiles:
            out[p] = rates
    return out


# ---------------------------------------------------------------------------------------------------- isolated SLO
def isolated_latencies(
    fleet: FleetSetup, lengths: set[tuple[int, int]]
) -> dict[tuple[int, int], tuple[float, float]]:
    """(prompt, output tokens) -> (TTFT, E2E) of that request alone on one engine of the fleet, in seconds.

    The timing depends only on the two lengths when nothing is cached, so each pair runs once (the prefix
    cache is reset between runs). First-token time as the simulator records it.
    """
    core = sim.make_engine(fleet.profile, BLOCK_SIZE, fleet.engine_overrides())
    from switchyard.workers.engine.types import EngineRequest

    out: dict[tuple[int, int], tuple[float, float]] = {}
    for i, (p, o) in enumerate(sorted(lengths)):
        core.add_request(
            EngineRequest(f"iso{i}", tuple(3 + (k % 31000) for k in range(p)), o, 0.0, target_output_tokens=o)
        )
        now, first = 0.0, -1.0
        while core.has_unfinished():
            res = core.step(now, horizon_s=math.inf)
            end = res.start_s + res.duration_s
            if first < 0 and any(r.new_token_ids for r in res.outputs):
                first = end if res.num_iterations == 1 else res.start_s + res.duration_s / res.num_iterations
            now = end
        core.reset_prefix_cache()
        out[(p, o)] = (first, now)
    return out


def slo_table(
    workload: ShareGPTWorkload, iso: dict[tuple[int, int], tuple[float, float]]
) -> dict[str, float]:
    """request id -> its SLO on normalized latency, s/token (3x isolated)."""
    return {
        r.request_id: SLO_FACTOR * iso[(r.num_prompt_tokens, r.num_output_tokens)][1] / r.num_output_tokens
        for r in workload.trace.requests
    }


# ---------------------------------------------------------------------------------------------------- capacity
def decode_upper_bound(fleet: FleetSetup, pool: Sequence[Any]) -> float:
    """req/s the fleet could at most finish: full batches (max_num_seqs, or as many as the KV holds at mean
    context) decoding at the profile's iteration time, over the mean output length."""
    prof = get_profile(fleet.profile)
    mean_p = float(np.mean([s.prompt_tokens for s in pool]))
    mean_o = float(np.mean([s.output_tokens for s in pool]))
    ctx = mean_p + mean_o / 2
    batch = max(1, min(256, int(fleet.kv_tokens / ctx)))
    t = prof.iteration_time_s(0, 0, batch, int(batch * ctx))
    return fleet.workers * batch / t / mean_o


def capacity_probe(
    fleet: FleetSetup, pool: Sequence[Any], token_ids: dict, duration_s: float, seed: int
) -> dict:
    """least_request offered 1.5x the decode upper bound; capacity = the output tokens decoded over the second
    half of the arrivals / the pool's mean output length, in req/s.

    Tokens, not completions: a request lives tens of seconds at saturation, so completions in a short window
    still count the ramp-up. Each request's tokens are spread evenly over [first token, finish].
    """
    offered = 1.5 * decode_upper_bound(fleet, pool)
    wl = make_sharegpt_workload(pool, offered, duration_s, seed, token_ids=token_ids)
    prompts = TokenizedPrompts([wl], BLOCK_SIZE)
    cfg = fleet.sim_config("least_request", "none", seed, queue_max_size=64)  # a small queue: a short drain
    res = sim.Simulator(wl.trace, cfg, prompts).run()
    t0, t1 = duration_s / 2, duration_s
    tokens = 0.0
    for r in res.records:
        if r.status != OK or r.num_output_tokens <= 1 or r.finish_s <= r.first_token_s:
            continue
        overlap = max(0.0, min(t1, r.finish_s) - max(t0, r.first_token_s))
        tokens += (r.num_output_tokens - 1) * overlap / (r.finish_s - r.first_token_s)
    mean_o = float(np.mean([s.output_tokens for s in pool]))
    return {
        "policy": "least_request",
        "offered_req_s": offered,
        "duration_s": duration_s,
        "decode_tok_s": tokens / (t1 - t0),
        "capacity_req_s": tokens / (t1 - t0) / mean_o,
        "num_preemptions": sum(s.num_preemptions for s in res.engine_stats),
        "wall_s": res.wall_s,
    }


# ---------------------------------------------------------------------------------------------------- predictions
def trained_predictions(
    name: str, pool: Sequence[Any], keys: Sequence[str], cache_dir: Path, batch: int = 32
) -> tuple[dict[str, int] | None, dict[str, Any]]:
    """Sample key -> the trained predictor's output tokens, from the cache or one batched 1-thread pass.

    Returns (None, info with a "skipped" reason) when no exported predictor exists: never a substitute.
    """
    from switchyard.router.predictor.paths import predictor_path

    path = predictor_path(name)
    if not (path / "model.onnx").is_file():
        return None, {
            "skipped": f"no trained predictor at {path} (run `switchyard predictor train` and export)"
        }
    meta = json.loads((path / "predictor.json").read_text())
    digest = hashlib.sha256("\n".join(keys).encode()).hexdigest()[:16]
    ident = {"predictor": meta.get("name", name), "created": meta.get("created"), "samples": digest}
    cache = cache_dir / f"{meta.get('name', name)}.json"
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data.get("ident") == ident:
            return data["predictions"], {
                **ident,
                "path": str(path),
                "cache": str(cache),
                "cached": True,
                **data.get("stats", {}),
            }
    from switchyard.router.predictor.onnx_predictor import OnnxLengthPredictor

    pred = OnnxLengthPredictor(path, threads=1)
    texts = [s.prompt for s in pool]
    t0 = time.perf_counter()
    values = np.concatenate([pred.predict(texts[i : i + batch]) for i in range(0, len(texts), batch)])
    seconds = time.perf_counter() - t0
    truth = np.array([s.output_tokens for s in pool], dtype=np.float64)
    err = np.abs(values.astype(np.float64) - truth)
    stats = {
        "num_samples": len(texts),
        "seconds": seconds,
        "providers": pred.providers,
        "mae_tokens": float(err.mean()),
        "acc50": float((err <= 50).mean()),
    }
    table = {k: int(v) for k, v in zip(keys, values.tolist(), strict=True)}
    cache_dir.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"ident": ident, "stats": stats, "predictions": table}) + "\n")
    return table, {**ident, "path": str(path), "cache": str(cache), "cached": False, **stats}


# ---------------------------------------------------------------------------------------------------- runs
# Set up in the parent before the runs fork (sim.parallel_map): workloads, prompts, SLOs and prediction tables.
_STATE: dict[str, Any] = {}


def run_one(profile: str, rate: float, policy: str, predictor: str) -> dict[str, Any]:
    """One simulation -> its report row (module-level, so a forked pool can call it)."""
    st = _STATE
    fleet: FleetSetup = st["fleets"][profile]
    wl: ShareGPTWorkload = st["workloads"][(profile, rate)]
    table = None
    mode = predictor
    if predictor == "trained":
        table, mode = wl.per_request(st["trained"]), "table"
    cfg = fleet.sim_config(policy, mode, st["seed"], policy_params=st["params"].get(policy, {}))
    res = sim.Simulator(wl.trace, cfg, st["prompts"], predictions=table).run()
    m = summarize(
        res.records,
        res.worker_ids,
        sum(s.prefix_cache_queries for s in res.engine_stats),
        sum(s.prefix_cache_hits for s in res.engine_stats),
        sum(s.num_preemptions for s in res.engine_stats),
        math.inf,
        math.inf,
    )
    slo = st["slo"][profile]
    row = {
        "profile": profile,
        "rate": rate,
        "policy": policy,
        "predictor": predictor if is_predictive(policy) else "-",
        "num_requests": m["num_requests"],
        "num_completed": m["num_completed"],
        "ttft_s": m["ttft_s"],
        "norm_latency_s_per_token": m["norm_latency_s_per_token"],
        "e2e_s": m["e2e_s"],
        "slo": norm_latency_slo(res.records, slo),
        "slo_one_value": norm_latency_slo(res.records, st["slo_median"][profile]),
        "num_preemptions": m["num_preemptions"],
        "num_held": m["num_held"],
        "throughput_req_s": m["throughput_req_s"],
        "throughput_output_tok_s": m["throughput_output_tok_s"],
        "prefix_cache_hit_ratio": m["prefix_cache_hit_ratio"],
        "balance_max_over_mean": m["balance_max_over_mean"],
        "wall_s": res.wall_s,
        "simulated_s": res.sim_end_s,
    }
    print(
        f"  {profile:<20} {rate:7.2f} req/s  {policy:<15} {row['predictor']:<9} SLO {row['slo']['attainment']:.3f}  "
        f"p99 norm {1000 * row['norm_latency_s_per_token']['p99']:8.1f} ms  ({res.wall_s:5.1f} s wall)",
        flush=True,
    )
    return row


# ---------------------------------------------------------------------------------------------------- summary
def _p99n(row: dict[str, Any]) -> float:
    return float(row["norm_latency_s_per_token"]["p99"])


def goal_summary(
    rows: list[dict[str, Any]], profiles: Sequence[str], policies: Sequence[str], predictors: Sequence[str]
) -> list[dict[str, Any]]:
    """Per profile x anticipation policy x predictor: the issue's goal figure (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for prof in profiles:
        base = [r for r in rows if r["profile"] == prof and r["policy"] in BASELINES]
        ok = [r for r in base if r["slo"]["attainment"] >= GOAL_ATTAINMENT]
        if not ok:
            for pol in (p for p in policies if is_predictive(p)):
                for pred in predictors:
                    out.append(
                        {
                            "profile": prof,
                            "policy": pol,
                            "predictor": pred,
                            "rate": None,
                            "note": f"no baseline attains {GOAL_ATTAINMENT:.0%} SLO at any rate",
                        }
                    )
            continue
        rate = max(r["rate"] for r in ok)
        ref = min((r for r in ok if r["rate"] == rate), key=_p99n)
        for pol in (p for p in policies if is_predictive(p)):
            for pred in predictors:
                mine = next(
                    (
                        r
                        for r in rows
                        if r["profile"] == prof
                        and r["rate"] == rate
                        and r["policy"] == pol
                        and r["predictor"] == pred
                    ),
                    None,
                )
                if mine is None:
                    continue
                red = 1 - _p99n(mine) / _p99n(ref) if _p99n(ref) > 0 else float("nan")
                viol_b, viol_m = 1 - ref["slo"]["attainment"], 1 - mine["slo"]["attainment"]
                out.append(
                    {
                        "profile": prof,
                        "policy": pol,
                        "predictor": pred,
                        "rate": rate,
                        "baseline": ref["policy"],
                        "baseline_p99_norm_s": _p99n(ref),
                        "p99_norm_s": _p99n(mine),
                        "p99_norm_reduction": red,
                        "baseline_slo": ref["slo"]["attainment"],
                        "slo": mine["slo"]["attainment"],
                        "violation_reduction": 1 - viol_m / viol_b if viol_b > 0 else float("nan"),
                        "baseline_ttft_mean_s": ref["ttft_s"]["mean"],
                        "ttft_mean_s": mine["ttft_s"]["mean"],
                        "goal_met": bool(red >= GOAL_REDUCTION),
                    }
                )
    return out


def _label(r: dict[str, Any]) -> str:
    return r["policy"] if r["predictor"] == "-" else f"{r['policy']} [{r['predictor']}]"


def markdown(data: dict[str, Any]) -> str:
    lines: list[str] = []
    for prof in data["config"]["profiles"]:
        f = data["fleets"][prof]
        cap = data["capacity"].get(prof, {})
        lines.append(
            f"### {prof}: {f['workers']} workers, KV {f['kv_tokens']:,} tokens ({f['kv_source']})"
            + (f", capacity {cap['capacity_req_s']:.2f} req/s" if "capacity_req_s" in cap else "")
            + "\n"
        )
        lines.append(
            f"SLO: normalized latency <= {SLO_FACTOR:g}x the request's isolated value (median isolated "
            f"{1000 * data['isolated'][prof]['median_norm_s']:.1f} ms/token; the one-value column uses "
            f"{SLO_FACTOR:g}x that median).\n"
        )
        head = [
            "policy",
            "req/s",
            "done",
            "TTFT mean s",
            "TTFT p99 s",
            "norm mean ms",
            "norm p99 ms",
            "SLO att.",
            "SLO att. (1 value)",
            "preempt",
            "out tok/s",
        ]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        rows = sorted((r for r in data["runs"] if r["profile"] == prof), key=lambda r: (r["rate"], _label(r)))
        for r in rows:
            n = r["norm_latency_s_per_token"]
            lines.append(
                f"| {_label(r)} | {r['rate']:.2f} | {r['num_completed']}/{r['num_requests']} "
                f"| {r['ttft_s']['mean']:.3f} | {r['ttft_s']['p99']:.3f} | {1000 * n['mean']:.1f} "
                f"| {1000 * n['p99']:.1f} | {r['slo']['attainment']:.3f} | {r['slo_one_value']['attainment']:.3f} "
                f"| {r['num_preemptions']} | {r['throughput_output_tok_s']:.0f} |"
            )
        lines.append("")
    lines.append(
        f"### Goal: p99 normalized latency at the highest rate where the best baseline attains >= "
        f"{GOAL_ATTAINMENT:.0%} SLO (goal: >= {GOAL_REDUCTION:.0%} lower; PreServe: -45.8% to -59.1%)\n"
    )
    lines += [
        "| profile | policy [predictor] | req/s | baseline | baseline p99 ms | p99 ms | p99 reduction "
        "| SLO att. baseline -> policy | SLO violations | TTFT mean s baseline -> policy | goal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for g in data["goal"]:
        if g.get("rate") is None:
            lines.append(
                f"| {g['profile']} | {g['policy']} [{g['predictor']}] | - | {g['note']} | | | | | | | |"
            )
            continue
        lines.append(
            f"| {g['profile']} | {g['policy']} [{g['predictor']}] | {g['rate']:.2f} | {g['baseline']} "
            f"| {1000 * g['baseline_p99_norm_s']:.1f} | {1000 * g['p99_norm_s']:.1f} | {-100 * g['p99_norm_reduction']:+.1f}% "
            f"| {g['baseline_slo']:.3f} -> {g['slo']:.3f} "
            f"| {100 * (1 - g['baseline_slo']):.1f}% -> {100 * (1 - g['slo']):.1f}% "
            f"| {g['baseline_ttft_mean_s']:.3f} -> {g['ttft_mean_s']:.3f} | {'met' if g['goal_met'] else 'not met'} |"
        )
    for pred, info in data["predictors"].items():
        if "skipped" in info:
            lines.append(f"\nPredictor '{pred}' skipped: {info['skipped']}")
        elif pred == "trained":
            lines.append(
                f"\nPredictor 'trained': {info['predictor']} ({info['path']}), MAE {info.get('mae_tokens', 0):.1f}"
                f" tokens, Acc-50 {info.get('acc50', 0):.3f} over {info.get('num_samples', 0)} test prompts"
            )
    return "\n".join(lines) + "\n"


PLOTS = (
    ("ttft_mean", "mean TTFT (s)", lambda r: r["ttft_s"]["mean"]),
    ("norm_p99", "p99 normalized latency (ms/token)", lambda r: 1000 * r["norm_latency_s_per_token"]["p99"]),
    ("slo", "SLO attainment", lambda r: r["slo"]["attainment"]),
)
_STYLE = {"-": "-", "trained": "--", "fallback": ":", "oracle": "-.", "none": (0, (1, 3))}


def plot(data: dict[str, Any], out: Path) -> list[Path]:
    """One PNG per metric, one panel per profile, one line per policy [predictor] over the rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profiles = data["config"]["profiles"]
    paths = []
    for key, ylabel, get in PLOTS:
        fig, axes = plt.subplots(1, len(profiles), figsize=(6 * len(profiles), 4.2), squeeze=False)
        for ax, prof in zip(axes[0], profiles, strict=True):
            series: dict[str, list[dict[str, Any]]] = {}
            for r in data["runs"]:
                if r["profile"] == prof:
                    series.setdefault(_label(r), []).append(r)
            for label, rs in series.items():
                rs.sort(key=lambda r: r["rate"])
                ax.plot(
                    [r["rate"] for r in rs],
                    [get(r) for r in rs],
                    marker="o",
                    ms=3,
                    linestyle=_STYLE.get(rs[0]["predictor"], "-"),
                    label=label,
                )
            if key == "slo":
                ax.axhline(GOAL_ATTAINMENT, color="grey", lw=0.8)
            elif key != "slo":
                ax.set_yscale("log")
            ax.set_title(f"{prof} ({data['fleets'][prof]['workers']} workers)")
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{key}_vs_rate.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard bench routing", description=__doc__.split("\n\n")[0])
    p.add_argument("--profiles", default=",".join(PROFILES))
    p.add_argument("--workers", type=int, default=4)
    default_policies = ["preserve", *BASELINES] + (["switchyard"] if "switchyard" in POLICIES else [])
    p.add_argument(
        "--policies",
        default=",".join(default_policies),
        help=f"comma-separated; the baselines are {', '.join(BASELINES)}",
    )
    p.add_argument(
        "--param", action="append", default=[], metavar="POLICY.KEY=VALUE",
        help="set one knob of one policy of --policies, e.g. switchyard.externality_weight=1",
    )
    p.add_argument(
        "--predictors",
        default="trained,fallback,oracle",
        help=f"for {', '.join(PREDICTIVE)}: {', '.join(PREDICTORS)}",
    )
    p.add_argument(
        "--predictor-name", default=None, help="trained predictor name or path (default: the router's)"
    )
    p.add_argument(
        "--rates",
        default=None,
        help="R1,R2,... req/s for every profile, or PROFILE=R1,R2 items; skips the capacity probe",
    )
    p.add_argument(
        "--load-fractions", default="0.5,0.7,0.8,0.9,1.0", help="rates as fractions of the capacity"
    )
    p.add_argument(
        "--duration", type=float, default=300.0, help="virtual seconds of arrivals per run (the paper: 600)"
    )
    p.add_argument(
        "--probe-duration", type=float, default=120.0, help="virtual seconds of the capacity probe"
    )
    p.add_argument("--kv", default="paper", help="KV tokens per worker: paper | profile | TOKENS")
    p.add_argument(
        "--no-queue",
        action="store_true",
        help="route at arrival (PreServe); default: the daemon's "
        "router queue holds requests while every worker is saturated",
    )
    p.add_argument(
        "--samples",
        type=Path,
        default=None,
        help="JSONL of LengthSample rows instead of the ShareGPT test split (tests)",
    )
    p.add_argument("--split-seed", type=int, default=0)
    p.add_argument("--seed", type=int, default=0, help="arrivals and sample order")
    p.add_argument("--jobs", type=int, default=2, help="simulations in parallel (forked processes)")
    p.add_argument(
        "--quick", action="store_true", help="30 s runs and probe, load fractions 0.8 and 1 (~1 min)"
    )
    p.add_argument("--out", type=Path, default=Path("results/routing"))
    p.add_argument("--no-plots", action="store_true")
    return p


def load_samples(args: argparse.Namespace) -> list[Any]:
    if args.samples is None:
        return load_test_samples(args.split_seed)
    from switchyard.router.predictor.data import LengthSample

    return [
        LengthSample(**json.loads(line)) for line in args.samples.read_text().splitlines() if line.strip()
    ]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick:
        args.duration = min(args.duration, 30.0)
        args.probe_duration = min(args.probe_duration, 30.0)
        if args.load_fractions == build_parser().get_default("load_fractions"):
            args.load_fractions = "0.8,1.0"
    try:
        profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
        for prof in profiles:
            get_profile(prof)
        policies = parse_policies(args.policies)
        params = sim.parse_params(args.param, policies)
        predictors = [p.strip() for p in args.predictors.split(",") if p.strip()]
        bad = [p for p in predictors if p not in PREDICTORS]
        if bad:
            raise ValueError(f"unknown predictors {bad}; known: {', '.join(PREDICTORS)}")
        fixed_rates = parse_rates(args.rates, profiles)
        fleets = {
            p: FleetSetup(p, args.workers, *kv_tokens_for(p, args.kv), not args.no_queue) for p in profiles
        }
    except ValueError as e:
        print(f"bench routing: {e}", file=sys.stderr)
        return 2
    t_start = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.0f} s] {msg}", flush=True)

    samples = load_samples(args)
    pool = eligible(samples, DEFAULT_MAX_MODEL_LEN)
    keys = sample_keys(pool)
    log(f"{len(samples)} test samples, {len(pool)} with prompt + output <= {DEFAULT_MAX_MODEL_LEN} tokens")

    # predictions: the trained table once for every sample (skipped, with the reason, when there is no model)
    pred_info: dict[str, dict[str, Any]] = {}
    if "trained" in predictors and any(is_predictive(p) for p in policies):
        from switchyard.router.predictor.paths import DEFAULT_PREDICTOR

        table, info = trained_predictions(
            args.predictor_name or DEFAULT_PREDICTOR, pool, keys, args.out / "predictions"
        )
        pred_info["trained"] = info
        if table is None:
            log(f"predictor 'trained' skipped: {info['skipped']}")
            predictors.remove("trained")
        else:
            _STATE["trained"] = table
            how = "cached" if info["cached"] else f"{info['seconds']:.1f} s"
            log(
                f"predictor 'trained': {info['predictor']}, MAE {info.get('mae_tokens', float('nan')):.1f} tokens "
                f"({how})"
            )

    # tokenize the pool once; every workload of every profile shares it
    from switchyard.workers.tokenizer import load_tokenizer

    tok = load_tokenizer()
    token_ids = {k: tuple(tok.encode(s.prompt)) for k, s in zip(keys, pool, strict=True)}

    capacity: dict[str, Any] = {}
    rates: dict[str, list[float]] = {}
    for prof in profiles:
        if prof in fixed_rates:
            rates[prof] = fixed_rates[prof]
            capacity[prof] = {"fixed_rates": rates[prof]}
            continue
        cap = capacity_probe(fleets[prof], pool, token_ids, args.probe_duration, args.seed)
        capacity[prof] = cap
        fracs = [float(x) for x in args.load_fractions.split(",") if x]
        rates[prof] = [round(f * cap["capacity_req_s"], 2) for f in fracs]
        log(
            f"{prof}: capacity {cap['capacity_req_s']:.2f} req/s (offered {cap['offered_req_s']:.1f}, "
            f"{cap['wall_s']:.0f} s wall) -> rates {rates[prof]}"
        )

    workloads = {
        (p, r): make_sharegpt_workload(pool, r, args.duration, args.seed, token_ids=token_ids)
        for p in profiles
        for r in rates[p]
    }
    isolated: dict[str, Any] = {}
    _STATE.update(
        fleets=fleets,
        workloads=workloads,
        seed=args.seed,
        params=params,
        slo={},
        slo_median={},
        prompts=TokenizedPrompts(list(workloads.values()), BLOCK_SIZE),
    )
    for prof in profiles:
        lengths = {
            (r.num_prompt_tokens, r.num_output_tokens)
            for (p, _), wl in workloads.items()
            if p == prof
            for r in wl.trace.requests
        }
        iso = isolated_latencies(fleets[prof], lengths)
        norms = [e2e / o for (_, o), (_, e2e) in iso.items()]
        med = float(np.median(norms))
        _STATE["slo"][prof] = {
            rid: s for (p, _), wl in workloads.items() if p == prof for rid, s in slo_table(wl, iso).items()
        }
        _STATE["slo_median"][prof] = SLO_FACTOR * med
        isolated[prof] = {
            "num_length_pairs": len(iso),
            "median_norm_s": med,
            "norm_s": dist(norms),
            "ttft_s": dist([t for t, _ in iso.values()]),
        }
        log(
            f"{prof}: isolated normalized latency median {1000 * med:.1f} ms/token over {len(iso)} length pairs"
        )

    calls = []
    for prof in profiles:
        for rate in rates[prof]:
            for pol in policies:
                for pred in predictors if is_predictive(pol) else ["none"]:
                    calls.append((prof, rate, pol, pred))
    calls.sort(key=lambda c: -c[1])  # longest (highest rate) first: better packing on the pool
    log(f"{len(calls)} runs on {args.jobs} processes, {args.duration:g} s of arrivals each")
    runs = sim.parallel_map(run_one, calls, args.jobs)
    runs.sort(key=lambda r: (profiles.index(r["profile"]), r["rate"], _label(r)))

    for pred in predictors:
        pred_info.setdefault(pred, {"mode": pred})
    data: dict[str, Any] = {
        "config": {
            "profiles": profiles,
            "policies": policies,
            "policy_params": params,
            "predictors": predictors,
            "workers": args.workers,
            "duration_s": args.duration,
            "seed": args.seed,
            "split_seed": args.split_seed,
            "kv": args.kv,
            "use_queue": not args.no_queue,
            "slo_factor": SLO_FACTOR,
            "load_fractions": args.load_fractions,
            "quick": args.quick,
            "samples": str(args.samples) if args.samples else "sharegpt test split",
        },
        "workload": {
            "num_samples": len(samples),
            "num_eligible": len(pool),
            "max_model_len": DEFAULT_MAX_MODEL_LEN,
            "requests": {f"{p}@{r:g}": len(wl.trace.requests) for (p, r), wl in workloads.items()},
            "prompt_tokens": dist([s.prompt_tokens for s in pool]),
            "output_tokens": dist([s.output_tokens for s in pool]),
        },
        "fleets": {
            p: {"workers": f.workers, "kv_tokens": f.kv_tokens, "kv_source": f.kv_source}
            for p, f in fleets.items()
        },
        "capacity": capacity,
        "isolated": isolated,
        "predictors": pred_info,
        "runs": runs,
    }
    data["goal"] = goal_summary(runs, profiles, policies, predictors)
    data["wall_s"] = time.perf_counter() - t_start
    args.out.mkdir(parents=True, exist_ok=True)
    text = f"# PreServe RQ3 routing benchmark{' (quick)' if args.quick else ''}\n\n" + markdown(data)
    (args.out / "results.json").write_text(json.dumps(data, indent=2, default=float) + "\n")
    (args.out / "results.md").write_text(text)
    paths = [args.out / "results.json", args.out / "results.md"]
    if not args.no_plots:
        paths += plot(data, args.out)
    print()
    print(text)
    print(f"wrote {', '.join(str(p) for p in paths)} ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
