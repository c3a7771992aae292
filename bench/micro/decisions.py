"""Routing-decision throughput of each policy on its own (`switchyard bench decisions`): no tokenizer, no engine,
no gRPC. A stream of `RoutingContext`s (token ids and the workers' block hashes from `PromptFactory`) over Preble's
workloads is fed to `policy.select` + `on_dispatch`, in virtual time, over a `Fleet` of READY workers with Stats.

What the workers would send is modelled so the policies' state grows as it would live: after a modelled prefill
the chosen worker's newly cached blocks arrive as a `BlockStored` batch (its LRU cache of `kv_capacity_blocks`
evicts tail blocks first and sends `BlockRemoved`), `on_first_token` then, `on_finish` after a modelled decode
(so in-flight state stays bounded), Stats every 0.2 s and `on_tick` every 0.1 s. Only `select` and `on_dispatch`
are the decision; the hooks and the fleet's KV index are timed apart ("all hooks", and by kind: KV events, first
token, finish). After the stream, each policy's state is dropped in turn to measure what it added to a full
collection of the cyclic GC, which the daemon runs on its event loop (`gc_full_ms_state`; the stream itself runs
with the collector off, as the simulator).

Compares with Preble's global scheduler [specs/preble.md §8, §10 claim 12]: Toolbench, 50,000 requests, 200 and
1500 tools: 634 and 245 decisions/s; VideoQA with 1500 videos: 2931 decisions/s (their `runtime_selector`, called
sequentially on CPU, 2 GPUs). e2 runs with the Cython radix tree and again with the Python reference (`e2-py`,
what SWITCHYARD_NO_EXTENSIONS=1 selects).

This VM's timings drift by up to ±30% between runs. `--paired` runs the listed policies side by side in one pass
over the same states (the first one's decisions are dispatched to all), once per cyclic shift of their positions,
and reports, per policy, its per-request select and on_dispatch times over the first policy's (`balanced_ratio`:
free of the order they ran in; the geometric mean over the shifts: free of the positions they were built in): e.g.
`--policies e2,e2-py --paired` for the Cython tree's speed-up, `--policies e2@e81af29,e2 --paired` for a change to
E2's modules since that commit (`NAME@REV`: bench/micro/revision.py). A revision's copy of the modules and the
working tree's own ran up to ~1.4% apart with identical code (2026-12-07; ~1.7% in a later pair): for a change
near that size, measure it in both arrangements too (the new code in the tree against `e2@OLD`, and the old code
in the tree against `e2@NEW`) and take the geometric mean.

Quick: `switchyard bench decisions --num-requests 2000`. Paper size (50k toolbench requests; VideoQA ~12.9k
requests = 1500 videos at 8.6 questions each), all policies, 8 and 16 workers: `switchyard bench decisions`
(minutes; mostly e2-py). Writes results/decisions/decisions.{json,md,png} and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import platform
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench.micro.gc_cost import full_collection_ms
from switchyard.bench.micro.output import write_outputs
from switchyard.bench.micro.revision import policy_at
from switchyard.bench.preble_workloads import PrebleSpec, make_toolbench, make_videoqa
from switchyard.bench.traces import PromptFactory, Trace
from switchyard.router.fleet import Fleet, StatsSample, WorkerInfo, WorkerState
from switchyard.router.policies.base import Policy, RoutingContext, WorkerId
from switchyard.router.policies.registry import make_policy
from switchyard.workers.engine.kv_events import BlockRemoved, BlockStored, KvEventBatch

MODEL = "bench-model"
BLOCK_SIZE = 16
STATS_INTERVAL_S = 0.2
TICK_INTERVAL_S = 0.1
VIDEOQA_QUESTIONS_PER_VIDEO = 8.6  # make_videoqa's mean group size

# Preble [P §5.4]: decisions/s of its global scheduler, per workload
PAPER = {"toolbench-200": 634.0, "toolbench-1500": 245.0, "videoqa-1500": 2931.0}


@dataclass(frozen=True, slots=True)
class WorkloadDef:
    name: str
    make: Callable[[int, int], Trace]  # (num_requests, seed) -> trace
    profile: str  # WorkerInfo.perf_profile (e2's cost model)
    kv_capacity_blocks: int  # per worker (the LRU model's size)
    max_requests: int | None = None  # cap on --num-requests (VideoQA: 1500 videos)


def _toolbench(tools: int) -> Callable[[int, int], Trace]:
    # rate 20 req/s: ~3600 requests inside e2's 3-minute history window
    return lambda n, seed: make_toolbench(PrebleSpec(num_requests=n, rate=20.0, num_tools=tools, max_model_len=4096), seed)


WORKLOADS: dict[str, WorkloadDef] = {
    # llama2-70b-h100-tp4: 31,030 blocks of 16 per worker
    "toolbench-200": WorkloadDef("toolbench-200", _toolbench(200), "llama2-70b-h100-tp4", 31_030),
    "toolbench-1500": WorkloadDef("toolbench-1500", _toolbench(1500), "llama2-70b-h100-tp4", 31_030),
    # ~9.9k-token prompts; 20,000 blocks per worker as in `bench suite`
    "videoqa-1500": WorkloadDef(
        "videoqa-1500",
        lambda n, seed: make_videoqa(PrebleSpec(num_requests=n, rate=5.0), seed),
        "llama3-8b-a100",
        20_000,
        max_requests=round(1500 * VIDEOQA_QUESTIONS_PER_VIDEO),
    ),
}
DEFAULT_POLICIES = ("e2", "e2-py", "smg_cache_aware", "dynamo_kv", "round_robin")


def make_bench_policy(name: str) -> Policy:
    """A registry policy; `e2-py` = e2 on the Python reference radix tree; `NAME@REV` = the policy's modules as
    git revision REV wrote them (`bench/micro/revision.py`)."""
    if "@" in name:
        base, rev = name.split("@", 1)
        return policy_at(base, rev)
    if name == "e2-py":
        from switchyard.ext import radix_py

        pol = make_policy("e2")
        pol.tree = radix_py.RadixTree()  # type: ignore[attr-defined]
        return pol
    return make_policy(name)


# ---------------------------------------------------------------------------------------------------- requests
@dataclass(slots=True)
class Prepared:
    """A trace with its prompts precomputed once (shared by every run): token ids as uint16, hashes as uint64."""

    trace: Trace
    tokens: list[np.ndarray]
    hashes: list[np.ndarray]
    prep_s: float

    def context(self, i: int) -> tuple[RoutingContext, int]:
        """(context, output tokens) of request i; its tuples are built here, outside any timed region, when the
        request arrives (after the events before it), as the router builds them on admission."""
        r, toks, hs = self.trace.requests[i], self.tokens[i], self.hashes[i]
        ctx = RoutingContext(
            request_id=r.request_id,
            model=MODEL,
            prompt_token_ids=tuple(toks.tolist()),
            block_hashes=tuple(hs.tolist()),
            max_tokens=r.num_output_tokens,
            arrival_s=r.arrival_s,
        )
        return ctx, r.num_output_tokens


def prepare(wl: WorkloadDef, num_requests: int, seed: int) -> Prepared:
    t0 = time.perf_counter()
    n = min(num_requests, wl.max_requests) if wl.max_requests else num_requests
    trace = wl.make(n, seed)
    pf = PromptFactory(BLOCK_SIZE, seed=seed)
    tokens, hashes = [], []
    for r in trace.requests:
        toks = pf.tokens(r)
        tokens.append(np.asarray(toks, dtype=np.uint16))
        hashes.append(np.asarray(pf.block_hashes(r, toks), dtype=np.uint64))
    return Prepared(trace, tokens, hashes, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------------------- worker model
class WorkerModel:
    """One worker's prefix cache as its KV events describe it: an LRU of block hashes, tail blocks evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.seq = 0
        self.in_flight = 0

    def store(self, ctx: RoutingContext, now: float) -> KvEventBatch | None:
        """The batch the worker sends once `ctx`'s prefill ran: its new blocks, then what the LRU evicted."""
        hs = ctx.block_hashes
        lru = self.lru
        k = 0
        while k < len(hs) and hs[k] in lru:
            k += 1
        for h in reversed(hs):  # the prompt's head ends most recent: its tail is evicted first
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
        lru_new = hs[k:]
        events: list[Any] = []
        if lru_new:
            events.append(
                BlockStored(
                    block_hashes=tuple(lru_new),
                    parent_block_hash=hs[k - 1] if k else None,
                    token_ids=ctx.prompt_token_ids[k * BLOCK_SIZE : len(hs) * BLOCK_SIZE],
                    block_size=BLOCK_SIZE,
                )
            )
        if len(lru) > self.capacity:
            gone = [lru.popitem(last=False)[0] for _ in range(len(lru) - self.capacity)]
            events.append(BlockRemoved(block_hashes=tuple(gone)))
        if not events:
            return None
        self.seq += 1
        return KvEventBatch(seq=self.seq, ts=now, events=tuple(events))


