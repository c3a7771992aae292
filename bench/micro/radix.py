"""Micro-benchmark of the global prefix radix tree (`switchyard bench radix`): match, insert and a routing
decision (match + a per-worker cost over 16 workers), p50/p99 in µs, Cython build vs Python reference, on
realistic trees of 10k and 100k nodes (shared system prompts, tool/document branches, per-user questions), plus
the insert of a cold video-like prompt (`COLD_BLOCKS` new blocks, a VideoQA dispatch's leaf) into the same tree;
and the fleet's KV-event ingestion (`PrefixIndex.apply`) with each build's per-worker block sets; what the
tree adds to a full collection of the cyclic GC (a stall of the daemon's event loop), with and without it; and
the block index's growth: cold prompts inserted until it holds `--growth-blocks` (doubling on the way), each
insert timed, so a doubling's stall shows as the slowest insert (`--growth-against REV`: that revision's C build
too, in the same run).

Quick (a few seconds): `switchyard bench radix --nodes 10000 --ops 2000`.
Full (about a minute, mostly building the 100k-node trees in Python): `switchyard bench radix`.
Writes results/micro-radix/radix.json and radix.md and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

from switchyard.bench.micro.gc_cost import full_collection_ms
from switchyard.bench.micro.revision import ext_module_at
from switchyard.ext import radix_py
from switchyard.router.prefix_index import PrefixIndex
from switchyard.workers.engine.kv_events import BlockRemoved, BlockStored

try:
    from switchyard.ext import _radix_c
except ImportError:  # pragma: no cover - the table then has the reference only
    _radix_c = None

NUM_WORKERS = 16
COLD_BLOCKS = 600  # a Preble VideoQA video in 16-token blocks (~9.6k tokens)
KEEP_EVERY = 20  # growth runs: the prompts that stay resident when the burst is collected, one in this many
GC_BUDGET_BLOCKS = 2_000  # E2's default `gc_budget_blocks`: a tick's collection
WORKER_IDS = [f"worker-{i}" for i in range(NUM_WORKERS)]


class Workload:
    """Prompts as chained block-hash lists: system prompt -> tool/document -> question (-> follow-up turn).

    Lengths in 16-token blocks: system prompts 16-64, tools 8-48, questions 2-16, follow-ups 2-8; tools are
    picked with Zipf-like skew so some branches are hot. Hashes are random uint64, fixed per prefix.
    """

    def __init__(self, seed: int, num_systems: int = 40, tools_per_system: int = 60) -> None:
        self.rng = random.Random(seed)
        self.systems = [self._blocks(16, 64) for _ in range(num_systems)]
        self.tools = [[self._blocks(8, 48) for _ in range(tools_per_system)] for _ in range(num_systems)]
        self.tool_weights = [1.0 / (i + 1) for i in range(tools_per_system)]
        self.recent: list[list[int]] = []  # earlier prompts, for multi-turn follow-ups

    def _blocks(self, lo: int, hi: int) -> list[int]:
        return [self.rng.getrandbits(64) for _ in range(self.rng.randint(lo, hi))]

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.recent and rng.random() < 0.25:  # a follow-up turn extends an earlier conversation
            base = self.recent[rng.randrange(len(self.recent))]
            out = base + self._blocks(2, 8)
        else:
            s = rng.randrange(len(self.systems))
            tool = rng.choices(self.tools[s], weights=self.tool_weights)[0]
            out = self.systems[s] + tool + self._blocks(2, 16)
        if len(self.recent) < 5000:
            self.recent.append(out)
        else:
            self.recent[rng.randrange(len(self.recent))] = out
        return out


def build(mod: ModuleType, target_nodes: int, seed: int, chained: bool = False) -> tuple[object, Workload, float]:
    """A tree grown to target_nodes by inserting prompts, each assigned and made resident on a worker."""
    tree = mod.RadixTree(chained=chained)
    wl = Workload(seed)
    rng = random.Random(seed + 1)
    now = 0.0
    while tree.num_nodes < target_nodes:
        now += 0.01
        hashes = wl.prompt()
        worker = WORKER_IDS[rng.randrange(NUM_WORKERS)]
        tree.assign(tree.insert(hashes, now), worker, now)
        tree.mark_resident(worker, hashes, None, now)
        if rng.random() < 0.05:  # some tails evicted: partial runs
            tree.mark_evicted(worker, hashes[-rng.randint(1, 4) :])
    return tree, wl, now


def decide(m: object) -> str | None:
    """A stand-in for the cost step: per worker, cached blocks vs missed blocks, lowest cost wins."""
    best, best_cost = None, float("inf")
    resident = m.resident_blocks  # type: ignore[attr-defined]
    assigned = m.assigned_blocks  # type: ignore[attr-defined]
    matched = m.matched_blocks  # type: ignore[attr-defined]
    for i, w in enumerate(WORKER_IDS):
        cost = (matched - max(resident.get(w, 0), assigned.get(w, 0))) * 1e-4 + i * 1e-6
        if cost < best_cost:
            best, best_cost = w, cost
    return best


def pct(samples_ns: list[int], q: float) -> float:
    s = sorted(samples_ns)
    return s[min(len(s) - 1, int(q * len(s)))] / 1000.0


def measure(mod: ModuleType, target_nodes: int, num_ops: int, seed: int, chained: bool = False) -> dict:
    """`chained`: the tree as E2 builds it (walks by the chain: the prompts' hashes are chains)."""
    t0 = time.perf_counter()
    tree, wl, now = build(mod, target_nodes, seed, chained)
    build_s = time.perf_counter() - t0
    num_nodes, num_blocks = tree.num_nodes, tree.num_blocks  # type: ignore[attr-defined]
    queries = [wl.prompt() for _ in range(num_ops)]
    clock = time.perf_counter_ns
    match_ns, decide_ns, insert_ns = [], [], []
    for q in queries:
        t = clock()
        tree.match(q)  # type: ignore[attr-defined]
        match_ns.append(clock() - t)
    for q in queries:
        t = clock()
        decide(tree.match(q))  # type: ignore[attr-defined]
        decide_ns.append(clock() - t)
    for q in queries:
        now += 0.01
        t = clock()
        tree.insert(q, now)  # type: ignore[attr-defined]
        insert_ns.append(clock() - t)
    rng = random.Random(seed + 1)
    cold_ns = []
    for _ in range(max(1, num_ops // 10)):
        q = [rng.getrandbits(64) for _ in range(COLD_BLOCKS)]
        now += 0.01
        t = clock()
        tree.insert(q, now)  # type: ignore[attr-defined]
        cold_ns.append(clock() - t)
    gc_with = full_collection_ms()
    tracked = len(gc.get_objects())
    del tree
    gc_without = full_collection_ms()
    return {
        "impl": ("c" if mod is _radix_c else "py") + ("-chained" if chained else ""),
        "target_nodes": target_nodes,
        "nodes": num_nodes,  # when the timing starts (the insert phase then adds some)
        "blocks": num_blocks,
        "build_s": round(build_s, 2),
        "mean_query_blocks": round(statistics.fmean(len(q) for q in queries), 1),
        "ops": num_ops,
        "match_p50_us": round(pct(match_ns, 0.50), 2),
        "match_p99_us": round(pct(match_ns, 0.99), 2),
        "decision_p50_us": round(pct(decide_ns, 0.50), 2),
        "decision_p99_us": round(pct(decide_ns, 0.99), 2),
        "insert_p50_us": round(pct(insert_ns, 0.50), 2),
        "insert_p99_us": round(pct(insert_ns, 0.99), 2),
        "cold_insert_blocks": COLD_BLOCKS,
        "cold_insert_p50_us": round(pct(cold_ns, 0.50), 2),
        "cold_insert_p99_us": round(pct(cold_ns, 0.99), 2),
        # what the tree adds to a full collection of the cyclic GC: a pause of the daemon's event loop
        "gc_full_ms_with_tree": round(gc_with, 1),
        "gc_full_ms_without": round(gc_without, 1),
        "gc_tracked_by_tree": tracked - len(gc.get_objects()),
    }


def measure_ingest(mod: ModuleType, num_events: int, seed: int) -> dict:
    """The fleet's KV-event ingestion (`PrefixIndex.apply`, run for every worker's every event whatever the policy)
    with this build's per-worker block sets: 16 workers storing 32-block runs and evicting their oldest 32, until
    they hold ~10k blocks each (the events are built first, then timed one by one)."""
    rng = random.Random(seed)
    held: dict[str, list[int]] = {w: [] for w in WORKER_IDS}
    events: list[tuple[str, list[object]]] = []
    for _ in range(num_events):
        w = rng.choice(WORKER_IDS)
        if held[w] and rng.random() < 0.45:
            gone, held[w] = held[w][:32], held[w][32:]
            events.append((w, [BlockRemoved(block_hashes=tuple(gone))]))
        else:
            hs = tuple(rng.getrandbits(64) for _ in range(32))
            held[w] += hs
            events.append((w, [BlockStored(block_hashes=hs, parent_block_hash=None, token_ids=(), block_size=16)]))
    index = PrefixIndex(block_set=mod.BlockSet)
    clock = time.perf_counter_ns
    ns = []
    for w, evs in events:
        t = clock()
        index.apply(w, evs)
        ns.append(clock() - t)
    return {
        "impl": "c" if mod is _radix_c else "py",
        "events": num_events,
        "held_blocks": sum(index.num_blocks(w) for w in WORKER_IDS),
        "event_p50_us": round(pct(ns, 0.50), 2),
        "event_p99_us": round(pct(ns, 0.99), 2),
        "event_mean_us": round(statistics.fmean(ns) / 1000.0, 2),
    }


def _join_page_faulters() -> None:
    for th in threading.enumerate():
        if th.name == "switchyard-radix-grow":
            th.join()


def rss_mib() -> float:
    """This process's resident memory, MiB (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


def index_mib(tree: object) -> float | None:
    """The C build's block index as mapped (None: a build without `index_bytes`, or the reference)."""
    got = getattr(tree, "index_bytes", None)
    return None if got is None else round(got / 2**20, 1)


def measure_growth(mod: ModuleType, label: str, target_blocks: int, seed: int, pace: float = 0.0) -> dict:
    """Cold `COLD_BLOCKS`-block prompts into an empty tree until it holds `target_blocks`, each insert timed: the
    index doubles on the way (a one-shot rehash is one slow insert; a stepwise one spreads over many). `pace`:
    inserts per second (0: back to back, faster than any router dispatches; the C build's next table is then
    still being faulted in when it is due, and the rest of its faults land on the inserts).

    Then the burst is collected: every `KEEP_EVERY`-th prompt stays resident on a worker, the rest expire, and
    `gc` runs as E2's ticks run it (`GC_BUDGET_BLOCKS` per call, called again while the budget is hit) until the
    tree and its index settle: each call timed, the index's and the process's memory at the peak and at the end.
    The ticks run back to back, except that a page-faulting thread of the C build (`switchyard-radix-grow`) is
    waited for before each: 100 ms ticks give it that time."""
    rng = random.Random(seed)
    tree = mod.RadixTree()
    clock = time.perf_counter_ns
    ns: list[int] = []
    kept: list[list[int]] = []
    now = 0.0
    start = time.perf_counter()
    while tree.num_blocks < target_blocks:
        q = [rng.getrandbits(64) for _ in range(COLD_BLOCKS)]
        now += 0.01
        if pace > 0:
            wait = start + len(ns) / pace - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
        t = clock()
        tree.insert(q, now)
        ns.append(clock() - t)
        if len(ns) % KEEP_EVERY == 0:
            kept.append(q)
    grown = tree.num_blocks
    for q in kept:
        tree.mark_resident("w0", q, None, now)
    _join_page_faulters()
    peak_index, peak_rss = index_mib(tree), rss_mib()
    gc_ns: list[int] = []
    settled, now = 0, now + 120.0
    moves = hasattr(tree, "index_bytes")  # a build that gives the index back: settled once no move is under way
    while settled < 3 and len(gc_ns) < 100_000:  # settled: three calls in a row changed nothing
        _join_page_faulters()
        before = (tree.num_blocks, getattr(tree, "index_bytes", 0), getattr(tree, "growing", False))
        t = clock()
        tree.gc(now, 60.0, GC_BUDGET_BLOCKS)
        gc_ns.append(clock() - t)
        now += 0.1
        after = (tree.num_blocks, getattr(tree, "index_bytes", 0), getattr(tree, "growing", False))
        settled = settled + 1 if after == before and not (moves and after[2]) else 0
        if len(gc_ns) % 100 == 0:
            peak_rss = max(peak_rss, rss_mib())
    return {
        "impl": label,
        "pace_per_s": pace,
        "blocks": grown,
        "inserts": len(ns),
        "insert_p50_us": round(pct(ns, 0.50), 2),
        "insert_p99_us": round(pct(ns, 0.99), 2),
        "insert_max_ms": round(max(ns) / 1e6, 2),
        "inserts_over_1ms": sum(1 for x in ns if x > 1_000_000),
        "total_ms": round(sum(ns) / 1e6, 1),
        "kept_blocks": tree.num_blocks,
        "index_mib_peak": peak_index,
        "index_mib_end": index_mib(tree),
        "rss_mib_peak": round(peak_rss, 1),
        "rss_mib_end": round(rss_mib(), 1),
        "gc_calls": len(gc_ns),
        "gc_p99_ms": round(pct(gc_ns, 0.99) / 1000, 2),
        "gc_max_ms": round(max(gc_ns) / 1e6, 2),
    }


def _pace(row: dict) -> str:
    """A growth run's inserts/s, as its tables show it."""
    return f"{row['pace_per_s']:,.0f}" if row["pace_per_s"] > 0 else "back to back"


def collection_markdown(rows: list[dict]) -> str:
    lines = [
        f"| build | inserts/s | blocks kept (1 prompt in {KEEP_EVERY}) | index MiB at the peak → settled "
        f"| RSS MiB at the peak → settled | gc calls ({GC_BUDGET_BLOCKS:,} blocks each) | gc p99 / slowest ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pace = _pace(r)
        idx = "-" if r["index_mib_peak"] is None else f"{r['index_mib_peak']} → {r['index_mib_end']}"
        lines.append(
            f"| {r['impl']} | {pace} | {r['kept_blocks']:,} | {idx} | {r['rss_mib_peak']} → {r['rss_mib_end']} "
            f"| {r['gc_calls']:,} | {r['gc_p99_ms']} / {r['gc_max_ms']} |"
        )
    return "\n".join(lines) + "\n"


def growth_markdown(rows: list[dict]) -> str:
    lines = [
        f"| build | inserts/s | cold {COLD_BLOCKS}-block inserts | blocks at the end | insert p50 / p99 µs "
        "| slowest insert ms | inserts over 1 ms | all inserts ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pace = _pace(r)
        lines.append(
            f"| {r['impl']} | {pace} | {r['inserts']:,} | {r['blocks']:,} | {r['insert_p50_us']} / {r['insert_p99_us']} "
            f"| {r['insert_max_ms']} | {r['inserts_over_1ms']} | {r['total_ms']} |"
        )
    return "\n".join(lines) + "\n"


def ingest_markdown(rows: list[dict]) -> str:
    lines = [
        "| block sets | events (32 blocks each) | blocks held at the end | `PrefixIndex.apply` p50 / p99 / mean µs |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {'BlockSet (C)' if r['impl'] == 'c' else 'set (reference)'} | {r['events']} | {r['held_blocks']} "
            f"| {r['event_p50_us']} / {r['event_p99_us']} / {r['event_mean_us']} |"
        )
    return "\n".join(lines) + "\n"


def to_markdown(rows: list[dict]) -> str:
    lines = [
        "| impl | nodes | blocks | query blocks (mean) | match p50 / p99 µs | decision p50 / p99 µs "
        f"| insert p50 / p99 µs | cold {COLD_BLOCKS}-block insert p50 / p99 µs "
        "| full GC ms with / without the tree (objects it tracks) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['impl']} | {r['nodes']} | {r['blocks']} | {r['mean_query_blocks']} "
            f"| {r['match_p50_us']} / {r['match_p99_us']} | {r['decision_p50_us']} / {r['decision_p99_us']} "
            f"| {r['insert_p50_us']} / {r['insert_p99_us']} | {r['cold_insert_p50_us']} / {r['cold_insert_p99_us']} "
            f"| {r['gc_full_ms_with_tree']} / {r['gc_full_ms_without']} ({r['gc_tracked_by_tree']:,}) |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench radix", description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[10_000, 100_000], help="tree sizes to build")
    ap.add_argument("--ops", type=int, default=5000, help="timed operations per kind and tree")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--impl", choices=["both", "c", "py"], default="both")
    ap.add_argument("--growth-blocks", type=int, default=3_000_000,
                    help="grow an empty tree to this many blocks, cold prompts timed one by one (0: skip)")
    ap.add_argument("--growth-against", metavar="REV", help="also grow the C build of this git revision")
    ap.add_argument("--growth-paces", type=float, nargs="+", default=[0.0, 2000.0],
                    help="inserts per second of each growth run (0: back to back)")
    ap.add_argument("--out", type=Path, default=Path("results/micro-radix"), help="output folder")
    args = ap.parse_args(argv)
    mods = []
    if args.impl in ("both", "c"):
        if _radix_c is None:
            print("switchyard.ext._radix_c is not built; reference only", file=sys.stderr)
        else:
            mods.append(_radix_c)
    if args.impl in ("both", "py"):
        mods.append(radix_py)
    variants = [(mod, False) for mod in mods]
    if _radix_c in mods:
        variants.insert(1, (_radix_c, True))  # E2's: `RadixTree(chained=True)`
    rows = [measure(mod, n, args.ops, args.seed, chained) for n in args.nodes for mod, chained in variants]
    ingest = [measure_ingest(mod, 12 * args.ops, args.seed) for mod in mods]
    md = to_markdown(rows) + "\n" + ingest_markdown(ingest)
    growth: list[dict] = []
    if args.growth_blocks > 0:
        builds = [(mod, "c" if mod is _radix_c else "py") for mod in mods]
        if args.growth_against:
            builds.insert(0, (ext_module_at("_radix_c", args.growth_against), f"c@{args.growth_against}"))
        growth = [measure_growth(mod, label, args.growth_blocks, args.seed, pace)
                  for pace in args.growth_paces for mod, label in builds]
        md += "\n" + growth_markdown(growth) + "\n" + collection_markdown(growth)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"python": platform.python_version(), "machine": platform.machine(), "workers": NUM_WORKERS}
    (args.out / "radix.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "ingest": ingest, "growth": growth}, indent=2) + "\n"
    )
    (args.out / "radix.md").write_text(md)
    print(md, end="")
    print(f"wrote {args.out / 'radix.json'} and {args.out / 'radix.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
