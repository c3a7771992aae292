"""`switchyard bench live`: the router and N simulated worker processes over real gRPC on loopback.

Router-added latency is measured the same way for any router: each simulated worker logs, per request id, when
it received the request and when it produced the first token (`--timings-log`). For every request

    router_added_ttft = (client first token - client send) - (worker first token - worker receive)

i.e. everything the client waited for that the engine did not cause: the router's admission, tokenization,
hashing, queueing, policy and two extra loopback hops. The same load is also sent straight to the workers
(client -> worker, round-robin), in the same run, as the baseline for what loopback gRPC alone costs.
Router CPU per request comes from the router process's /proc CPU time over each rate step.

Quick: `switchyard bench live --rates 20,50 --duration 5`. Full (default): rates 25,50,100,200,400, 15 s each.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from switchyard.bench import procs
from switchyard.bench.metrics import dist
from switchyard.router.client import AsyncRouterClient, make_request
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc

MODEL = "mistral-7b-sim"


@dataclass(slots=True)
class Sample:
    request_id: str
    sent_at: float
    first_at: float = 0.0
    done_at: float = 0.0
    ok: bool = False


def _prompts(rng: np.random.Generator, n: int, prompt_len: int, groups: int) -> list[list[int]]:
    """Prompts with a shared prefix per group (half the prompt), the rest unique: a prefix-heavy mix."""
    prefixes = [rng.integers(3, 32000, prompt_len // 2).tolist() for _ in range(max(groups, 1))]
    return [
        [1, *prefixes[i % len(prefixes)], *rng.integers(3, 32000, prompt_len - prompt_len // 2 - 1).tolist()]
        for i in range(n)
    ]


async def _drive(
    send: Any, rate: float, duration_s: float, prompts: list[list[int]], tag: str, rng: np.random.Generator
) -> list[Sample]:
    """Poisson arrivals at `rate` for `duration_s`; `send(sample, prompt)` runs one request."""
    n = max(1, int(rate * duration_s))
    gaps = rng.exponential(1.0 / rate, n)
    start = time.perf_counter()
    tasks: list[asyncio.Task[None]] = []
    samples: list[Sample] = []
    t = 0.0
    for i in range(n):
        t += gaps[i]
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)  # open-loop arrival schedule, not synchronisation
        s = Sample(request_id=f"{tag}-{i}", sent_at=time.time())
        samples.append(s)
        tasks.append(asyncio.create_task(send(s, prompts[i % len(prompts)])))
    await asyncio.gather(*tasks)
    return samples


async def _via_router(client: AsyncRouterClient, s: Sample, prompt: list[int], max_tokens: int) -> None:
    req = make_request(MODEL, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, request_id=s.request_id)
    try:
        async for chunk in client.generate(request=req, timeout=60):
            if chunk.token_ids and not s.first_at:
                s.first_at = time.time()
        s.done_at = time.time()
        s.ok = True
    except grpc.aio.AioRpcError:
        s.ok = False


async def _direct(stub: worker_pb2_grpc.WorkerStub, s: Sample, prompt: list[int], max_tokens: int) -> None:
    req = worker_pb2.WorkerGenerateRequest(
        request_id=s.request_id,
        prompt_token_ids=prompt,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    try:
        async for chunk in stub.Generate(req, timeout=60):
            if chunk.token_ids and not s.first_at:
                s.first_at = time.time()
        s.done_at = time.time()
        s.ok = True
    except grpc.aio.AioRpcError:
        s.ok = False


def _read_timings(paths: list[Path]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for p in paths:
        if p.exists():
            for line in p.read_text().splitlines():
                rec = json.loads(line)
                out[rec["request_id"]] = rec
    return out


def _step_result(
    samples: list[Sample], timings: dict[str, dict[str, float]], rate: float, wall_s: float
) -> dict[str, Any]:
    added_ms = []
    for s in samples:
        w = timings.get(s.request_id)
        if s.ok and s.first_at and w and w["first_token_at"]:
            client_ttft = s.first_at - s.sent_at
            worker_ttft = w["first_token_at"] - w["received_at"]
            added_ms.append((client_ttft - worker_ttft) * 1e3)
    ok = sum(s.ok for s in samples)
    span = samples[-1].sent_at - samples[0].sent_at if len(samples) > 1 else 0.0
    return {
        "offered_rate": rate,
        "num_requests": len(samples),
        "num_ok": ok,
        # what the Poisson schedule actually offered, and what completed over the run's wall time
        "sent_rate": (len(samples) - 1) / span if span > 0 else 0.0,
        "achieved_rate": ok / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "send_span_s": span,
        "added_ttft_ms": dist(added_ms),
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rates = [float(r) for r in args.rates.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-live-"))
    logs = [tmp / f"worker{i}.jsonl" for i in range(args.workers)]
    workers = [
        procs.start(
            f"worker{i}",
            ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--model", MODEL, "--profile", args.profile,
             "--time-scale", str(args.time_scale), "--timings-log", str(logs[i]), "--log-level", "WARNING"],
        )
        for i in range(args.workers)
    ]
    router_args = ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0", "--policy", args.policy,
                   "--log-level", "WARNING"]
    for w in workers:
        router_args += ["--worker", w.address]
    router = procs.start("router", router_args)
    result: dict[str, Any] = {"policy": args.policy, "workers": args.workers, "profile": args.profile,
                              "duration_s": args.duration, "prompt_len": args.prompt_len,
                              "output_len": args.output_len, "steps": []}
    rng = np.random.default_rng(args.seed)
    with procs.running([*workers, router]):
        async with AsyncRouterClient(router.address, admin_address=router.extra.get("admin")) as client:
            await _wait_routable(client, args.workers)
            channels = [grpc.aio.insecure_channel(w.address) for w in workers]
            stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
            # Warm-up: connections, code paths, caches.
            warm = _prompts(rng, 20, args.prompt_len, args.prefix_groups)
            await _drive(lambda s, p: _via_router(client, s, p, args.output_len), 20, 1.0, warm, "warm", rng)
            # Background CPU (Stats polls, health, ticks) with no traffic, to separate it from per-request work.
            cpu0, t0 = router.cpu_seconds(), time.perf_counter()
            await asyncio.sleep(args.idle_probe_s)
            idle_cpu_frac = (router.cpu_seconds() - cpu0) / (time.perf_counter() - t0)
            result["router_idle_cpu_frac"] = idle_cpu_frac
            for rate in rates:
                prompts = _prompts(rng, int(rate * args.duration) + 1, args.prompt_len, args.prefix_groups)
                rr = itertools.cycle(stubs)
                t0 = time.perf_counter()
                direct = await _drive(
                    lambda s, p, rr=rr: _direct(next(rr), s, p, args.output_len),
                    rate, args.duration, prompts, f"d{rate:g}", rng,
                )
                direct_wall = time.perf_counter() - t0
                cpu0 = router.cpu_seconds()
                t0 = time.perf_counter()
                routed = await _drive(
                    lambda s, p: _via_router(client, s, p, args.output_len),
                    rate, args.duration, prompts, f"r{rate:g}", rng,
                )
                routed_wall = time.perf_counter() - t0
                cpu_s = router.cpu_seconds() - cpu0
                timings = _read_timings(logs)
                step = _step_result(routed, timings, rate, routed_wall)
                step["router_cpu_us_per_request"] = cpu_s / max(1, len(routed)) * 1e6
                step["router_cpu_us_per_request_net"] = (
                    max(0.0, cpu_s - idle_cpu_frac * routed_wall) / max(1, len(routed)) * 1e6
                )
                step["direct"] = _step_result(direct, timings, rate, direct_wall)
                result["steps"].append(step)
                a, d = step["added_ttft_ms"], step["direct"]["added_ttft_ms"]
                print(
                    f"rate {rate:7.1f}/s  ok {step['num_ok']}/{step['num_requests']}  "
                    f"router-added TTFT p50 {a['p50']:.2f} ms p99 {a['p99']:.2f} ms  "
                    f"(direct-to-worker gRPC p50 {d['p50']:.2f} p99 {d['p99']:.2f})  "
                    f"router CPU {step['router_cpu_us_per_request']:.0f} us/req "
                    f"({step['router_cpu_us_per_request_net']:.0f} net of idle background)",
                    flush=True,
                )
            for c in channels:
                await c.close()
    result["saturation_rate"] = saturation_rate(result["steps"])
    return result


async def _wait_routable(client: AsyncRouterClient, n: int, timeout_s: float = 30.0) -> None:
    """Poll the admin API until every worker is ready and healthy (a condition, not a fixed sleep)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ws = await client.list_workers()
        if sum(w.healthy and w.state == "ready" for w in ws) >= n:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("workers did not become routable")


