"""`switchyard demo` (`make run`): the main job, end to end over real processes on loopback.

Starts the router and 4 simulated worker processes, replays a time-compressed slice of the Mooncake conversation
trace (real arrivals, real prefix sharing) through round_robin, E2 and the router's default policy (`switchyard`),
and prints a results table. The router's default length predictor applies (the trained one when present, else the fallback);
the header says which one it loaded and who answered: the trace has token ids, no text, so the fallback does. Time compression is applied to arrivals AND to the workers' iteration times alike, so the fleet
sees the same load as at real speed; latencies are reported back in model seconds (x the compression).
"""

from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from switchyard.bench import procs
from switchyard.bench.metrics import dist
from switchyard.bench.traces import PromptFactory, Trace, has_clock, load_trace, parse_where, spread_ties
from switchyard.router.client import AsyncRouterClient, make_request
from switchyard.router.policies.registry import DEFAULT_POLICY, POLICIES

MODEL = "mistral-7b-sim"
DEMO_POLICIES = ("round_robin", "e2", DEFAULT_POLICY)  # the baseline first: the table's ratios are against it


async def _one(client: AsyncRouterClient, req: Any, tokens: list[int], out: dict[str, Any]) -> None:
    r = make_request(MODEL, token_ids=tokens, max_tokens=req.num_output_tokens, ignore_eos=True,
                     request_id=req.request_id)
    try:
        resp = await client.complete(request=r, timeout=600)
    except grpc.aio.AioRpcError as e:
        out["errors"].append(f"{req.request_id}: {e.code().name} {e.details()}")
        return
    out["ttft"].append(resp.timings.ttft_s)
    out["e2e"].append(resp.timings.e2e_s)
    out["queue"].append(resp.timings.queue_s)
    out["prompt"] += resp.usage.prompt_tokens
    out["cached"] += resp.usage.cached_prompt_tokens
    out["output"] += resp.usage.completion_tokens


async def run_policy(policy: str, args: argparse.Namespace, requests: list[Any], factory: PromptFactory) -> dict[str, Any]:
    workers = [
        procs.start(f"worker{i}", ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--model", MODEL,
                                   "--profile", args.profile, "--time-scale", str(1.0 / args.speedup),
                                   "--log-level", "WARNING"])
        for i in range(args.workers)
    ]
    router_args = ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0", "--policy", policy,
                   "--log-level", "WARNING"]
    for w in workers:
        router_args += ["--worker", w.address]
    router = procs.start("router", router_args)
    out: dict[str, Any] = {"ttft": [], "e2e": [], "queue": [], "errors": [], "prompt": 0, "cached": 0, "output": 0}
    prompts = [list(factory.tokens(r)) for r in requests]
    with procs.running([*workers, router]):
        async with AsyncRouterClient(router.address, admin_address=router.extra.get("admin")) as client:
            start = time.perf_counter()
            tasks = []
            for req, tokens in zip(requests, prompts, strict=True):
                delay = start + req.arrival_s * args.arrival_stretch / args.speedup - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)  # the trace's arrival schedule
                tasks.append(asyncio.create_task(_one(client, req, tokens, out)))
            await asyncio.gather(*tasks)
            wall = time.perf_counter() - start
        answers = prediction_sources(router.extra["metrics"])
    s = args.speedup
    return {
        "policy": policy,
        "requests": len(requests),
        "ok": len(out["ttft"]),
        "errors": out["errors"],
        "ttft_s": {k: v * s for k, v in dist(out["ttft"]).items()},
        "e2e_s": {k: v * s for k, v in dist(out["e2e"]).items()},
        "queue_s": {k: v * s for k, v in dist(out["queue"]).items()},
        "hit_ratio": out["cached"] / out["prompt"] if out["prompt"] else 0.0,
        "throughput_tok_s": out["output"] / (wall * s),
        "wall_s": wall,
        "predictor": router.extra.get("predictor", "fallback"),
        "predictor_providers": router.extra.get("predictor_providers", ""),
        "prediction_sources": answers,
    }


def prediction_sources(metrics_address: str) -> dict[str, int]:
    """Who answered the router's length predictions (model / hint / fallback), from its metrics."""
    body = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    return {
        s.labels["source"]: int(s.value)
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "switchyard_predictions_total"
    }


def predictor_line(results: list[dict[str, Any]]) -> str:
    r = results[0]
    loaded = r["predictor"] + (f" on {r['predictor_providers']}" if r["predictor_providers"] else "")
    counts: dict[str, int] = {}
    for res in results:
        for source, n in res["prediction_sources"].items():
            counts[source] = counts.get(source, 0) + n
    answered = ", ".join(f"{source} {n}" for source, n in sorted(counts.items())) or "none"
    return f"length predictor: {loaded}; predictions answered by: {answered}"