def prefill_s(num_prompt_tokens: int, cached_blocks: int) -> float:
    """Modelled prefill: 5 ms + 0.1 ms per uncached token (order of a 70B TP4 / 8B TP2 prefill)."""
    return 0.005 + 1e-4 * max(0, num_prompt_tokens - cached_blocks * BLOCK_SIZE)


DECODE_S_PER_TOKEN = 0.03


# ---------------------------------------------------------------------------------------------------- one run
def _pct_us(samples_ns: np.ndarray, q: float) -> float:
    return float(np.percentile(samples_ns, q)) / 1000.0 if len(samples_ns) else 0.0


def _state_size(policy: Policy, fleet: Fleet) -> tuple[str, int]:
    tree = getattr(policy, "tree", None)
    if tree is not None and not callable(tree) and hasattr(tree, "num_nodes"):
        return "tree nodes", int(tree.num_nodes)
    trees = getattr(policy, "_trees", None)
    if isinstance(trees, dict):  # smg_cache_aware's approximate token trees
        count, stack = 0, [t.root for t in trees.values()]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return "tree nodes", count
    index = fleet.prefix_index(MODEL)
    return "indexed blocks", index.num_hashes() if index is not None else 0


def preload(fleet: Fleet, policies: list[Policy], workers: dict[WorkerId, WorkerModel], num_nodes: int) -> None:
    """Grow the state to `num_nodes` more tree nodes before the stream: unrelated 2-block prompts, each with a
    fresh first block (one leaf node each), stored round-robin on the workers and sent as their KV events. They
    are cold (never requested), so the workers' LRUs evict them first once the workload fills the caches."""
    rng = np.random.default_rng(0x5EED)
    hashes = rng.integers(1, 2**63, size=(num_nodes, 2), dtype=np.uint64)
    tokens = rng.integers(0, 32_000, size=(num_nodes, 2 * BLOCK_SIZE), dtype=np.int64)
    wids = list(workers)
    for j in range(num_nodes):
        wid = wids[j % len(wids)]
        ctx = RoutingContext(request_id=f"preload-{j}", model=MODEL, prompt_token_ids=tuple(tokens[j].tolist()),
                             block_hashes=tuple(hashes[j].tolist()), max_tokens=1, arrival_s=0.0)
        batch = workers[wid].store(ctx, 0.0)
        if batch is not None:
            fleet.apply_kv_events(wid, batch)
            for policy in policies:
                policy.on_kv_events(wid, batch)


