"""Random E2 hook sequences for the LRU-index tests: dispatches (inserts, splits, last_access), stores with
parents, tail evictions, clears and gc on chained prompts that share short prefixes."""

from __future__ import annotations

import dataclasses
import random
import zlib
from collections.abc import Iterator

from factories import make_requests

from switchyard.ext import lru_order_py
from switchyard.router.policies.base import Decision, WorkerId
from switchyard.router.policies.preble_e2 import PrebleE2
from switchyard.router.policies.preble_load import LruPricing
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch


class ReferenceLruIndex(LruPricing, lru_order_py.LruIndexCore):
    """E2's LRU index on the reference core (`lru_order_py.LruIndexCore`): what a test patches in as
    `preble_e2.LruIndex` to run E2 on the reference build of every ext/ structure."""

    __slots__ = ()


def chained(labels: list[int]) -> tuple[int, ...]:
    """Chained 64-bit block hashes of a label sequence (equal prefixes, equal hashes)."""
    out, prev = [], 0
    for lab in labels:
        prev = zlib.crc32(f"{prev}:{lab}".encode()) * 65_537 + lab
        out.append(prev & (2**64 - 1))
    return tuple(out)


def random_prompts(rng: random.Random, n: int, labels: int) -> list[tuple[int, ...]]:
    """n prompts of 1-10 blocks: the first 4 blocks from 3 labels (shared prefixes), the rest from `labels`."""
    return [chained([rng.randrange(3) if d < 4 else rng.randrange(labels) for d in range(rng.randint(1, 10))])
            for _ in range(n)]


def drive(
    policy: PrebleE2, rng: random.Random, prompts: list[tuple[int, ...]], workers: list[WorkerId], steps: int,
    tied_times: bool = False, clock: list[float] | None = None, leaves: bool = False,
) -> Iterator[int]:
    """Apply `steps` random hook calls to `policy`, yielding the step number after each (the caller checks its
    invariants there). `tied_times`: half the steps keep the previous timestamp (ties of last_access). `clock`:
    its first item is set to the hooks' time before each yield. `leaves`: a worker also leaves now and then
    (`on_worker_change` without a fleet drops it; its next event or dispatch brings it back)."""
    base = make_requests(1, prompt_len=64, shared_prefix=0, max_tokens=4)[0]
    seq, now = 0, 0.0
    for step in range(steps):
        now += rng.choice([0.0, rng.random()]) if tied_times else rng.random()
        if clock is not None:
            clock[0] = now
        hashes = rng.choice(prompts)
        w = rng.choice(workers)
        op = rng.random()
        if op < 0.35:
            ctx = dataclasses.replace(base, request_id=f"r{step}", block_hashes=hashes)
            policy.on_dispatch(ctx, Decision(worker_id=w), now)
        elif op < 0.7:
            cut = rng.randrange(len(hashes))
            parent = hashes[cut - 1] if cut else None
            end = rng.randint(cut + 1, len(hashes))
            ev = BlockStored(hashes[cut:end], parent, (), 16)
            policy.on_kv_events(w, KvEventBatch(seq := seq + 1, now, (ev,)))
        elif op < 0.93:
            k = rng.randint(1, len(hashes))
            policy.on_kv_events(w, KvEventBatch(seq := seq + 1, now, (BlockRemoved(hashes[-k:]),)))
        elif op < 0.96:
            policy.on_kv_events(w, KvEventBatch(seq := seq + 1, now, (AllBlocksCleared(),)))
        elif op < 0.97 or not leaves:
            policy.gc(now)
        else:
            policy.on_worker_change(w, now)
        yield step
