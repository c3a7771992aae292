"""Output-length predictor latency (`switchyard bench predictor`): ONNX Runtime on ONE CPU thread, as served.

Each exported predictor (teacher/student x fp32/int8) is loaded through `OnnxLengthPredictor` (session load
time measured), then timed on real prompts from the ShareGPT test split: batch 1 (one request: tokenize + run,
p50/p99 ms) and batched (8 and 32 requests per call: ms per call and per request). PreServe reports 35.9 ms per
request; the goal here is p50 <= 5 ms for one request.

Quick (seconds): `switchyard bench predictor --requests 50 --batch-sizes 8`.
Full (a few minutes): `switchyard bench predictor`.
Writes results/predictor/latency.{json,md,png} and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from switchyard.router.predictor.paths import PREDICTOR_NAMES

PRESERVE_MS = 35.9  # spec §4.5, per request, hardware not stated
GOAL_P50_MS = 5.0


def percentile(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary_ms(samples_s: Sequence[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in samples_s]
    return {
        "p50_ms": round(percentile(ms, 50), 3),
        "p99_ms": round(percentile(ms, 99), 3),
        "mean_ms": round(statistics.fmean(ms), 3),
        "n": len(ms),
    }


def sample_prompts(n: int, seed: int) -> list[str]:
    """n prompts drawn (seeded) from the saved test split: the distribution the router will see."""
    from switchyard.router.predictor.data import load_split

    _, test = load_split()
    rng = random.Random(seed)
    return [s.prompt for s in rng.sample(test, min(n, len(test)))]


def bench_one(
    model_dir: Path, prompts: Sequence[str], batch_sizes: Sequence[int], threads: int, warmup: int = 5
) -> dict:
    from switchyard.router.predictor.onnx_predictor import OnnxLengthPredictor

    t0 = time.perf_counter()
    predictor = OnnxLengthPredictor(model_dir, threads=threads, providers=["CPUExecutionProvider"])
    load_s = time.perf_counter() - t0
    for p in prompts[:warmup]:
        predictor.predict([p])
    single = []
    for p in prompts:
        t = time.perf_counter()
        predictor.predict([p])
        single.append(time.perf_counter() - t)
    row = {
        "name": predictor.name,
        "kind": predictor.meta.get("kind"),
        "quantized": bool(predictor.meta.get("quantized")),
        "layers": predictor.meta.get("layers"),
        "max_input_tokens": predictor.meta.get("max_input_tokens"),
        "onnx_mb": round((model_dir / "model.onnx").stat().st_size / 1e6, 1),
        "load_s": round(load_s, 3),
        "batch1": summary_ms(single),
        "batched": {},
    }
    for b in batch_sizes:
        calls = []
        for start in range(0, len(prompts) - b + 1, b):
            chunk = prompts[start : start + b]
            t = time.perf_counter()
            predictor.predict(chunk)
            calls.append(time.perf_counter() - t)
        if calls:
            per_call = summary_ms(calls)
            row["batched"][str(b)] = {**per_call, "per_request_p50_ms": round(per_call["p50_ms"] / b, 3)}
    return row


def markdown_table(result: dict) -> str:
    sizes = result["batch_sizes"]
    head = "| predictor | layers | int8 | MB | load s | batch 1 p50 | batch 1 p99 |"
    head += "".join(f" batch {b} p50 (per req) | batch {b} p99 |" for b in sizes)
    lines = [head, "|" + "---|" * (7 + 2 * len(sizes))]
    for r in result["rows"]:
        line = f"| {r['name']} | {r['layers']} | {'yes' if r['quantized'] else 'no'} | {r['onnx_mb']} | {r['load_s']} | {r['batch1']['p50_ms']:.2f} ms | {r['batch1']['p99_ms']:.2f} ms |"
        for b in sizes:
            s = r["batched"].get(str(b))
            line += (
                f" {s['p50_ms']:.1f} ms ({s['per_request_p50_ms']:.2f}) | {s['p99_ms']:.1f} ms |"
                if s
                else " — | — |"
            )
        lines.append(line)
    lines.append(
        f"| PreServe (paper, per request) | 6 | — | — | — | {PRESERVE_MS} ms | — |" + " — | — |" * len(sizes)
    )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["name"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    p50 = [r["batch1"]["p50_ms"] for r in rows]
    p99 = [r["batch1"]["p99_ms"] for r in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], p50, width=0.4, label="batch 1 p50")
    ax.bar([i + 0.2 for i in x], p99, width=0.4, label="batch 1 p99")
    ax.axhline(PRESERVE_MS, color="red", linestyle="--", label=f"PreServe {PRESERVE_MS} ms")
    ax.axhline(GOAL_P50_MS, color="green", linestyle=":", label=f"goal p50 {GOAL_P50_MS} ms")
    ax.set_xticks(list(x), names, rotation=15)
    ax.set_ylabel("ms per request (1 CPU thread)")
    ax.set_title("Output-length predictor latency, ONNX Runtime, real ShareGPT prompts")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench predictor", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--predictors",
        nargs="*",
        default=list(PREDICTOR_NAMES),
        help="names under the predictors dir, or paths",
    )
    ap.add_argument("--requests", type=int, default=300, help="real test-split prompts timed at batch 1")
    ap.add_argument("--batch-sizes", type=int, nargs="*", default=[8, 32])
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/predictor")
    ap.add_argument("--prompts-file", default=None, help="a JSON list of prompts instead of the test split")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from switchyard.router.predictor.paths import predictor_path

    if args.prompts_file:
        prompts = json.loads(Path(args.prompts_file).read_text())[: args.requests]
    else:
        prompts = sample_prompts(args.requests, args.seed)
    rows = []
    for name in args.predictors:
        model_dir = predictor_path(name)
        if not (model_dir / "model.onnx").exists():
            print(
                f"(no predictor at {model_dir}: skipped; run `switchyard predictor train`)", file=sys.stderr
            )
            continue
        rows.append(bench_one(model_dir, prompts, args.batch_sizes, args.threads))
    if not rows:
        print("no predictors found", file=sys.stderr)
        return 1
    result = {
        "threads": args.threads,
        "requests": len(prompts),
        "batch_sizes": args.batch_sizes,
        "preserve_ms": PRESERVE_MS,
        "goal_p50_ms": GOAL_P50_MS,
        "rows": rows,
        "host": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "latency.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown_table(result)
    header = f"Predictor latency, ONNX Runtime, {args.threads} CPU thread(s), {len(prompts)} real ShareGPT test prompts (tokenize + run)\n\n"
    (out / "latency.md").write_text(header + table + "\n")
    plot(result, out / "latency.png")
    print(header + table)
    print(f"\nwrote {out / 'latency.json'}, latency.md, latency.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