def saturation_rate(steps: list[dict[str, Any]]) -> float | None:
    """The highest offered rate the router sustained: every request ok, the backlog drained within 1 s of the
    last send (wall <= send span + 1 s, i.e. completions kept up with arrivals), and the router-added p99
    within 10x the lowest rate's p99 (or 5 ms). None if even the lowest rate failed."""
    best = None
    base = None
    for s in steps:
        p99 = s["added_ttft_ms"]["p99"]
        base = p99 if base is None else base
        sustained = (
            s["num_ok"] == s["num_requests"]
            and s["wall_s"] <= s["send_span_s"] + 1.0
            and p99 <= max(10 * base, 5.0)
        )
        if not sustained:
            break
        best = s["offered_rate"]
    return best


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# bench live: {result['workers']} simulated workers, policy {result['policy']}",
        "",
        "| offered req/s | achieved req/s | ok | router-added TTFT p50 ms | p99 ms | direct gRPC p50 ms | p99 ms "
        "| router CPU us/req | net of idle |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["steps"]:
        a, d = s["added_ttft_ms"], s["direct"]["added_ttft_ms"]
        lines.append(
            f"| {s['offered_rate']:g} | {s['achieved_rate']:.1f} | {s['num_ok']}/{s['num_requests']} "
            f"| {a['p50']:.2f} | {a['p99']:.2f} | {d['p50']:.2f} | {d['p99']:.2f} "
            f"| {s['router_cpu_us_per_request']:.0f} | {s['router_cpu_us_per_request_net']:.0f} |"
        )
    lines += [
        "",
        f"Saturation rate: {result['saturation_rate']} req/s. Router idle background CPU: "
        f"{100 * result['router_idle_cpu_frac']:.1f}% of a core. Router-added TTFT = client TTFT - worker TTFT "
        "(worker timestamps); 'direct gRPC' is the same measure with the client talking to the workers directly.",
        f"Each request: {result['prompt_len']}-token prompt, {result['output_len']} output tokens streamed.",
        "",
    ]
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [s["offered_rate"] for s in result["steps"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("p50", "router-added p50"), ("p99", "router-added p99")):
        ax.plot(rates, [s["added_ttft_ms"][key] for s in result["steps"]], marker="o", label=label)
    ax.plot(rates, [s["direct"]["added_ttft_ms"]["p99"] for s in result["steps"]], ls="--", marker="x",
            label="direct-to-worker p99 (baseline)")
    ax.set_xlabel("offered load (req/s)")
    ax.set_ylabel("added TTFT (ms)")
    ax.set_title("Router-added TTFT, loopback gRPC")
    ax.legend()
    ax.grid(alpha=0.3)
    path = out / "router_added_ttft.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard bench live", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="25,50,100,200,400", help="offered loads, req/s")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per rate step")
    p.add_argument("--policy", default="least_request")
    p.add_argument("--profile", default="llama2-70b-h100-tp4")
    p.add_argument("--time-scale", type=float, default=0.05, help="worker iteration-time multiplier")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--prefix-groups", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-probe-s", type=float, default=2.0, help="seconds to measure idle router CPU")
    p.add_argument("--out", default="results/live")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvloop

        result = uvloop.run(run(args))
    except ImportError:
        result = asyncio.run(run(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    md = markdown(result)
    (out / "results.md").write_text(md)
    png = plot(result, out)
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {png}")
    return 0