def run_one(
    prep: Prepared, wl: WorkloadDef, policy_name: str, num_workers: int, preload_nodes: int = 0
) -> dict[str, Any]:
    """One policy's run: its row."""
    return run_side_by_side(prep, wl, [policy_name], num_workers, preload_nodes)[0]


def run_side_by_side(
    prep: Prepared, wl: WorkloadDef, policy_names: list[str], num_workers: int, preload_nodes: int = 0,
    shift: int = 0,
) -> list[dict[str, Any]]:
    """Each policy's row (in `policy_names`' order), all of them run in one pass over the same states (`--paired`).

    Every policy gets every hook, in an order that rotates too (unrotated, the first policy's hooks read ~15%
    slower than an identical second's); at each arrival each one selects on the same fleet state, timed on its
    own, in an order that rotates by request (so none is always the first after a hook's cache misses); the first
    policy's decision is dispatched, to the fleet and to every policy's `on_dispatch` (in the same rotating order:
    unrotated, the first policy's dispatch ran ~20% slower than an identical second's). The others are thus
    priced on the first one's trajectory: the paired ratios compare the cost of the same decisions (two builds or
    configurations of one policy decide alike) free of this VM's run-to-run drift. With one policy this is the
    plain run.

    `shift`: the pass's positions (construction, and the rotations' phase) are the names' order shifted cyclically
    by it, the first name's decisions still dispatched and still the ratios' base. NOTE: the rotations do not
    cancel everything positional: two copies of one code read the second-listed ~1.3% slower in both listing
    orders (2026-12-07, full videoqa), so `main` runs one pass per shift and combines their ratios.
    """
    names = policy_names[shift % len(policy_names):] + policy_names[:shift % len(policy_names)]
    policies = [make_bench_policy(name) for name in names]
    k = len(policies)
    b = names.index(policy_names[0])  # the base's position: its decisions are dispatched
    fleet = Fleet()
    workers: dict[WorkerId, WorkerModel] = {}
    for i in range(num_workers):
        wid = WorkerId(f"w{i}")
        fleet.add_worker(
            WorkerInfo(worker_id=wid, model=MODEL, max_model_len=131072, block_size=BLOCK_SIZE,
                       kv_capacity_blocks=wl.kv_capacity_blocks, max_num_seqs=256, perf_profile=wl.profile),
            state=WorkerState.READY,
            healthy=True,
        )
        workers[wid] = WorkerModel(wl.kv_capacity_blocks)
        for policy in policies:
            policy.on_worker_change(wid, 0.0)
    if preload_nodes:
        preload(fleet, policies, workers, preload_nodes)
    start_states = [_state_size(policy, fleet)[1] for policy in policies]

    n = len(prep.trace.requests)
    select_ns = np.zeros((k, n), dtype=np.int64)
    dispatch_ns = np.zeros((k, n), dtype=np.int64)
    # the hooks by kind: KV events (the fleet's ingestion, charged to every policy, + on_kv_events), on_first_token,
    # on_finish (+ the fleet's note_done); their sum is "all hooks"
    kv_ns, first_ns, finish_ns = [0] * k, [0] * k, [0] * k
    tick_ns = [0] * k
    max_tick_ns = [0] * k
    pending: list[tuple[float, int, int, Any]] = []  # (t, kind 0=first token 1=finish, seq, payload)
    seq = 0
    next_stats = 0.0
    next_tick = TICK_INTERVAL_S
    clock = time.perf_counter_ns
    gc_was = gc.isenabled()
    gc.collect()
    gc.disable()  # as the simulator: long-lived small objects, no per-request cycles
    try:
        for i, req in enumerate(prep.trace.requests):
            now = req.arrival_s
            # everything that happened before this arrival, in time order
            while True:
                t_ev = pending[0][0] if pending else float("inf")
                t = min(t_ev, next_stats, next_tick)
                if t > now:
                    break
                fleet.set_time(t)
                if t == t_ev:
                    _, kind, _, payload = heapq.heappop(pending)
                    if kind == 0:
                        c, wid, t_fin, outs = payload
                        batch = workers[wid].store(c, t)
                        t0 = clock()
                        if batch is not None:
                            fleet.apply_kv_events(wid, batch)
                        fleet_ns = clock() - t0
                        for r in range(k):  # rotated as the selects (the first pays the others' misses)
                            j = (seq + r) % k
                            policy = policies[j]
                            t0 = clock()
                            if batch is not None:
                                policy.on_kv_events(wid, batch)
                            t1 = clock()
                            policy.on_first_token(c.request_id, wid, t)
                            kv_ns[j] += t1 - t0 + fleet_ns
                            first_ns[j] += clock() - t1
                        seq += 1
                        heapq.heappush(pending, (t_fin, 1, seq, (c.request_id, wid, outs)))
                    else:
                        rid, wid, outs = payload
                        workers[wid].in_flight -= 1
                        t0 = clock()
                        fleet.note_done(wid)
                        fleet_ns = clock() - t0
                        for r in range(k):
                            j = (seq + r) % k
                            policy = policies[j]
                            t0 = clock()
                            policy.on_finish(rid, wid, t, outs)
                            finish_ns[j] += clock() - t0 + fleet_ns
                elif t == next_stats:
                    for wid, wm in workers.items():
                        fleet.apply_stats(
                            wid,
                            StatsSample(num_running=wm.in_flight, kv_blocks_used=len(wm.lru),
                                        kv_blocks_total=wm.capacity),
                            t,
                        )
                    next_stats = t + STATS_INTERVAL_S
                else:
                    for r in range(k):
                        j = (i + r) % k
                        policy = policies[j]
                        t0 = clock()
                        policy.on_tick(t)
                        dt = clock() - t0
                        tick_ns[j] += dt
                        max_tick_ns[j] = max(max_tick_ns[j], dt)
                    next_tick = t + TICK_INTERVAL_S
            fleet.set_time(now)
            ctx, out_tokens = prep.context(i)
            decisions: list[Any] = [None] * k
            for r in range(k):
                j = (i + r) % k
                t0 = clock()
                decisions[j] = policies[j].select(ctx, fleet, now)
                select_ns[j, i] = clock() - t0
            decision = decisions[b]
            if decision is None:
                raise RuntimeError(f"{policy_names[0]} chose no worker for {ctx.request_id}")
            fleet.note_dispatch(decision.worker_id)
            for r in range(k):  # rotated too: the first after the selects pays their cache misses
                j = (i + r) % k
                t0 = clock()
                policies[j].on_dispatch(ctx, decision, now)
                dispatch_ns[j, i] = clock() - t0
            wid = decision.worker_id
            wm = workers[wid]
            wm.in_flight += 1
            # prefill against what this worker really holds (its LRU), then decode
            hs = ctx.block_hashes
            h = 0
            while h < len(hs) and hs[h] in wm.lru:
                h += 1
            t_first = now + prefill_s(ctx.num_prompt_tokens, h)
            seq += 1
            heapq.heappush(pending, (t_first, 0, seq, (ctx, wid, t_first + DECODE_S_PER_TOKEN * out_tokens, out_tokens)))
    finally:
        if gc_was:
            gc.enable()
    rows = []
    for j, (name, policy) in enumerate(zip(names, policies, strict=True)):
        sel, dis = select_ns[j], dispatch_ns[j]
        decide_s = (sel.sum() + dis.sum()) / 1e9
        hooks_ns = kv_ns[j] + first_ns[j] + finish_ns[j]
        state_kind, state = _state_size(policy, fleet)
        row = {
            "workload": wl.name,
            "workers": num_workers,
            "policy": name,
            "requests": n,
            "decisions_per_s": n / decide_s if decide_s > 0 else float("inf"),
            "select_only_per_s": n / (sel.sum() / 1e9) if sel.sum() else float("inf"),
            "with_hooks_per_s": n / (decide_s + hooks_ns / 1e9),
            "select_p50_us": round(_pct_us(sel, 50), 1),
            "select_p99_us": round(_pct_us(sel, 99), 1),
            "select_mean_us": round(float(sel.mean()) / 1000, 1) if n else 0.0,
            "select_max_ms": round(float(sel.max()) / 1e6, 2) if n else 0.0,
            "dispatch_p50_us": round(_pct_us(dis, 50), 1),
            "dispatch_p99_us": round(_pct_us(dis, 99), 1),
            "hooks_us_per_request": round(hooks_ns / 1000 / n, 1),
            "kv_events_us_per_request": round(kv_ns[j] / 1000 / n, 1),
            "first_token_us_per_request": round(first_ns[j] / 1000 / n, 1),
            "finish_us_per_request": round(finish_ns[j] / 1000 / n, 1),
            "tick_total_ms": round(tick_ns[j] / 1e6, 1),
            "tick_max_ms": round(max_tick_ns[j] / 1e6, 2),
            "state_kind": state_kind,
            "state_size": state,
            "state_size_at_start": start_states[j],
            "virtual_s": round(prep.trace.duration_s, 1),
            "paper_decisions_per_s": PAPER.get(wl.name),
        }
        if k > 1:
            row["paired_with"] = policy_names[0]
            row["paired_shift"] = shift % k
            row["paired_select_ratio"] = round(balanced_ratio(sel, select_ns[b], k), 3)
            row["paired_dispatch_ratio"] = round(balanced_ratio(dis, dispatch_ns[b], k), 3)
        rows.append(row)
    # what each policy's state adds to a full collection (a stall of the daemon's loop): dropped one by one
    policy = None  # type: ignore[assignment]  # the loop's last: the list holds the only references
    prev = full_collection_ms()
    for j, row in enumerate(rows):
        policies[j] = None  # type: ignore[call-overload]
        cur = full_collection_ms()
        row["gc_full_ms_state"] = round(max(0.0, prev - cur), 1)
        prev = cur
    return [rows[names.index(name)] for name in policy_names]


