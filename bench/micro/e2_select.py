"""Micro-benchmark of E2's per-select loops (`switchyard bench e2-select`): `exploit_set` and `cheapest` (the
bounds and the branch and bound; `ext/e2_select`), Cython build vs Python reference, on the calls E2 makes while
`switchyard bench decisions` streams a workload through it (16 workers, a preloaded tree), the select run step by
step (the Cython build's fused select, `select_e2`, makes these calls in C: `bench decisions --paired` against an
earlier revision times it whole). Every call is made by both builds on the same arguments, in an order that
alternates by call, and timed; the two answers must agree (the run stops otherwise).
The ratio is the median over calls of Cython's time over the reference's.

Quick: `switchyard bench e2-select --num-requests 2000 --preload-nodes 0`. Default: toolbench-200 with 50,000
requests (the decision-cost goal's "past the warm-up" case) and videoqa-1500 with 3,000, on a 100k-node tree
(a few minutes). Writes results/micro/e2_select.{json,md,png} and prints the table.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench.micro.decisions import WORKLOADS, prepare, run_one
from switchyard.bench.micro.output import grouped_bars, write_outputs
from switchyard.ext import e2_select, e2_select_py
from switchyard.router.policies import preble_e2

try:
    from switchyard.ext import _e2_select_c
except ImportError:  # pragma: no cover - main reports it
    _e2_select_c = None

DEFAULT_RUNS = "toolbench-200:50000,videoqa-1500:3000"
OPS = ("exploit_set", "cheapest")


@contextmanager
def paired_calls(times: dict[str, dict[str, list[int]]], sizes: list[int]) -> Iterator[None]:
    """While active, E2's calls of the two loops run both builds (alternating which goes first), time each into
    `times[op][build]`, check they agree, and return the Cython build's answer. `sizes`: candidates per
    `cheapest` call."""
    assert _e2_select_c is not None
    c = _e2_select_c
    ref_envs: dict[int, tuple[Any, Any]] = {}
    turn = [0]
    clock = time.perf_counter_ns

    def twice(op: str, py_call: Callable[[], Any], c_call: Callable[[], Any]) -> tuple[Any, Any]:
        turn[0] += 1
        order = [("py", py_call), ("c", c_call)] if turn[0] % 2 else [("c", c_call), ("py", py_call)]
        got = {}
        for build, call in order:
            t0 = clock()
            got[build] = call()
            times[op][build].append(clock() - t0)
        return got["py"], got["c"]

    def exploit_set(cached: Any, key_end: int, by_id: Any, redirect: Any, replicas: Any, now: float) -> Any:
        py, cy = twice("exploit_set", lambda: e2_select_py.exploit_set(cached, key_end, by_id, redirect, replicas, now),
                       lambda: c.exploit_set(cached, key_end, by_id, redirect, replicas, now))
        if [id(v) for v in py] != [id(v) for v in cy]:
            raise AssertionError(f"exploit_set: the builds disagree: {py} != {cy}")
        return cy

    def cheapest(env: Any, ws: Any, cached: Any, n: int, now: float, turn_: int, price_m: Any, path: Any) -> Any:
        got = ref_envs.get(id(env))
        if got is None or got[0] is not env:  # the policy's env, mirrored once for the reference
            kw = {k: getattr(env, k) for k in e2_select_py.BoundsEnv.__slots__}
            got = ref_envs[id(env)] = (env, e2_select_py.BoundsEnv(**kw))
        ref = got[1]
        sizes.append(len(ws))
        # an untimed reference pass asks the policy for M (the LRU simulation, with its memo: asked once, as
        # the policy would); the timed passes of both builds get those answers replayed, so each is timed on
        # the same questions without the simulation, and L's memo misses are already filled
        ms: dict[tuple[int, int], float] = {}

        def record(i: int, evict: int) -> float:
            v = ms[(i, evict)] = price_m(i, evict)
            return v

        want = e2_select_py.cheapest(ref, ws, cached, n, now, turn_, record, path)
        def replay(i: int, evict: int) -> float:
            return ms[(i, evict)]

        py, cy = twice("cheapest", lambda: e2_select_py.cheapest(ref, ws, cached, n, now, turn_, replay, path),
                       lambda: c.cheapest(env, ws, cached, n, now, turn_, replay, path))
        if not py == cy == want:
            raise AssertionError(f"cheapest: the builds disagree: {py} != {cy}")
        return cy

    saved = preble_e2.exploit_set, preble_e2.cheapest, preble_e2.select_e2
    # the select runs step by step (the reference `select_e2`: the policy's `select_steps`), so it calls the loops
    # through these names; the Cython build's fused select calls them in C
    preble_e2.exploit_set, preble_e2.cheapest = exploit_set, cheapest  # type: ignore[assignment]
    preble_e2.select_e2 = e2_select_py.select_e2  # type: ignore[assignment]
    try:
        yield
    finally:
        preble_e2.exploit_set, preble_e2.cheapest, preble_e2.select_e2 = saved


def measure(workload: str, num_requests: int, workers: int, preload_nodes: int, seed: int) -> list[dict[str, Any]]:
    """One row per loop: calls, p50/p99 µs of each build, the median per-call ratio."""
    wl = WORKLOADS[workload]
    prep = prepare(wl, num_requests, seed)
    times: dict[str, dict[str, list[int]]] = {op: {"py": [], "c": []} for op in OPS}
    sizes: list[int] = []
    with paired_calls(times, sizes):
        run_one(prep, wl, "e2", workers, preload_nodes)
    rows = []
    for op in OPS:
        py, cy = np.array(times[op]["py"], dtype=float), np.array(times[op]["c"], dtype=float)
        if not len(py):
            continue
        rows.append({
            "workload": workload, "requests": num_requests, "workers": workers, "preload_nodes": preload_nodes,
            "op": op, "calls": len(py),
            "candidates_p50": float(np.median(sizes)) if op == "cheapest" and sizes else None,
            "py_p50_us": round(float(np.median(py)) / 1e3, 2),
            "py_p99_us": round(float(np.percentile(py, 99)) / 1e3, 2),
            "c_p50_us": round(float(np.median(cy)) / 1e3, 2),
            "c_p99_us": round(float(np.percentile(cy, 99)) / 1e3, 2),
            "median_ratio": round(float(np.median(cy / np.maximum(py, 1.0))), 3),
        })
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload, requests | loop | calls | candidates p50 | reference p50 / p99 µs | Cython p50 / p99 µs |"
        " median ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cand = f"{r['candidates_p50']:g}" if r["candidates_p50"] is not None else "-"
        lines.append(
            f"| {r['workload']}, {r['requests']:,} | {r['op']} | {r['calls']:,} | {cand} | {r['py_p50_us']} / "
            f"{r['py_p99_us']} | {r['c_p50_us']} / {r['c_p99_us']} | x{r['median_ratio']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Bars: p50 and p99 µs per (workload, loop), reference and Cython side by side."""
    series = [(f"{'Cython' if build == 'c' else 'reference'} {stat}", [r[f"{build}_{stat}_us"] for r in rows])
              for build in ("py", "c") for stat in ("p50", "p99")]
    return grouped_bars(path, [f"{r['workload']}\n{r['op']}" for r in rows], series,
                        "E2's per-select loops, both builds on the same calls, one core")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench e2-select", description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=DEFAULT_RUNS,
                    help=f"comma-separated WORKLOAD:REQUESTS (known: {','.join(WORKLOADS)}); default {DEFAULT_RUNS}")
    ap.add_argument("--num-requests", type=int, default=None, help="override every run's request count")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--preload-nodes", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/micro"), help="output folder")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if _e2_select_c is None:
        print("switchyard.ext._e2_select_c is not built (pip install -e .): nothing to compare", file=sys.stderr)
        return 2
    if e2_select.IMPLEMENTATION != "c":  # E2 would build its state for the reference, which the C calls refuse
        print("SWITCHYARD_NO_EXTENSIONS is set: E2 runs on the reference build, so there is no Cython call to time",
              file=sys.stderr)
        return 2
    runs = []
    for item in args.runs.split(","):
        name, _, count = item.partition(":")
        if name not in WORKLOADS:
            ap.error(f"unknown workload {name!r}")
        runs.append((name, args.num_requests or int(count or 2000)))
    rows = [row for name, count in runs for row in measure(name, count, args.workers, args.preload_nodes, args.seed)]
    meta = {"python": platform.python_version(), "machine": platform.machine(), "seed": args.seed}
    draw = None if args.no_plot or not rows else lambda path: plot(rows, path)
    write_outputs(args.out, "e2_select", meta, rows, to_markdown(rows), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
