"""`switchyard bench live`: the router and N simulated worker processes over real gRPC on loopback.

Router-added latency is measured the same way for any router: each simulated worker logs, per request id, when
it received the request and when it produced the first token (`--timings-log`). For every request

    router_added_ttft = (client first token - client send) - (worker first token - worker receive)

i.e. everything the client waited for that the engine did not cause: the router's admission, tokenization,
hashing, queueing, policy and two extra loopback hops. The same load is also sent straight to the workers
(client -> worker, round-robin), in the same run, as the baseline for what loopback gRPC alone costs, and through
a bare relay (`bench relay`: the router's Generate on the daemon's grpc.aio/uvloop stack, round-robin, no logic)
for what one more Python gRPC hop costs; Switchyard above the relay is its own logic.
Router CPU per request comes from the router process's /proc CPU time over each rate step.

Quick: `switchyard bench live --rates 20,50 --duration 5`. Full (default): rates 25,50,100,200,400, 15 s each.

`--peers` (needs `make peers-env`): after the Switchyard steps, the SAME worker processes (started with their
HTTP facade and vLLM-format ZMQ KV events) are driven through smg 1.13 (cache_aware, least_load) and
vllm-router 0.1.17 (cache_aware, kv_aware) with streaming HTTP /v1/completions (text prompts: smg rejects
token-id prompts), plus a direct-to-worker HTTP baseline. Router-added TTFT is measured the same way, matching
each client sample to the worker's timings by the response `id` (= the X-Request-Id both routers forward).
Each router gets fresh prompts of the same shape, after a /flush_cache of every worker, so hit ratios compare.

`--adaptive-interval N`: a second Switchyard router on the same workers with `server.stream_interval_max_tokens =
N` (router/stream_governor.py) gets each rate's load right after the default router's pass, requests that do not
choose an interval; both routers' event-loop lag (`switchyard_event_loop_lag_seconds`) is scraped around each pass.

`--worker-session` and `--grpc-io` each compare two settings of one thing (`VARIANTS`): the default router (and the
bare relay) runs with the old setting and a second router on the same workers with the new one, each rate's load
right after the default router's pass; the router's CPU and the workers' (all of them, over the pass) per request,
and the router-added TTFT, side by side. `--worker-session`: one Generate call per request (`workers.session =
false`) → one Session stream per worker. `--grpc-io`: gRPC's EventEngine I/O threads (`GRPC_EXPERIMENTS` empty,
gRPC's defaults) → its polled I/O, the console script's default (`switchyard/cli.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from switchyard.bench import cpu_limit, peers, procs
from switchyard.bench.metrics import dist
from switchyard.router.client import AsyncRouterClient, make_request
from switchyard.v1 import common_pb2, worker_pb2, worker_pb2_grpc

MODEL = "mistral-7b-sim"


@dataclass(frozen=True, slots=True)
class Variant:
    """Two settings of one thing, old → new: the default router and the bare relay get the old one, a second router
    the new one (router arguments and environment each). Keyed in `VARIANTS` by its flag's dest."""

    old_args: tuple[str, ...]
    new_args: tuple[str, ...]
    old_env: tuple[tuple[str, str], ...]
    relay_args: tuple[str, ...]  # the relay's flags for the old setting
    heading: str  # the markdown table's lead-in, ending with "old → new:"


VARIANTS = {
    "worker_session": Variant(
        ("--set", "workers.session=false"), ("--set", "workers.session=true"), (), ("--calls",),
        "Worker sessions: the default router with one Generate call per request (`workers.session = false`) against "
        "a second router on the same workers with one Session stream per worker (`workers.session = true`), each "
        "rate's load right after the default router's pass. Calls → session:",
    ),
    "grpc_io": Variant(
        (), (), (("GRPC_EXPERIMENTS", ""),), (),
        "gRPC's I/O: the default router and the bare relay on gRPC's EventEngine I/O threads (`GRPC_EXPERIMENTS` "
        "empty: gRPC's defaults) against a second router on the same workers with its polled I/O (the console "
        "script's `-event_engine_client,-event_engine_listener`), each rate's load right after the default router's "
        "pass. EventEngine → polled:",
    ),
}


@dataclass(slots=True)
class Sample:
    request_id: str
    sent_at: float
    first_at: float = 0.0
    done_at: float = 0.0
    ok: bool = False
    chunks: int = 0  # messages the client received


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


async def _pass(
    proc: procs.Proc, send: Any, rate: float, duration_s: float, prompts: list[list[int]], tag: str,
    rng: np.random.Generator,
) -> tuple[list[Sample], float, float]:
    """`_drive` through one router process: the samples, the pass's wall seconds and the process's CPU seconds."""
    cpu0, t0 = proc.cpu_seconds(), time.perf_counter()
    samples = await _drive(send, rate, duration_s, prompts, tag, rng)
    return samples, time.perf_counter() - t0, proc.cpu_seconds() - cpu0


async def _via_router(
    client: AsyncRouterClient, s: Sample, prompt: list[int], max_tokens: int, stream_interval: int = 0
) -> None:
    req = make_request(MODEL, token_ids=prompt, max_tokens=max_tokens, ignore_eos=True, request_id=s.request_id,
                       stream_interval_tokens=stream_interval)
    try:
        async for chunk in client.generate(request=req, timeout=60):
            s.chunks += 1
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