def balanced_ratio(times: np.ndarray, base: np.ndarray, k: int) -> float:
    """A policy's per-request time over the first policy's, free of the order they ran in: the median ratio
    over the requests that ran in each of the k rotated orders (request i's order is i mod k), then the geometric
    mean of those k medians.

    NOTE: why: whoever runs first after a hook pays the cache misses, so the per-request ratio is bimodal (two
    identical e2s on videoqa's first 3,000 requests at 16 workers: medians ×0.633 with the first policy first,
    ×1.545 with it second), and the median of all requests falls in the gap between the modes (×0.824 there).
    Each order's median carries its positions' factors; over the k orders every position pairs with every other
    once, so their product cancels and the geometric mean is the ratio itself (×0.988 there, ×1.002 in a rerun)."""
    ratio = times / np.maximum(base, 1)
    order = np.arange(len(ratio)) % k
    medians = [float(np.median(ratio[order == g])) for g in range(k) if np.any(order == g)]
    return float(np.exp(np.mean(np.log(np.maximum(medians, 1e-9)))))


def cpu_times() -> tuple[int, int] | None:
    """(steal, total) jiffies of the whole machine from /proc/stat; None where there is none (not Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields[:8])


def steal_frac(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """Share of the machine's CPU time the hypervisor took between two `cpu_times` (None when unknown)."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median select p50 (the lower middle for an even count), with every run's figures; a paired
    row's ratios are the geometric mean of its runs' (`main` runs every position shift equally often, so the
    positions' biases cancel in it)."""
    row = dict(sorted(runs, key=lambda r: r["select_p50_us"])[(len(runs) - 1) // 2])
    keys = ["select_p50_us", "select_p99_us", "decisions_per_s", "cpu_steal_frac"]
    if "paired_select_ratio" in row:
        keys += ["paired_select_ratio", "paired_dispatch_ratio", "paired_shift"]
        for key in ("paired_select_ratio", "paired_dispatch_ratio"):
            row[key] = round(float(np.exp(np.mean(np.log([max(r[key], 1e-9) for r in runs])))), 3)
        del row["paired_shift"]
    row["runs"] = {k: [r[k] for r in runs] for k in keys}
    return row


# ---------------------------------------------------------------------------------------------------- report
def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | workers | policy | requests | decisions/s | Preble | ratio | select p50 / p99 / mean µs, max ms "
        "| on_dispatch p50 / p99 µs | with hooks /s | hooks µs/request: KV events, first token, finish "
        "| state at start → end | full GC ms the state adds "
        "| runs: select p50 µs (CPU stolen) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paper = r["paper_decisions_per_s"]
        ratio = f"x{r['decisions_per_s'] / paper:.1f}" if paper else "-"
        lines.append(
            f"| {r['workload']} | {r['workers']} | {r['policy']} | {r['requests']} | {r['decisions_per_s']:,.0f} "
            f"| {paper:,.0f} | {ratio} | {r['select_p50_us']} / {r['select_p99_us']} / {r['select_mean_us']}, "
            f"{r['select_max_ms']} "
            f"| {r['dispatch_p50_us']} / {r['dispatch_p99_us']} | {r['with_hooks_per_s']:,.0f} "
            f"| {r['kv_events_us_per_request']}, {r['first_token_us_per_request']}, {r['finish_us_per_request']} "
            f"| {r['state_size_at_start']:,} → {r['state_size']:,} {r['state_kind']} | {r.get('gc_full_ms_state', '-')} "
            f"| {_runs_cell(r)} |"
        )
    paired = [r for r in rows if "paired_with" in r]
    if paired:
        lines += [
            "",
            "Paired (`--paired`): every policy selected on the same states in one pass, the first one's decisions "
            "dispatched to all (selects and dispatches timed in an order rotating by request); a ratio is its time "
            "over the first policy's per request, the median over each order's requests, then the geometric mean "
            "over the orders (`balanced_ratio`: the first to run pays the cache misses, and this cancels it). "
            "Each repeat is one pass per cyclic shift of the listed order (so every policy is built and run in "
            "every position once), and a row's ratio is the geometric mean of its runs' (listed in pass order).",
            "",
            "| workload | workers | policy | vs | select ratio, each run | on_dispatch ratio, each run "
            "| select p50 / p99 µs | on_dispatch p50 / p99 µs |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in paired:
            sel, dis = (
                ", ".join(f"{x:.3f}" for x in r["runs"][key]) if "runs" in r else f"{r[key]:.3f}"
                for key in ("paired_select_ratio", "paired_dispatch_ratio")
            )
            lines.append(f"| {r['workload']} | {r['workers']} | {r['policy']} | {r['paired_with']} | {sel} | {dis} "
                         f"| {r['select_p50_us']} / {r['select_p99_us']} | {r['dispatch_p50_us']} / "
                         f"{r['dispatch_p99_us']} |")
    return "\n".join(lines) + "\n"


def _runs_cell(r: dict[str, Any]) -> str:
    runs = r.get("runs") or {"select_p50_us": [r["select_p50_us"]], "cpu_steal_frac": [r.get("cpu_steal_frac")]}
    return ", ".join(f"{p50}" + ("" if st is None else f" ({st:.0%})")
                     for p50, st in zip(runs["select_p50_us"], runs["cpu_steal_frac"], strict=True))


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    """Grouped bars (log scale): decisions/s per (workload, workers), one bar per policy, Preble's as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["workload"], r["workers"]) for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["workload"], r["workers"], r["policy"]): r["decisions_per_s"] for r in rows}
    width = 0.8 / max(1, len(policies))
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) + 2), 4.5))
    for j, p in enumerate(policies):
        xs = [g + (j - (len(policies) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [by.get((w, n, p), 0) for w, n in groups], width, label=p)
    for g, (w, _) in enumerate(groups):
        if w in PAPER:
            ax.hlines(PAPER[w], g - 0.45, g + 0.45, colors="black", linestyles="--",
                      label="Preble (paper)" if g == 0 else None)
    ax.set_yscale("log")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{w}\n{n} workers" for w, n in groups], fontsize=8)
    ax.set_ylabel("decisions/s (select + on_dispatch)")
    ax.set_title("Routing decisions per second, one core")
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench decisions", description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated; known: {','.join(WORKLOADS)}")
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES),
                    help="comma-separated registry names; e2-py = e2 on the Python reference tree; NAME@REV = the "
                         "policy's modules at git revision REV (with --paired: a change measured in one run)")
    ap.add_argument("--workers", default="8,16", help="comma-separated fleet sizes")
    ap.add_argument("--num-requests", type=int, default=50_000,
                    help="requests per workload (paper: 50,000; VideoQA is capped at 12,900 = 1500 videos)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preload-nodes", type=int, default=0,
                    help="grow the state by this many cold tree nodes (resident 2-block prompts) before the stream; "
                         "the issue's goal is stated at 100k nodes")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per (workload, workers, policy), the policies interleaved; each row is the run with "
                         "the median select p50, and lists every run's figures (a shared VM's timings drift); with "
                         "--paired, each repeat is one pass per position shift")
    ap.add_argument("--paired", action="store_true",
                    help="run the policies side by side in passes over the same states (the first one's decisions "
                         "dispatched), one per cyclic shift of their positions, and report each one's per-request "
                         "select and on_dispatch ratios to the first (balanced over the rotating order and the "
                         "positions)")
    ap.add_argument("--out", type=Path, default=Path("results/decisions"), help="output folder")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    for w in names:
        if w not in WORKLOADS:
            print(f"bench decisions: unknown workload {w!r}; known: {', '.join(WORKLOADS)}", file=sys.stderr)
            return 2
    if len(set(policies)) < len(policies):  # their runs are grouped by name: twins would fold into one row
        print("bench decisions: a policy is listed twice; for two instances of one code name one NAME@HEAD "
              "(e.g. --policies e2,e2@HEAD)", file=sys.stderr)
        return 2
    for p in policies:
        try:
            make_bench_policy(p)
        except ValueError as e:
            print(f"bench decisions: {e}", file=sys.stderr)
            return 2
    rows: list[dict[str, Any]] = []
    for w in names:
        wl = WORKLOADS[w]
        prep = prepare(wl, args.num_requests, args.seed)
        print(f"{w}: {len(prep.trace.requests)} requests, {prep.trace.source}; prompts built in {prep.prep_s:.1f} s",
              flush=True)
        for nw in sizes:
            runs: dict[str, list[dict[str, Any]]] = {p: [] for p in policies}
            # each repeat runs every policy once, under the same conditions: one after the other (interleaved
            # across repeats), or all in one pass with --paired, once per shift of their positions
            passes = [(policies, s) for s in range(len(policies))] if args.paired else [([p], 0) for p in policies]
            for _ in range(max(1, args.repeat)):
                for group, shift in passes:
                    t0 = time.perf_counter()
                    cpu0 = cpu_times()
                    got = run_side_by_side(prep, wl, group, nw, args.preload_nodes, shift)
                    steal = steal_frac(cpu0, cpu_times())
                    for row in got:
                        row["cpu_steal_frac"] = steal
                        runs[row["policy"]].append(row)
                        paired = (f", x{row['paired_select_ratio']:.3f} of {row['paired_with']} (shift {shift})"
                                  if "paired_with" in row else "")
                        print(f"  {nw:>2} workers {row['policy']:<16} {row['decisions_per_s']:>10,.0f} decisions/s  "
                              f"select p50 {row['select_p50_us']} µs p99 {row['select_p99_us']} µs{paired}  "
                              f"({time.perf_counter() - t0:.1f} s"
                              f"{'' if steal is None else f', {steal:.0%} CPU stolen'})", flush=True)
            rows += [median_run(runs[p]) for p in policies]
        del prep
        gc.collect()
    meta = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
            "num_requests": args.num_requests, "seed": args.seed, "block_size": BLOCK_SIZE,
            "preload_nodes": args.preload_nodes,
            "paper_decisions_per_s": PAPER}
    print()
    draw = None if args.no_plot else lambda path: plot(rows, path)
    write_outputs(args.out, "decisions", meta, rows, to_markdown(rows), draw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
