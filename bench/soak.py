"""`switchyard bench soak`: the router and N simulated workers under sustained load, their memory over time.

Why: a daemon that serves for weeks must reach a steady state. Everything the router keeps per request (the radix
tree, the policies' windows and histories, the predictor's memo, the metrics) has to be collected again once it
falls out of its window, and a leak only shows over many windows. This drives open-loop Poisson arrivals over real
gRPC on loopback for `--duration` seconds, with prefix groups that rotate every `--group-life` seconds (old
prefixes must leave the tree and the caches), and samples the resident memory (RSS, /proc) of the router and of
each worker, the router's CPU and the requests' outcomes every `--sample-every` seconds.

The verdict compares the second half of the run with the first: a router whose RSS still grows over the second
half by more than `--growth-tolerance` of its size at the half-way point is reported as growing (a leak, or windows
longer than the run: rerun longer before calling it one).

Quick: `switchyard bench soak --duration 60 --rate 50`. Default: 600 s at 150 req/s on 4 workers.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench import procs
from switchyard.bench.live import MODEL, Sample, _via_router, _wait_routable, run_and_write
from switchyard.router.client import AsyncRouterClient


@dataclass(slots=True)
class Point:
    t_s: float  # since the load started
    sent: int
    ok: int
    failed: int
    in_flight: int
    router_rss_mb: float
    worker_rss_mb: list[float]
    router_cpu_s: float


def rss_mb(pid: int) -> float:
    """Resident set size of a process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def verdict(points: list[Point], tolerance: float) -> dict[str, Any]:
    """Router RSS growth over the second half of the run, against its size at the half-way point."""
    if len(points) < 3:
        return {"steady": None, "why": "too few samples"}
    half = points[len(points) // 2]
    last = points[-1]
    growth = last.router_rss_mb - half.router_rss_mb
    requests = max(1, last.sent - half.sent)
    return {
        "steady": growth <= tolerance * half.router_rss_mb,
        "second_half_growth_mb": growth,
        "kb_per_1k_requests": growth * 1024 / requests * 1000,
        "half_way_rss_mb": half.router_rss_mb,
        "tolerance": tolerance,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workers = [
        procs.start(f"worker{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--model", MODEL,
                                   "--profile", args.profile, "--time-scale", str(args.time_scale),
                                   "--log-level", "WARNING"])
        for i in range(args.workers)
    ]
    router = procs.start("router", ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0",
                                    "--policy", args.policy, "--log-level", "WARNING",
                                    *itertools.chain.from_iterable(("--worker", w.address) for w in workers)])
    rng = np.random.default_rng(args.seed)
    points: list[Point] = []
    with procs.running([*workers, router]):
        async with AsyncRouterClient(router.address, admin_address=router.extra.get("admin")) as client:
            await _wait_routable(client, args.workers)
            prefixes: dict[int, list[int]] = {}
            tasks: set[asyncio.Task[None]] = set()
            outcome = {"ok": 0, "failed": 0}
            sent = 0

            async def one(s: Sample, prompt: list[int]) -> None:
                await _via_router(client, s, prompt, args.output_len)
                outcome["ok" if s.ok else "failed"] += 1

            def sample(t: float) -> None:
                points.append(Point(t, sent, outcome["ok"], outcome["failed"], len(tasks), rss_mb(router.pid),
                                    [rss_mb(w.pid) for w in workers], router.cpu_seconds()))
                p = points[-1]
                print(f"t={t:6.0f} s  sent {p.sent}  ok {p.ok}  failed {p.failed}  in flight {p.in_flight}  "
                      f"router RSS {p.router_rss_mb:.1f} MB  workers {max(p.worker_rss_mb):.1f} MB max  "
                      f"router CPU {p.router_cpu_s:.0f} s", flush=True)

            start = time.perf_counter()
            next_sample = 0.0
            due = 0.0
            while (now := time.perf_counter() - start) < args.duration:
                if now >= next_sample:
                    sample(now)
                    next_sample += args.sample_every
                # a prefix group lives `group_life` seconds: each one is new to the tree and the caches
                g = int(now // args.group_life) * args.prefix_groups + int(rng.integers(0, args.prefix_groups))
                if g not in prefixes:
                    prefixes[g] = np.random.default_rng([args.seed, g]).integers(3, 32000, args.prompt_len // 2).tolist()
                    prefixes.pop(g - 2 * args.prefix_groups, None)  # the client keeps only recent groups
                prompt = [1, *prefixes[g], *rng.integers(3, 32000, args.prompt_len - args.prompt_len // 2 - 1).tolist()]
                task = asyncio.create_task(one(Sample(request_id=f"soak-{sent}", sent_at=time.time()), prompt))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
                due += rng.exponential(1.0 / args.rate)
                delay = start + due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # open-loop arrival schedule, not synchronisation
            await asyncio.gather(*list(tasks))
            sample(time.perf_counter() - start)
    return {
        "policy": args.policy, "workers": args.workers, "profile": args.profile, "rate": args.rate,
        "duration_s": args.duration, "time_scale": args.time_scale, "prompt_len": args.prompt_len,
        "output_len": args.output_len, "group_life_s": args.group_life, "prefix_groups": args.prefix_groups,
        "points": [asdict(p) for p in points], "verdict": verdict(points, args.growth_tolerance),
    }


def markdown(result: dict[str, Any]) -> str:
    v = result["verdict"]
    pts = result["points"]
    lines = [
        f"# bench soak: policy {result['policy']}, {result['workers']} simulated workers, {result['rate']:g} req/s "
        f"for {result['duration_s']:g} s",
        "",
        "| t s | sent | ok | failed | in flight | router RSS MB | worker RSS MB (max) | router CPU s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in pts:
        lines.append(f"| {p['t_s']:.0f} | {p['sent']} | {p['ok']} | {p['failed']} | {p['in_flight']} "
                     f"| {p['router_rss_mb']:.1f} | {max(p['worker_rss_mb']):.1f} | {p['router_cpu_s']:.0f} |")
    lines.append("")
    if v.get("steady") is None:
        lines.append(f"Verdict: none ({v['why']}).")
    else:
        lines.append(
            f"Verdict: router RSS {'steady' if v['steady'] else 'GROWING'} over the second half: "
            f"{v['second_half_growth_mb']:+.1f} MB from {v['half_way_rss_mb']:.1f} MB "
            f"({v['kb_per_1k_requests']:+.1f} KB per 1,000 requests; tolerance {100 * v['tolerance']:.0f}%)."
        )
    lines += [
        f"Each request: a {result['prompt_len']}-token prompt (half from one of {result['prefix_groups']} prefix "
        f"groups that change every {result['group_life_s']:g} s), {result['output_len']} output tokens.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    t = [p["t_s"] for p in pts]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(t, [p["router_rss_mb"] for p in pts], marker="o", label="router")
    for i in range(result["workers"]):
        ax.plot(t, [p["worker_rss_mb"][i] for p in pts], ls=":", label=f"worker {i}")
    ax.set_xlabel("time under load (s)")
    ax.set_ylabel("RSS (MB)")
    ax.set_title(f"Resident memory at {result['rate']:g} req/s ({result['policy']})")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = out / "rss.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard bench soak", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--rate", type=float, default=150.0, help="offered load, req/s (Poisson)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policy", default="switchyard")
    p.add_argument("--profile", default="llama2-70b-h100-tp4")
    p.add_argument("--time-scale", type=float, default=0.05, help="worker iteration-time multiplier")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--prefix-groups", type=int, default=50, help="prefix groups alive at a time")
    p.add_argument("--group-life", type=float, default=30.0, help="seconds before the groups are replaced")
    p.add_argument("--sample-every", type=float, default=30.0, help="seconds between samples")
    p.add_argument("--growth-tolerance", type=float, default=0.05,
                   help="router RSS growth over the second half, as a fraction of its half-way size, still steady")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/soak")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_and_write(run, build_parser().parse_args(argv), markdown, plot)
