"""The simulator's report: one JSON with every number, a markdown table (one row per policy x load, ratios vs
the first policy at the same load), and PNG plots of TTFT and E2E vs request rate per policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from switchyard.bench.metrics import OK

COLUMNS = (
    # (header, path into metrics, format, compare with the baseline)
    ("TTFT mean s", ("ttft_s", "mean"), "{:.3f}", True),
    ("TTFT p99 s", ("ttft_s", "p99"), "{:.3f}", True),
    ("warm TTFT mean s", ("ttft_warm_s", "mean"), "{:.3f}", True),  # after the first quarter of arrivals
    ("warm TTFT p99 s", ("ttft_warm_s", "p99"), "{:.3f}", True),
    ("TPOT mean ms", ("tpot_s", "mean"), "{:.1f}", True),
    ("E2E mean s", ("e2e_s", "mean"), "{:.2f}", True),
    ("E2E p99 s", ("e2e_s", "p99"), "{:.2f}", True),
    ("norm ms/tok", ("norm_latency_s_per_token", "mean"), "{:.1f}", False),
    ("out tok/s", ("throughput_output_tok_s",), "{:.0f}", False),
    ("hit ratio", ("prefix_cache_hit_ratio",), "{:.3f}", False),
    # per request, counted once at its first admission: what `prefix_hit_bound` compares with (the engines' counters
    # above, as vLLM's, also count a preempted request's re-admission)
    ("cached / prompt", ("prompt_cached_tokens_frac",), "{:.3f}", False),
    ("preempt", ("num_preemptions",), "{:d}", False),
    ("max/mean", ("balance_max_over_mean",), "{:.2f}", False),
    ("SLO att.", ("slo", "attainment"), "{:.3f}", False),
)
_MS = {"TPOT mean ms", "norm ms/tok"}


def _get(metrics: dict[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = metrics
    for k in path:
        v = v[k]
    return v


def run_label(run: dict[str, Any]) -> str:
    """The run's row name: the policy, and how many router replicas shared the workers when not one."""
    k = run.get("router_replicas", 1)
    return run["policy"] if k == 1 else f"{run['policy']} x{k} routers"


def _load_key(run: dict[str, Any]) -> str:
    kind, value = next(iter(run["load"].items()))
    return f"{kind}={value:g}"


def markdown_table(result: dict[str, Any]) -> str:
    """One row per policy x load; latency columns also show `(x0.87)` = this / the baseline's at that load."""
    runs = result["runs"]
    baseline: dict[str, dict[str, Any]] = {}
    for run in runs:
        baseline.setdefault(_load_key(run), run["metrics"])  # the first policy listed at each load
    head = ["policy", "load", "req/s", "done"] + [c[0] for c in COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in runs:
        m = run["metrics"]
        base = baseline[_load_key(run)]
        cells = [run_label(run), _load_key(run), f"{run['rate']:.2f}", f"{m['num_completed']}/{m['num_requests']}"]
        for header, path, fmt, ratio in COLUMNS:
            v = _get(m, path)
            shown = v * 1000 if header in _MS else v
            cell = fmt.format(shown)
            b = _get(base, path)
            if ratio and base is not m and b:
                cell += f" (x{v / b:.2f})"
            cells.append(cell)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def floor_line(result: dict[str, Any]) -> str:
    """Each load's TTFT floor under the table, where the sweep computed them (`sim.ttft_floor`)."""
    floors: dict[str, dict[str, Any]] = {}
    for run in result["runs"]:
        if "ttft_floor" in run:
            floors.setdefault(_load_key(run), run["ttft_floor"])
    if not floors:
        return ""
    return "\nTTFT floor (no router does better: each request computed in the fewest iterations after what can be " \
        "cached for it by its arrival): " + "; ".join(
            f"{load}: mean {f['ttft_s']['mean']:.3f} s, p99 {f['ttft_s']['p99']:.3f} s, warm p99 "
            f"{f['ttft_warm_s']['p99']:.3f} s" for load, f in floors.items()) + ".\n"


def outcome_line(result: dict[str, Any]) -> str:
    """Under the table, what became of the requests a row's "done" leaves out (rejected at admission, ...), so a
    trace with prompts over the model's length says so rather than only counting fewer."""
    parts = []
    for run in result["runs"]:
        other = {k: v for k, v in run["metrics"].get("status", {}).items() if k != OK and v}
        if other:
            parts.append(f"{run_label(run)} {_load_key(run)}: " + ", ".join(f"{v} {k}" for k, v in other.items()))
    return "\nNot completed: " + "; ".join(parts) + ".\n" if parts else ""


def plot(result: dict[str, Any], out: Path) -> list[Path]:
    """TTFT (mean, p99) and E2E (mean, p99) vs request rate, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_policy: dict[str, list[dict[str, Any]]] = {}
    for run in result["runs"]:
        by_policy.setdefault(run_label(run), []).append(run)
    paths: list[Path] = []
    for metric, label in (("ttft_s", "TTFT"), ("e2e_s", "E2E latency")):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, stat in zip(axes, ("mean", "p99"), strict=True):
            for policy, runs in by_policy.items():
                runs = sorted(runs, key=lambda r: r["rate"])
                ax.plot([r["rate"] for r in runs], [r["metrics"][metric][stat] for r in runs], marker="o", label=policy)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(f"{stat} {label} (s)")
            ax.set_title(f"{stat} {label}")
            ax.grid(True, alpha=0.3)
        axes[0].legend()
        trace = result.get("trace", {}).get("name", "")
        fig.suptitle(f"{trace}: {result['config']['workers']} x {result['config']['profile']}")
        fig.tight_layout()
        path = out / f"{metric.removesuffix('_s')}_vs_rate.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def write_report(result: dict[str, Any], out: Path, plots: bool = True) -> list[Path]:
    """results.json, results.md and the plots into `out` (created)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    paths[1].write_text(markdown_table(result) + "\n" + outcome_line(result) + floor_line(result))
    if plots:
        paths += plot(result, out)
    return paths
