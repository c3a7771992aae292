"""Micro-benchmark of a fresh KV-event subscription (`switchyard bench snapshot`): what a router replica started
later, or a worker reconnecting after a health loss, costs the router's event loop while it takes in a worker's
whole cache, and the worker its own loop while it reads its cache (the snapshot is built in a thread).

A simulated engine's cache is filled with seeded prompts (a fraction of them behind one shared prefix) until it
evicts. Then the worker's `KvEventHub` builds the snapshot a new subscriber gets (BlockStored chains in batches of
at most `SNAPSHOT_BATCH_BLOCKS`), and the router's per-batch work is timed for each policy: parse the message,
decode it (`api.kv_batch_from_proto`), `Fleet.apply_kv_events`, `policy.on_kv_events`. The baseline in the same
run is the format before chains: the same blocks, one BlockStored each, in one message. Nothing here overlaps:
in the daemon every millisecond of a batch is a stall of every stream.

Quick: `switchyard bench snapshot --blocks 8000`. Full (a default-profile cache, ~10 s on 2 cores):
`switchyard bench snapshot`. Writes results/micro-snapshot/snapshot.{json,md,png} and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from switchyard.bench.micro.output import grouped_bars, write_outputs
from switchyard.router import api
from switchyard.router.fleet import Fleet, WorkerInfo, WorkerState
from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.registry import make_policy
from switchyard.v1 import worker_pb2
from switchyard.workers.engine import kv_events as kv
from switchyard.workers.engine.core import EngineConfig, EngineCore
from switchyard.workers.engine.profiles import DEFAULT_PROFILE, get_profile
from switchyard.workers.engine.types import EngineRequest
from switchyard.workers.sim_worker import SNAPSHOT_BATCH_BLOCKS, KvEventHub, event_to_proto

GRPC_DEFAULT_MAX_RECEIVE = 4 * 1024 * 1024  # bytes: grpc's default max_receive_message_length
WORKER = WorkerId("w0")
MODEL = "m"


def fill(core: EngineCore, prompt_tokens: int, shared_tokens: int, shared_every: int, seed: int) -> int:
    """Run one-token requests until the cache has evicted: every `shared_every`-th prompt is all its own, the
    rest start with the same `shared_tokens`. Returns the number of requests run."""
    bs = core.config.block_size
    rng = random.Random(seed)
    own_blocks = (prompt_tokens - shared_tokens) // bs
    n = core.config.num_kv_blocks // max(own_blocks, 1) + 2
    t = 0.0
    for i in range(n):
        shared = [] if i % shared_every == 0 else [7] * shared_tokens
        prompt = tuple(shared + [rng.randrange(1, 32000) for _ in range(prompt_tokens - len(shared))])
        core.add_request(EngineRequest(f"fill-{i}", prompt, 1, t))
        while core.has_unfinished():
            step = core.step(t)
            assert step is not None
            t += step.duration_s
        core.take_kv_events()
    return n


def per_block(events: list[kv.KvEvent]) -> list[kv.KvEvent]:
    """The format before chains: each block of `events`' BlockStored chains announced alone."""
    out: list[kv.KvEvent] = []
    for ev in events:
        if not isinstance(ev, kv.BlockStored):
            out.append(ev)
            continue
        parent, bs = ev.parent_block_hash, ev.block_size
        for i, h in enumerate(ev.block_hashes):
            out.append(kv.BlockStored((h,), parent, ev.token_ids[i * bs : (i + 1) * bs], bs, ev.lora_name))
            parent = h
    return out


async def worker_side(hub: KvEventHub) -> dict[str, Any]:
    """The servicer's path: `subscribe` on the loop (it reads the cache), then the batches built in a thread, as
    `KvEvents` does, while a ticker on the loop records its longest wait: what the engine's loop felt."""
    gaps: list[float] = []
    running = True

    async def ticker() -> None:
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    gaps.clear()
    t0 = time.perf_counter()
    _, make = hub.subscribe(0, 0.0)
    t1 = time.perf_counter()
    batches = await asyncio.to_thread(make)
    t2 = time.perf_counter()
    running = False
    await task
    return {
        "batches": batches,
        "worker_capture_ms": round((t1 - t0) * 1e3, 1),
        "worker_build_ms": round((t2 - t1) * 1e3, 1),
        "worker_loop_longest_wait_ms": round(max(gaps) * 1e3, 1),
    }