def _net_cpu_us(cpu_s: float, idle_cpu_frac: float, wall_s: float, n: int) -> float:
    """A router's CPU µs per request in a pass, less its idle background (Stats polls, ticks) over the pass."""
    return max(0.0, cpu_s - idle_cpu_frac * wall_s) / max(1, n) * 1e6


def _gathered_cells(s: dict[str, Any]) -> str:
    """A step's default pass against its gathered one: rate, chunks, net CPU and its ratio, added TTFT (table cells)."""
    g, a, ga = s["gathered"], s["added_ttft_ms"], s["gathered"]["added_ttft_ms"]
    net, gnet = s.get("router_cpu_us_per_request_net"), g.get("router_cpu_us_per_request_net")
    cpu = "- | -" if net is None or gnet is None else f"{net:.0f} → {gnet:.0f} | ×{gnet / max(net, 1e-9):.2f}"
    return (f"| {s['offered_rate']:g} | {s['chunks_per_request']:.1f} → {g['chunks_per_request']:.1f} | {cpu} "
            f"| {a['p50']:.2f} / {a['p99']:.2f} → {ga['p50']:.2f} / {ga['p99']:.2f} |")  # fmt: skip


LAG_SUM, LAG_COUNT = "switchyard_event_loop_lag_seconds_sum", "switchyard_event_loop_lag_seconds_count"
INTERVAL = "switchyard_stream_interval_tokens"


async def _scrape(session: Any, metrics_address: str) -> dict[str, float]:
    """A router's loop-lag sum and count and its stream interval now, from its /metrics."""
    async with session.get(f"http://{metrics_address}/metrics") as r:
        text = await r.text()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name in (LAG_SUM, LAG_COUNT, INTERVAL)}  # fmt: skip


