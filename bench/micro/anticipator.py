"""Micro-benchmark of the per-worker load anticipator (`switchyard bench anticipator`): add (D = 200 and 2000),
finish, advance_to(+1), peak(100) and virtual_peak(100), p50/p99 in µs, Cython build vs Python reference, on a
worker in steady state with ~200 live requests (specs/preserve.md §5.4; goal: add and peak queries p99 <= 20 µs).

The worker's traffic: prompts and predicted lengths log-normal (medians 300 and 250 tokens, ShareGPT-like), true
lengths = predicted x log-normal noise (sigma 0.3), so about half the requests overrun and get extensions and the
rest finish early. Between timed calls the worker runs untimed: one iteration passes, requests that reached their
true length finish and new ones are added to keep the live count.

Quick (a second): `switchyard bench anticipator --ops 500`. Full (under a minute): `switchyard bench anticipator`.
Writes results/micro/anticipator.json, .md and .png and prints the table.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from switchyard.bench.micro.output import grouped_bars, write_outputs
from switchyard.bench.micro.radix import pct
from switchyard.ext import anticipator_py

try:
    from switchyard.ext import _anticipator_c
except ImportError:  # pragma: no cover - the table then has the reference only
    _anticipator_c = None

CAPACITY_TOKENS = 1 << 18  # ~262k KV tokens: a 7B model on one 80 GB GPU
HORIZON = 100  # PreServe's l
GOAL_P99_US = 20.0
OPS = ("add D=200", "add D=2000", "finish", "advance_to(+1)", "peak(100)", "virtual_peak(100)")


class Worker:
    """One worker's anticipator kept at `records` live requests by untimed traffic."""

    def __init__(self, mod: ModuleType, records: int, seed: int) -> None:
        self.a = mod.Anticipator(CAPACITY_TOKENS)
        self.rng = random.Random(seed)
        self.records = records
        self.true_end: dict[int, int] = {}  # rid -> absolute iteration at which it really finishes
        self.next_rid = 0
        for _ in range(records):  # staggered starts: a few iterations between adds
            self.add_one()
            self.a.advance_to(self.a.iteration + self.rng.randint(0, 2))
        for _ in range(300):
            self.step()

    def lengths(self) -> tuple[int, int, int]:
        """(prompt, predicted, true) tokens."""
        rng = self.rng
        p = min(4000, max(4, int(rng.lognormvariate(5.7, 0.9))))  # median ~300
        d = min(4096, max(1, int(rng.lognormvariate(5.5, 0.8))))  # median ~250
        true = min(4096, max(1, round(d * rng.lognormvariate(0.0, 0.3))))
        return p, d, true

    def new_rid(self) -> int:
        self.next_rid += 1
        return self.next_rid

    def add_one(self) -> None:
        p, d, true = self.lengths()
        rid = self.new_rid()
        self.a.add(rid, p, d)
        self.true_end[rid] = self.a.iteration + true

    def step(self) -> None:
        it = self.a.iteration + 1
        self.a.advance_to(it)
        for rid in [r for r, end in self.true_end.items() if end <= it]:
            self.a.finish(rid)
            del self.true_end[rid]
        while len(self.true_end) < self.records:
            self.add_one()


def time_op(w: Worker, op: str, num_ops: int) -> list[int]:
    """num_ops timed calls of one operation, each after one untimed worker step."""
    clock = time.perf_counter_ns
    a = w.a
    out: list[int] = []
    fixed_d = {"add D=200": 200, "add D=2000": 2000}
    for _ in range(num_ops):
        w.step()
        if op in fixed_d:
            p, _, _ = w.lengths()
            rid = w.new_rid()
            t = clock()
            a.add(rid, p, fixed_d[op])
            out.append(clock() - t)
            a.finish(rid)  # untimed: keep the live count
        elif op == "finish":  # an early finish or one at the true end: removes its remaining tail
            rid = w.rng.choice(list(w.true_end))
            t = clock()
            a.finish(rid)
            out.append(clock() - t)
            del w.true_end[rid]
            w.add_one()
        elif op == "advance_to(+1)":
            it = a.iteration + 1
            t = clock()
            a.advance_to(it)
            out.append(clock() - t)
        elif op == "peak(100)":
            t = clock()
            a.peak(HORIZON)
            out.append(clock() - t)
        elif op == "virtual_peak(100)":
            p, d, _ = w.lengths()
            t = clock()
            a.virtual_peak(p, d, HORIZON)
            out.append(clock() - t)
        else:
            raise ValueError(op)
    return out


def measure(mod: ModuleType, records: int, num_ops: int, seed: int) -> list[dict[str, Any]]:
    impl = "c" if mod is _anticipator_c else "py"
    rows = []
    for i, op in enumerate(OPS):
        w = Worker(mod, records, seed + i)
        samples = time_op(w, op, num_ops)
        rows.append(
            {
                "impl": impl,
                "op": op,
                "records": len(w.a),
                "ops": num_ops,
                "p50_us": round(pct(samples, 0.50), 3),
                "p99_us": round(pct(samples, 0.99), 3),
                "mean_us": round(sum(samples) / len(samples) / 1000.0, 3),
            }
        )
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    by = {(r["impl"], r["op"]): r for r in rows}
    lines = [
        "| op | Cython p50 / p99 µs | Python p50 / p99 µs | speed-up (p50) |",
        "|---|---|---|---|",
    ]

    def cell(impl: str, op: str) -> str:
        r = by.get((impl, op))
        return f"{r['p50_us']} / {r['p99_us']}" if r else "-"

    for op in OPS:
        c, py = by.get(("c", op)), by.get(("py", op))
        ratio = f"x{py['p50_us'] / c['p50_us']:.0f}" if c and py and c["p50_us"] > 0 else "-"
        lines.append(f"| {op} | {cell('c', op)} | {cell('py', op)} | {ratio} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Bars (log scale): p50 and p99 µs per operation, one colour per build, the 20 µs goal as a line."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["impl"], r["op"]): r for r in rows}
    series = [(f"{'Cython' if impl == 'c' else 'Python'} {stat}",
               [by[(impl, op)][f"{stat}_us"] if (impl, op) in by else 0 for op in OPS])
              for impl in impls for stat in ("p50", "p99")]
    title = f"Load anticipator, ~{rows[0]['records']} live requests per worker, one core"
    return grouped_bars(path, list(OPS), series, title, log=True, goal=(GOAL_P99_US, f"goal p99 {GOAL_P99_US:g} µs"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench anticipator", description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200, help="live requests per worker")
    ap.add_argument("--ops", type=int, default=5000, help="timed calls per operation and build")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", choices=["both", "c", "py"], default="both")
    ap.add_argument("--out", type=Path, default=Path("results/micro"), help="output folder")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    mods = []
    if args.impl in ("both", "c"):
        if _anticipator_c is None:
            print("switchyard.ext._anticipator_c is not built; reference only", file=sys.stderr)
        else:
            mods.append(_anticipator_c)
    if args.impl in ("both", "py"):
        mods.append(anticipator_py)
    rows = [row for mod in mods for row in measure(mod, args.records, args.ops, args.seed)]
    meta = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "capacity_tokens": CAPACITY_TOKENS,
        "horizon": HORIZON,
        "records": args.records,
        "seed": args.seed,
        "goal_p99_us": GOAL_P99_US,
    }
    draw = None if args.no_plot else lambda path: plot(rows, path)
    write_outputs(args.out, "anticipator", meta, rows, to_markdown(rows), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