def router_side(wire: list[bytes], policy_name: str, capacity: int, block_size: int) -> dict[str, Any]:
    """Feed the messages to a fresh fleet and policy as the registry does; time each batch."""
    fleet = Fleet()
    fleet.add_worker(
        WorkerInfo(worker_id=WORKER, model=MODEL, max_model_len=131072, block_size=block_size,
                   kv_capacity_blocks=capacity, perf_profile=DEFAULT_PROFILE),
        state=WorkerState.READY,
        healthy=True,
    )
    policy = make_policy(policy_name)
    policy.on_worker_change(WORKER, 0.0)
    times = []
    for raw in wire:
        t = time.perf_counter()
        batch = api.kv_batch_from_proto(worker_pb2.KvEventBatch.FromString(raw))
        fleet.apply_kv_events(WORKER, batch)
        policy.on_kv_events(WORKER, batch)
        times.append(time.perf_counter() - t)
    tree = getattr(policy, "tree", None)
    index = fleet.prefix_index(MODEL)
    assert index is not None
    return {
        "policy": policy_name,
        "router_total_ms": round(sum(times) * 1e3, 2),
        "router_longest_batch_ms": round(max(times) * 1e3, 2),
        "tree_nodes": tree.num_nodes if tree is not None else None,
        "blocks_in_view": index.num_blocks(WORKER),
    }


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    core = EngineCore(EngineConfig(num_kv_blocks=args.blocks), get_profile(args.profile))
    requests = fill(core, args.prompt_tokens, args.shared_tokens, args.shared_every, args.seed)
    worker = asyncio.run(worker_side(KvEventHub(core.capture_kv_snapshot)))
    chained = [m.SerializeToString() for m in worker.pop("batches")]
    events = [kv.AllBlocksCleared(), *core.snapshot_kv_events()]
    one_each = [worker_pb2.KvEventBatch(seq=1, ts=0.0, events=[event_to_proto(e) for e in per_block(events)])]
    formats = {"chains": chained, "one event per block": [m.SerializeToString() for m in one_each]}
    rows = []
    for fmt, wire in formats.items():
        for name in args.policies:
            row = {
                "format": fmt,
                "batches": len(wire),
                "events": sum(len(worker_pb2.KvEventBatch.FromString(w).events) for w in wire),
                "mib": round(sum(map(len, wire)) / 2**20, 2),
                "largest_message_mib": round(max(map(len, wire)) / 2**20, 2),
                "over_grpc_default": max(map(len, wire)) > GRPC_DEFAULT_MAX_RECEIVE,
                **{k: (v if fmt == "chains" else None) for k, v in worker.items()},
                **router_side(wire, name, core.config.num_kv_blocks, core.config.block_size),
            }
            rows.append(row)
    meta = {
        "python": platform.python_version(), "machine": platform.machine(), "profile": args.profile,
        "kv_blocks": core.config.num_kv_blocks, "requests": requests, "prompt_tokens": args.prompt_tokens,
        "shared_tokens": args.shared_tokens, "shared_every": args.shared_every, "seed": args.seed,
        "snapshot_batch_blocks": SNAPSHOT_BATCH_BLOCKS,
    }
    return meta, rows


def to_markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [
        f"Snapshot of a full {meta['profile']} cache ({meta['kv_blocks']:,} KV blocks, {meta['requests']} "
        f"prompts of {meta['prompt_tokens']} tokens).\n",
        "| format | policy | batches | events | MiB (largest message) "
        "| worker ms: capture on its loop / build in a thread / its loop's longest wait "
        "| router ms, all / longest batch | E2 tree nodes | blocks in the fleet's view |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        over = ", **over gRPC's 4 MiB**" if r["over_grpc_default"] else ""
        worker = "—" if r["worker_capture_ms"] is None else (
            f"{r['worker_capture_ms']} / {r['worker_build_ms']} / {r['worker_loop_longest_wait_ms']}")
        nodes = "—" if r["tree_nodes"] is None else f"{r['tree_nodes']:,}"
        lines.append(
            f"| {r['format']} | {r['policy']} | {r['batches']} | {r['events']:,} "
            f"| {r['mib']} ({r['largest_message_mib']}{over}) | {worker} "
            f"| {r['router_total_ms']} / {r['router_longest_batch_ms']} | {nodes} | {r['blocks_in_view']:,} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path:
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    series = [
        (f"{fmt}: longest batch", [next(r["router_longest_batch_ms"] * 1e3 for r in rows
                                        if r["format"] == fmt and r["policy"] == p) for p in policies])
        for fmt in dict.fromkeys(r["format"] for r in rows)
    ]
    return grouped_bars(path, policies, series, "Router event-loop stall while taking in one worker's snapshot",
                        log=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench snapshot", description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default=DEFAULT_PROFILE, help="the worker's performance profile (KV capacity)")
    ap.add_argument("--blocks", type=int, default=None, help="override the profile's KV blocks")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--shared-tokens", type=int, default=512, help="the shared prefix of most prompts")
    ap.add_argument("--shared-every", type=int, default=4, help="every n-th prompt shares nothing")
    ap.add_argument("--policies", nargs="+", default=["e2", "switchyard", "round_robin"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("results/micro-snapshot"), help="output folder")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    meta, rows = measure(args)
    write_outputs(args.out, "snapshot", meta, rows, to_markdown(meta, rows),
                  None if args.no_plot else lambda p: plot(rows, p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