def _loop_lag_ms(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean loop lag between two scrapes, ms."""
    n = after[LAG_COUNT] - before[LAG_COUNT]
    return (after[LAG_SUM] - before[LAG_SUM]) / n * 1e3 if n > 0 else 0.0


def _variant_cells(s: dict[str, Any]) -> str:
    """A step's default router (the old setting) against the variant one (table cells)."""
    g, a, ga = s["variant"], s["added_ttft_ms"], s["variant"]["added_ttft_ms"]
    rc, rs = s["router_cpu_us_per_request_net"], g["router_cpu_us_per_request_net"]
    wc, ws = s["workers_cpu_us_per_request"], g["workers_cpu_us_per_request"]
    return (
        f"| {s['offered_rate']:g} | {s['achieved_rate']:.1f} → {g['achieved_rate']:.1f} "
        f"| {s['num_ok']}/{s['num_requests']} → {g['num_ok']}/{g['num_requests']} | {rc:,.0f} → {rs:,.0f} "
        f"| ×{rs / rc if rc else float('nan'):.2f} | {wc:,.0f} → {ws:,.0f} | ×{ws / wc if wc else float('nan'):.2f} "
        f"| {a['p50']:.2f} / {a['p99']:.2f} → {ga['p50']:.2f} / {ga['p99']:.2f} |"
    )


def _adaptive_cells(s: dict[str, Any]) -> str:
    """A step's default router against the adaptive one (table cells)."""
    g, a, ga = s["adaptive"], s["added_ttft_ms"], s["adaptive"]["added_ttft_ms"]
    return (f"| {s['offered_rate']:g} | {s['achieved_rate']:.1f} → {g['achieved_rate']:.1f} "
            f"| {s['num_ok']}/{s['num_requests']} → {g['num_ok']}/{g['num_requests']} "
            f"| {s['chunks_per_request']:.1f} → {g['chunks_per_request']:.1f} (interval {g['interval_at_end']:g} at the end) "
            f"| {s['router_cpu_us_per_request_net']:.0f} → {g['router_cpu_us_per_request_net']:.0f} "
            f"| {s['loop_lag_ms']:.2f} → {g['loop_lag_ms']:.2f} "
            f"| {a['p50']:.2f} / {a['p99']:.2f} → {ga['p50']:.2f} / {ga['p99']:.2f} "
            f"| {s['added_ttft_ms_second_half']['p99']:.2f} → {g['added_ttft_ms_second_half']['p99']:.2f} |")  # fmt: skip


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
    second_half_ms = []  # of the requests sent in the pass's second half: an adaptive router's interval has risen
    half = (samples[0].sent_at + samples[-1].sent_at) / 2 if samples else 0.0
    prompt_tokens = cached_tokens = 0
    for s in samples:
        w = timings.get(s.request_id)
        if s.ok and s.first_at and w and w["first_token_at"]:
            client_ttft = s.first_at - s.sent_at
            worker_ttft = w["first_token_at"] - w["received_at"]
            added_ms.append((client_ttft - worker_ttft) * 1e3)
            if s.sent_at >= half:
                second_half_ms.append(added_ms[-1])
            prompt_tokens += w.get("prompt_tokens", 0)
            cached_tokens += w.get("cached_prompt_tokens", 0)
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
        "added_ttft_ms_second_half": dist(second_half_ms),
        "num_matched": len(added_ms),  # samples matched to a worker timing record
        "hit_ratio": cached_tokens / prompt_tokens if prompt_tokens else 0.0,  # prefix-cached prompt tokens
        "chunks_per_request": sum(s.chunks for s in samples if s.ok) / ok if ok else 0.0,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rates = [float(r) for r in args.rates.split(",")]
    if args.peers and (reason := peers.missing_reason()):
        raise SystemExit(f"bench live --peers: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="switchyard-live-"))
    logs = [tmp / f"worker{i}.jsonl" for i in range(args.workers)]
    workers = [
        procs.start(
            f"worker{i}",
            ["worker", "sim", "--port", "0", "--worker-id", f"w{i}", "--model", MODEL, "--profile", args.profile,
             "--time-scale", str(args.time_scale), "--timings-log", str(logs[i]), "--log-level", "WARNING",
             *(PEER_WORKER_ARGS if args.peers else ())],
        )
        for i in range(args.workers)
    ]
    router_args = ["serve", "--port", "0", "--admin-port", "0", "--metrics-port", "0", "--policy", args.policy,
                   "--log-level", "WARNING"]
    for w in workers:
        router_args += ["--worker", w.address]
    chosen = [key for key in VARIANTS if getattr(args, key)]
    if len(chosen) > 1:
        raise SystemExit("bench live: --worker-session and --grpc-io compare one thing at a time")
    variant_key = chosen[0] if chosen else None
    variant = VARIANTS[variant_key] if variant_key else None
    old_env = dict(variant.old_env) if variant else {}
    if variant:  # every router (the adaptive one too) on the old setting but the variant one
        router_args += variant.old_args
    router = procs.start("router", router_args, env=old_env)
    second = (procs.start("router-variant", [*router_args, *variant.new_args]) if variant else None)  # fmt: skip
    adaptive = (procs.start("router-adaptive", [*router_args, "--set",
                                                f"server.stream_interval_max_tokens={args.adaptive_interval}"],
                            env=old_env)
                if args.adaptive_interval > 1 else None)  # fmt: skip
    relay = procs.start("relay", ["bench", "relay", *itertools.chain.from_iterable(("--worker", w.address)
                                                                                    for w in workers),
                                  *(variant.relay_args if variant else ())], env=old_env)  # as the first router
    result: dict[str, Any] = {"policy": args.policy, "workers": args.workers, "profile": args.profile,
                              "duration_s": args.duration, "prompt_len": args.prompt_len,
                              "output_len": args.output_len, "stream_interval": args.stream_interval,
                              "adaptive_interval": args.adaptive_interval,
                              "variant": variant_key, "steps": []}
    rng = np.random.default_rng(args.seed)
    routers = [p for p in (router, relay, adaptive, second) if p is not None]
    limits = contextlib.ExitStack()
    if args.router_cpu_limit:  # each router process its own limit, as a pod each
        for p in routers:
            limits.enter_context(cpu_limit.cpu_limited(p.pid, args.router_cpu_limit, p.name))
        result["router_cpu_limit"] = args.router_cpu_limit
    with procs.running([*workers, *routers]), limits:
        async with (
            AsyncRouterClient(router.address, admin_address=router.extra.get("admin")) as client,
            AsyncRouterClient(relay.address) as relay_client,
            contextlib.AsyncExitStack() as more,
            aiohttp.ClientSession() as http,
        ):
            await _wait_routable(client, args.workers)
            seconds = [p for p in (adaptive, second) if p is not None]  # the second routers, each its own pass
            second_clients = {}  # by process name
            for p in seconds:
                second_clients[p.name] = await more.enter_async_context(
                    AsyncRouterClient(p.address, admin_address=p.extra.get("admin"))
                )
                await _wait_routable(second_clients[p.name], args.workers)
            channels = [grpc.aio.insecure_channel(w.address) for w in workers]
            stubs = [worker_pb2_grpc.WorkerStub(c) for c in channels]
            # Warm-up: connections, code paths, caches.
            warm = _prompts(rng, 20, args.prompt_len, args.prefix_groups)
            await _drive(lambda s, p: _via_router(client, s, p, args.output_len), 20, 1.0, warm, "warm", rng)
            await _drive(lambda s, p: _via_router(relay_client, s, p, args.output_len), 20, 1.0, warm, "wrelay", rng)
            for name, c in second_clients.items():
                await _drive(lambda s, q, c=c: _via_router(c, s, q, args.output_len), 20, 1.0, warm, f"w{name}", rng)
            # Background CPU (Stats polls, health, ticks) with no traffic, to separate it from per-request work.
            cpu0, t0 = router.cpu_seconds(), time.perf_counter()
            second_cpu0 = {p.name: p.cpu_seconds() for p in seconds}
            await asyncio.sleep(args.idle_probe_s)
            idle_s = time.perf_counter() - t0
            idle_cpu_frac = (router.cpu_seconds() - cpu0) / idle_s
            second_idle_cpu_frac = {p.name: (p.cpu_seconds() - second_cpu0[p.name]) / idle_s for p in seconds}
            result["router_idle_cpu_frac"] = idle_cpu_frac
            for rate in rates:
                # each pass gets its own prompts (fresh prefixes): the routed pass must not find the direct pass's
                # prompts in the workers' caches, so its hit ratio compares with the peers' (caches flushed)
                count = int(rate * args.duration) + 1
                prompts = _prompts(rng, count, args.prompt_len, args.prefix_groups)
                routed_prompts = _prompts(rng, count, args.prompt_len, args.prefix_groups)
                relay_prompts = _prompts(rng, count, args.prompt_len, args.prefix_groups)
                rr = itertools.cycle(stubs)
                t0 = time.perf_counter()
                direct = await _drive(
                    lambda s, p, rr=rr: _direct(next(rr), s, p, args.output_len),
                    rate, args.duration, prompts, f"d{rate:g}", rng,
                )
                direct_wall = time.perf_counter() - t0
                relayed, relay_wall, relay_cpu_s = await _pass(
                    relay, lambda s, p: _via_router(relay_client, s, p, args.output_len),
                    rate, args.duration, relay_prompts, f"b{rate:g}", rng,
                )
                lag0 = await _scrape(http, router.extra["metrics"])
                workers_cpu0 = sum(w.cpu_seconds() for w in workers)
                routed, routed_wall, cpu_s = await _pass(
                    router, lambda s, p: _via_router(client, s, p, args.output_len),
                    rate, args.duration, routed_prompts, f"r{rate:g}", rng,
                )
                routed_workers_cpu_s = sum(w.cpu_seconds() for w in workers) - workers_cpu0
                routed_lag_ms = _loop_lag_ms(lag0, await _scrape(http, router.extra["metrics"]))
                if adaptive:  # the second router, requests that leave the interval to it
                    adaptive_prompts = _prompts(rng, count, args.prompt_len, args.prefix_groups)
                    lag0 = await _scrape(http, adaptive.extra["metrics"])
                    adapted, adaptive_wall, adaptive_cpu_s = await _pass(
                        adaptive, lambda s, p: _via_router(second_clients[adaptive.name], s, p, args.output_len),
                        rate, args.duration, adaptive_prompts, f"a{rate:g}", rng,
                    )
                    adaptive_lag1 = await _scrape(http, adaptive.extra["metrics"])
                if second:  # the variant's second router, on the new setting
                    second_prompts = _prompts(rng, count, args.prompt_len, args.prefix_groups)
                    workers_cpu0 = sum(w.cpu_seconds() for w in workers)
                    varied, second_wall, second_cpu_s = await _pass(
                        second, lambda s, p: _via_router(second_clients[second.name], s, p, args.output_len),
                        rate, args.duration, second_prompts, f"s{rate:g}", rng,
                    )
                    second_workers_cpu_s = sum(w.cpu_seconds() for w in workers) - workers_cpu0
                if args.stream_interval > 1:  # the same router and load, each request asking for gathered chunks
                    gathered_prompts = _prompts(rng, count, args.prompt_len, args.prefix_groups)
                    gathered, gathered_wall, gathered_cpu_s = await _pass(
                        router, lambda s, p: _via_router(client, s, p, args.output_len, args.stream_interval),
                        rate, args.duration, gathered_prompts, f"g{rate:g}", rng,
                    )
                timings = _read_timings(logs)
                step = _step_result(routed, timings, rate, routed_wall)
                step["router_cpu_us_per_request"] = cpu_s / max(1, len(routed)) * 1e6
                step["router_cpu_us_per_request_net"] = _net_cpu_us(cpu_s, idle_cpu_frac, routed_wall, len(routed))
                step["loop_lag_ms"] = routed_lag_ms
                step["workers_cpu_us_per_request"] = routed_workers_cpu_s / max(1, len(routed)) * 1e6
                if second:
                    step["variant"] = _step_result(varied, timings, rate, second_wall)
                    step["variant"]["router_cpu_us_per_request_net"] = _net_cpu_us(
                        second_cpu_s, second_idle_cpu_frac[second.name], second_wall, len(varied))  # fmt: skip
                    step["variant"]["workers_cpu_us_per_request"] = second_workers_cpu_s / max(1, len(varied)) * 1e6
                if adaptive:
                    step["adaptive"] = _step_result(adapted, timings, rate, adaptive_wall)
                    step["adaptive"]["router_cpu_us_per_request_net"] = _net_cpu_us(
                        adaptive_cpu_s, second_idle_cpu_frac[adaptive.name], adaptive_wall, len(adapted))  # fmt: skip
                    step["adaptive"]["loop_lag_ms"] = _loop_lag_ms(lag0, adaptive_lag1)
                    step["adaptive"]["interval_at_end"] = adaptive_lag1[INTERVAL]
                if args.stream_interval > 1:
                    step["gathered"] = _step_result(gathered, timings, rate, gathered_wall)
                    step["gathered"]["router_cpu_us_per_request_net"] = _net_cpu_us(
                        gathered_cpu_s, idle_cpu_frac, gathered_wall, len(gathered))  # fmt: skip
                step["direct"] = _step_result(direct, timings, rate, direct_wall)
                step["relay"] = _step_result(relayed, timings, rate, relay_wall)
                step["relay"]["cpu_us_per_request"] = relay_cpu_s / max(1, len(relayed)) * 1e6
                result["steps"].append(step)
                a, d, b = step["added_ttft_ms"], step["direct"]["added_ttft_ms"], step["relay"]["added_ttft_ms"]
                print(
                    f"rate {rate:7.1f}/s  ok {step['num_ok']}/{step['num_requests']}  "
                    f"router-added TTFT p50 {a['p50']:.2f} ms p99 {a['p99']:.2f} ms  "
                    f"(bare relay p50 {b['p50']:.2f} p99 {b['p99']:.2f}; "
                    f"direct-to-worker gRPC p50 {d['p50']:.2f} p99 {d['p99']:.2f})  "
                    f"router CPU {step['router_cpu_us_per_request']:.0f} us/req "
                    f"({step['router_cpu_us_per_request_net']:.0f} net of idle background)",
                    flush=True,
                )
                if "adaptive" in step:
                    g = step["adaptive"]
                    print(
                        f"  adaptive interval (max {args.adaptive_interval}): ok {g['num_ok']}/{g['num_requests']}  "
                        f"router-added TTFT p50 {g['added_ttft_ms']['p50']:.2f} ms p99 {g['added_ttft_ms']['p99']:.2f} "
                        f"ms (second half {g['added_ttft_ms_second_half']['p99']:.2f}, default router "
                        f"{step['added_ttft_ms_second_half']['p99']:.2f})  "
                        f"{g['chunks_per_request']:.1f} chunks/req (interval {g['interval_at_end']:g} at the end)  "
                        f"loop lag {g['loop_lag_ms']:.2f} ms (default router {step['loop_lag_ms']:.2f})  "
                        f"router CPU {g['router_cpu_us_per_request_net']:.0f} us/req net of idle",
                        flush=True,
                    )
                if "variant" in step:
                    g = step["variant"]
                    print(
                        f"  {result['variant']} (new): ok {g['num_ok']}/{g['num_requests']}  router-added TTFT p50 "
                        f"{g['added_ttft_ms']['p50']:.2f} ms p99 {g['added_ttft_ms']['p99']:.2f} ms  router CPU "
                        f"{g['router_cpu_us_per_request_net']:.0f} us/req net of idle (old "
                        f"{step['router_cpu_us_per_request_net']:.0f})  workers' CPU "
                        f"{g['workers_cpu_us_per_request']:.0f} us/req (old {step['workers_cpu_us_per_request']:.0f})",
                        flush=True,
                    )
                if "gathered" in step:
                    g = step["gathered"]
                    print(
                        f"  stream interval {args.stream_interval}: ok {g['num_ok']}/{g['num_requests']}  "
                        f"router-added TTFT p50 {g['added_ttft_ms']['p50']:.2f} ms p99 {g['added_ttft_ms']['p99']:.2f} "
                        f"ms  {g['chunks_per_request']:.1f} chunks/req (against {step['chunks_per_request']:.1f})  "
                        f"router CPU {g['router_cpu_us_per_request_net']:.0f} us/req net of idle",
                        flush=True,
                    )
            for c in channels:
                await c.close()
        if args.peers:
            result["peers"] = await run_peers(args, workers, logs, rates, result)
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
        "| offered req/s | achieved req/s | ok | router-added TTFT p50 ms | p99 ms | bare relay p50 ms | p99 ms "
        "| direct gRPC p50 ms | p99 ms | router CPU us/req | net of idle | relay CPU us/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in result["steps"]:
        a, d, b = s["added_ttft_ms"], s["direct"]["added_ttft_ms"], s["relay"]["added_ttft_ms"]
        lines.append(
            f"| {s['offered_rate']:g} | {s['achieved_rate']:.1f} | {s['num_ok']}/{s['num_requests']} "
            f"| {a['p50']:.2f} | {a['p99']:.2f} | {b['p50']:.2f} | {b['p99']:.2f} | {d['p50']:.2f} | {d['p99']:.2f} "
            f"| {s['router_cpu_us_per_request']:.0f} | {s['router_cpu_us_per_request_net']:.0f} "
            f"| {s['relay']['cpu_us_per_request']:.0f} |"
        )
    gathered = [s for s in result["steps"] if "gathered" in s]
    if gathered:
        n = result["stream_interval"]
        lines += [
            "",
            f"Stream interval {n} (`GenerateRequest.stream_interval_tokens`: the first token alone, then chunks of "
            f"at least {n}), the same router and load, measured after each step's default pass:",
            "",
            "| offered req/s | chunks/req, default → gathered | router CPU us/req net, default → gathered | ratio "
            "| router-added TTFT p50 / p99 ms, default → gathered |",
            "|---|---|---|---|---|",
        ]
        lines += [_gathered_cells(s) for s in gathered]
    varied = [s for s in result["steps"] if "variant" in s]
    if varied:
        lines += [
            "",
            VARIANTS[result["variant"]].heading,
            "",
            "| offered req/s | achieved req/s | ok | router CPU us/req net | ratio | workers' CPU us/req | ratio "
            "| router-added TTFT p50 / p99 ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_variant_cells(s) for s in varied]
    adapted = [s for s in result["steps"] if "adaptive" in s]
    if adapted:
        lines += [
            "",
            f"Adaptive stream interval: a second router with `server.stream_interval_max_tokens = "
            f"{result['adaptive_interval']}` (chunks grow while its event loop lags more than "
            "`server.stream_lag_target_ms`), the same workers and load right after the default router's pass; "
            "requests do not choose an interval. Default router → adaptive one:",
            "",
            "| offered req/s | achieved req/s | ok | chunks/req | router CPU us/req net | mean loop lag ms "
            "| router-added TTFT p50 / p99 ms | p99 ms, second half of the pass |",
            "|---|---|---|---|---|---|---|---|",
        ]
        lines += [_adaptive_cells(s) for s in adapted]
    lines += [
        "",
        f"Saturation rate: {result['saturation_rate']} req/s. Router idle background CPU: "
        f"{100 * result['router_idle_cpu_frac']:.1f}% of a core. Router-added TTFT = client TTFT - worker TTFT "
        "(worker timestamps); 'direct gRPC' is the same measure with the client talking to the workers directly; "
        "'bare relay' through `bench relay` (the router's Generate on the same grpc.aio/uvloop stack, round-robin, no "
        "admission, policy or metrics): the floor of a Python gRPC router.",
        f"Each request: {result['prompt_len']}-token prompt, {result['output_len']} output tokens streamed."
        + (f" Each router process limited to {result['router_cpu_limit']:g} cores (a CFS quota in its own cgroup)."
           if result.get("router_cpu_limit") else ""),
        "",
    ]
    if result.get("peers"):
        lines += [peers_markdown(result["peers"]), ""]
    return "\n".join(lines)


def plot(result: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [s["offered_rate"] for s in result["steps"]]
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("p50", "router-added p50"), ("p99", "router-added p99")):
        ax.plot(rates, [s["added_ttft_ms"][key] for s in result["steps"]], marker="o", label=label)
    ax.plot(rates, [s["relay"]["added_ttft_ms"]["p50"] for s in result["steps"]], ls=":", marker="s",
            label="bare relay p50 (Python gRPC floor)")
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


# ---------------------------------------------------------------- peers mode (smg, vllm-router over HTTP)

# Workers in peers mode also serve the HTTP facade and publish vLLM-format ZMQ KV events (bound, ephemeral
# ports; the READY line reports them), and hash blocks with vLLM's sha256 chain: vllm-router kv_aware recomputes
# it from the rendered token ids and matches it against the event hashes (xxhash workers get no credit).
PEER_WORKER_ARGS = ("--http-port", "0", "--kv-events-endpoint", "tcp://127.0.0.1:*",
                    "--kv-replay-endpoint", "tcp://127.0.0.1:*", "--hash-algo", "sha256")  # fmt: skip


def _word_pool() -> list[str]:
    """Whole-word vocabulary pieces (one token each), so an N-word text prompt is about N tokens."""
    from switchyard.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    words = []
    for i in range(tok.vocab_size):
        piece = tok.id_to_piece(i)
        if piece.startswith("\u2581") and piece[1:].isascii() and piece[1:].isalpha() and len(piece) >= 4:
            words.append(piece[1:])
    return words


def _text_prompts(rng: np.random.Generator, words: list[str], n: int, prompt_len: int, groups: int) -> list[str]:
    """The text twin of `_prompts`: a shared prefix per group (half the prompt), the rest unique."""
    half = prompt_len // 2
    prefixes = [" ".join(words[j] for j in rng.integers(0, len(words), half)) for _ in range(max(groups, 1))]
    rest = prompt_len - half - 1
    return [
        prefixes[i % len(prefixes)] + " " + " ".join(words[j] for j in rng.integers(0, len(words), rest))
        for i in range(n)
    ]


async def _via_http(
    session: Any, url: str, s: Sample, prompt: str, max_tokens: int, stream_interval: int = 0
) -> None:
    """One streaming /v1/completions request; the response `id` (= X-Request-Id) keys the worker timings.
    `stream_interval`: vLLM's field of that name (0: not sent), which smg and vllm-router pass on."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if stream_interval:
        body["stream_interval"] = stream_interval
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": s.request_id}) as r:
            if r.status != 200:
                await r.read()
                return
            async for line in r.content:
                if line.startswith(b"data: {"):
                    s.chunks += 1  # SSE events, the usage event included
                    if not s.first_at:
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            s.first_at = time.time()
                            s.request_id = chunk.get("id") or s.request_id
        s.done_at = time.time()
        s.ok = bool(s.first_at)
    except (TimeoutError, OSError, ValueError, aiohttp.ClientError):
        s.ok = False


async def _http_json(session: Any, method: str, url: str) -> Any:
    async with session.request(method, url) as r:
        return await r.json(content_type=None) if r.status == 200 else None


async def run_peers(
    args: argparse.Namespace, workers: list[procs.Proc], logs: list[Path], rates: list[float],
    result: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """The same rates through smg and vllm-router (and straight to the workers) over HTTP."""
    eps = [peers.WorkerEndpoints(w.extra["http"], w.extra.get("zmq", ""), w.extra.get("zmq_replay", ""))
           for w in workers]  # fmt: skip
    words = _word_pool()
    out: dict[str, Any] = {"transport": "http", "runs": [], "stream_interval": args.stream_interval}
    tmp = logs[0].parent
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        info = await _http_json(session, "GET", f"{eps[0].url}/get_server_info")
        block_size = int(info["block_size"]) if info else 16
        out["block_size"] = block_size

        async def flush() -> None:
            for ep in eps:
                async with session.post(f"{ep.url}/flush_cache") as r:
                    if r.status != 200:
                        print(f"warning: {ep.url}/flush_cache: {r.status} {await r.text()}", flush=True)

        async def steps(label: str, policy: str, send: Any, proc: Any, seed: int) -> dict[str, Any]:
            rng = np.random.default_rng(seed)
            await flush()
            warm = _text_prompts(rng, words, 20, args.prompt_len, args.prefix_groups)
            await _drive(lambda s, p: send(s, p, 0), 20, 1.0, warm, f"{label}-{policy}-warm", rng)
            run: dict[str, Any] = {"router": label, "policy": policy, "steps": []}
            if proc is not None:
                cpu0, t0 = proc.cpu_seconds(), time.perf_counter()
                await asyncio.sleep(args.idle_probe_s)
                run["router_idle_cpu_frac"] = (proc.cpu_seconds() - cpu0) / (time.perf_counter() - t0)
                run["pid"] = proc.pid
            async def one_pass(rate: float, interval: int) -> dict[str, Any]:
                prompts = _text_prompts(rng, words, int(rate * args.duration) + 1, args.prompt_len,
                                        args.prefix_groups)  # fmt: skip
                cpu0 = proc.cpu_seconds() if proc is not None else 0.0
                t0 = time.perf_counter()
                samples = await _drive(lambda s, p: send(s, p, interval), rate, args.duration, prompts,
                                       f"{label}-{policy}-{rate:g}-i{interval}", rng)  # fmt: skip
                wall = time.perf_counter() - t0
                step = _step_result(samples, _read_timings(logs), rate, wall)
                if proc is not None:
                    cpu_s = proc.cpu_seconds() - cpu0
                    step["router_cpu_us_per_request"] = cpu_s / max(1, len(samples)) * 1e6
                    step["router_cpu_us_per_request_net"] = _net_cpu_us(
                        cpu_s, run["router_idle_cpu_frac"], wall, len(samples))  # fmt: skip
                a = step["added_ttft_ms"]
                cpu = f"  CPU {step['router_cpu_us_per_request']:.0f} us/req" if proc is not None else ""
                print(f"[{label} {policy}{f' interval {interval}' if interval else ''}] rate {rate:7.1f}/s  "
                      f"ok {step['num_ok']}/{step['num_requests']}  added TTFT p50 {a['p50']:.2f} ms "
                      f"p99 {a['p99']:.2f} ms  hit {step['hit_ratio']:.2f}  "
                      f"{step['chunks_per_request']:.1f} events/req{cpu}", flush=True)  # fmt: skip
                return step

            for rate in rates:
                step = await one_pass(rate, 0)
                if args.stream_interval > 1:  # the same router and load, each request asking for gathered events
                    step["gathered"] = await one_pass(rate, args.stream_interval)
                run["steps"].append(step)
            return run

        rr = itertools.cycle([ep.url for ep in eps])
        out["runs"].append(await steps(
            "direct", "round_robin", lambda s, p, n: _via_http(session, next(rr), s, p, args.output_len, n), None,
            args.seed + 1))  # fmt: skip
        for k, pair in enumerate(args.peer_routers.split(",")):
            name, policy = pair.split(":")
            log_path = tmp / f"{name}-{policy}.log"
            router = peers.start_router(name, policy, eps, block_size, MODEL, log_path)
            try:
                out["runs"].append(await steps(
                    name, policy, lambda s, p, n, u=router.url: _via_http(session, u, s, p, args.output_len, n),
                    router, args.seed + 2 + k))  # fmt: skip
            finally:
                router.stop()
            out["runs"][-1]["log"] = str(log_path)
    # Switchyard's own steps (gRPC) as the first rows of the side-by-side table.
    out["switchyard"] = {"router": "switchyard", "policy": result["policy"], "transport": "grpc",
                         "steps": result["steps"]}  # fmt: skip
    # and the bare relay's (the floor of a Python gRPC router, no routing logic), with its CPU per request
    out["relay"] = {"router": "bare relay", "policy": "round_robin", "transport": "grpc", "steps": [
        {**s["relay"], "router_cpu_us_per_request": s["relay"]["cpu_us_per_request"]} for s in result["steps"]]}
    print(peers_markdown(out), flush=True)
    return out


def peers_markdown(p: dict[str, Any]) -> str:
    lines = [
        "## Side by side: Switchyard (gRPC) vs smg vs vllm-router (HTTP), same workers",
        "",
        "| router | policy | transport | offered req/s | ok | router-added TTFT p50 ms | p99 ms | hit ratio "
        "| router CPU us/req | net of idle |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    runs = [*(p[k] for k in ("switchyard", "relay") if p.get(k)), *p["runs"]]
    for run in runs:
        transport = run.get("transport", p.get("transport", "http"))
        for s in run["steps"]:
            a = s["added_ttft_ms"]
            cpu = s.get("router_cpu_us_per_request")
            net = s.get("router_cpu_us_per_request_net")
            lines.append(
                f"| {run['router']} | {run['policy']} | {transport} | {s['offered_rate']:g} "
                f"| {s['num_ok']}/{s['num_requests']} | {a['p50']:.2f} | {a['p99']:.2f} | {s['hit_ratio']:.2f} "
                f"| {'-' if cpu is None else f'{cpu:.0f}'} | {'-' if net is None else f'{net:.0f}'} |"
            )
    lines += [
        "",
        "Router-added TTFT = client TTFT - worker TTFT (the worker's own receive / first-token timestamps). "
        "'direct' is the same measure with the client talking HTTP to the workers (round-robin): the HTTP "
        "baseline for smg and vllm-router; Switchyard's own direct-gRPC baseline is in the table above. 'bare relay': "
        "`bench relay`, the router's Generate on Switchyard's grpc.aio/uvloop stack with no routing logic. "
        "Hit ratio: prefix-cached / prompt tokens, from the workers' timings. Router CPU from /proc/<pid>/stat.",
    ]
    gathered = [(run, s) for run in runs for s in run["steps"] if "gathered" in s]
    if gathered:
        n = p["stream_interval"]
        lines += [
            "",
            f"Stream interval {n}, each router and load measured again right after its default pass, every request "
            f"asking for chunks of at least {n} tokens after the first (gRPC `stream_interval_tokens`; HTTP: vLLM's "
            "`stream_interval` field, which smg and vllm-router pass on to the workers):",
            "",
            "| router | policy | offered req/s | chunks (events)/req, default → gathered | router CPU us/req net, "
            "default → gathered | ratio | router-added TTFT p50 / p99 ms, default → gathered |",
            "|---|---|---|---|---|---|---|",
        ]
        lines += [f"| {run['router']} | {run['policy']} {_gathered_cells(s)}" for run, s in gathered]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard bench live", description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--rates", default="25,50,100,200,400", help="offered loads, req/s")
    p.add_argument("--duration", type=float, default=15.0, help="seconds per rate step")
    p.add_argument("--policy", default=None,
                   help="Switchyard's routing policy (default: least_request, the cheapest, to measure the router's "
                   "own overhead; with --peers the router's default, switchyard, to compare prefix-aware routing "
                   "with the peers' on the same shared-prefix workload)")
    p.add_argument("--profile", default="llama2-70b-h100-tp4")
    p.add_argument("--time-scale", type=float, default=0.05, help="worker iteration-time multiplier")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--prefix-groups", type=int, default=8)
    p.add_argument("--stream-interval", type=int, default=0,
                   help="also run each rate with requests asking for chunks of this many tokens (0: no such pass); with "
                   "--peers, through each peer router too (vLLM's `stream_interval` field)")
    p.add_argument("--adaptive-interval", type=int, default=0, metavar="N",
                   help="also run each rate through a second router whose stream interval rises under event-loop "
                   "lag up to N tokens (server.stream_interval_max_tokens; 0: no such router)")
    p.add_argument("--worker-session", action="store_true",
                   help="a pass per rate through a second router sending over one Session stream per worker, "
                        "against the default router's Generate calls")
    p.add_argument("--grpc-io", action="store_true",
                   help="a pass per rate through a second router on gRPC's polled I/O (the console script's default), "
                        "against the default router and the relay on gRPC's EventEngine I/O threads")
    p.add_argument("--router-cpu-limit", type=float, default=0.0, metavar="CORES",
                   help="give each router process (Switchyard's, the adaptive one, the bare relay) at most this many "
                   "cores' CPU time, as a pod's CPU limit (a cgroup CFS quota; needs root; 0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--idle-probe-s", type=float, default=2.0, help="seconds to measure idle router CPU")
    p.add_argument("--out", default="results/live")
    p.add_argument(
        "--peers",
        action="store_true",
        help="also run the same rates through smg (cache_aware, least_load) and vllm-router (cache_aware, "
        "kv_aware) against the same workers over HTTP (needs `make peers-env`)",
    )
    p.add_argument(
        "--peer-routers",
        default="smg:cache_aware,smg:least_load,vllm-router:cache_aware,vllm-router:kv_aware",
        help="router:policy pairs run by --peers",
    )
    return p


def run_and_write(
    run_fn: Callable[[argparse.Namespace], Awaitable[dict[str, Any]]],
    args: argparse.Namespace,
    markdown_fn: Callable[[dict[str, Any]], str],
    plot_fn: Callable[[dict[str, Any], Path], Path],
) -> int:
    """Run a loopback benchmark on uvloop (the daemon's loop; asyncio without it), write results.json, results.md
    and its plot under `args.out`, and print the markdown (`bench live`, `bench soak`)."""
    try:
        import uvloop

        result = uvloop.run(run_fn(args))
    except ImportError:
        result = asyncio.run(run_fn(args))  # type: ignore[arg-type]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2))
    md = markdown_fn(result)
    (out / "results.md").write_text(md)
    png = plot_fn(result, out)
    print(md)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {png}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.policy is None:
        args.policy = "switchyard" if args.peers else "least_request"
    return run_and_write(run, args, markdown, plot)