def table(results: list[dict[str, Any]]) -> str:
    base = results[0]
    lines = [
        "| policy | ok | TTFT p50 s | TTFT p90 s | TTFT p99 s | E2E p50 s | E2E p99 s | prefix hit ratio | output tok/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ratio = "" if r is base else f" (x{r['ttft_s']['p50'] / base['ttft_s']['p50']:.2f})" if base['ttft_s']['p50'] else ""
        lines.append(
            f"| {r['policy']} | {r['ok']}/{r['requests']} | {r['ttft_s']['p50']:.3f}{ratio} | {r['ttft_s']['p90']:.3f} "
            f"| {r['ttft_s']['p99']:.3f} | {r['e2e_s']['p50']:.2f} | {r['e2e_s']['p99']:.2f} | {r['hit_ratio']:.3f} "
            f"| {r['throughput_tok_s']:.0f} |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard demo", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--policies", default=",".join(DEMO_POLICIES),
                   help="comma-separated; the first is the baseline of the TTFT ratios")
    p.add_argument("--trace", default="mooncake-conversation")
    p.add_argument("--start", type=float, default=0.0, help="trace second the slice starts at")
    p.add_argument("--duration", type=float, default=90.0, help="trace seconds replayed per policy")
    p.add_argument("--where", action="append", default=[], metavar="COLUMN=VALUE",
                   help="only the trace's rows with this value in this column or field (as bench sim's)")
    p.add_argument("--spread-ties", action="store_true",
                   help="requests that share a trace time spread over its clock step (as bench sim's)")
    p.add_argument("--speedup", type=float, default=4.0, help="time compression of arrivals and engine alike")
    p.add_argument(
        "--arrival-stretch",
        type=float,
        default=2.0,
        help="multiply the trace's inter-arrival times: the trace's rate overloads 4 workers of this profile "
        "(mean prompt 12k tokens); 2 gives them about the load 8 workers get at the trace's own rate",
    )
    p.add_argument("--profile", default="llama3-8b-a100")
    p.add_argument("--block-size", type=int, default=16)
    return p


def demo_trace(args: argparse.Namespace) -> Trace:
    """The slice the demo replays, its rows filtered and its clock's steps spread as asked; SystemExit if it is
    empty, cannot be read, or lacks timestamps or output lengths (a batch job's: `bench sim` paces and fills it)."""
    try:
        trace = load_trace(args.trace, start_s=args.start, duration_s=args.duration, where=parse_where(args.where))
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"switchyard demo: {e}") from None
    if not trace.requests:
        raise SystemExit(f"switchyard demo: no request of {trace.name} arrives in the slice")
    if not has_clock(trace) or any(r.num_output_tokens == 0 for r in trace.requests):
        missing = "timestamps" if not has_clock(trace) else "output lengths"
        raise SystemExit(f"switchyard demo: {trace.name} has no {missing} (an offline batch job's trace): replay "
                         "it with `switchyard bench sim --trace PATH --rate R --max-requests N`, which sends it as a "
                         "Poisson stream and draws the missing lengths")
    return spread_ties(trace) if args.spread_ties else trace


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise SystemExit(f"switchyard demo: unknown policies {unknown or args.policies!r}; known: {', '.join(sorted(POLICIES))}")
    trace = demo_trace(args)
    requests = list(trace.requests)  # re-based: the slice's first arrival is at 0
    factory = PromptFactory(block_size=args.block_size)
    print(f"demo: {len(requests)} requests from {trace.name} ({args.duration:g} trace-seconds, inter-arrivals "
          f"x{args.arrival_stretch:g}, x{args.speedup:g} time compression), {args.workers} simulated workers "
          f"({args.profile}), policies {', '.join(policies)}", flush=True)
    results = []
    for policy in policies:
        t = time.perf_counter()
        results.append(asyncio.run(run_policy(policy, args, requests, factory)))
        r = results[-1]
        print(f"  {policy}: {r['ok']}/{r['requests']} ok in {time.perf_counter() - t:.1f} s wall", flush=True)
        for e in r["errors"][:5]:
            print(f"    error: {e}")
    print()
    print(predictor_line(results))
    print(table(results))
    print("\nLatencies in model seconds (wall x compression); prefix hit ratio = cached / prompt tokens "
          "(as the workers reported them).")
    return 0 if all(r["ok"] == r["requests"] for r in results) else 1
