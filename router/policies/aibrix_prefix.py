"""aibrix_prefix: AIBrix's `prefix-cache` routing algorithm, reimplemented as a peer baseline.

Source: vllm-project/aibrix `pkg/plugins/gateway/algorithms/prefix_cache.go` + `prefix_cache_readme.md` and the
index `pkg/utils/prefixcacheindexer/hash.go` (the versions read for this file, 2026; specs/peers.md §5). Load =
running requests per pod as the gateway counts them (`RealtimeNumRequestsRunning`: dispatched, not finished ->
`in_flight` here).

1. Load gate: imbalanced iff  max_load > imbalance_factor * (mean_load + 1)  and  max_load - min_load >= min_gap.
   Imbalanced -> prefix matching is restricted to the least-loaded pod(s).
2. Prefix match on the router's OWN hash table (block hash -> pods it routed that block to): walk the prompt's
   chained block hashes, a pod stays matched while it holds every block so far;
       match_percent_p = (deepest matched block index + 1) * 100 // num_blocks     (integer percent)
3. Matched pods sorted by match_percent desc, then load asc (shuffled first, so equal keys are random); take the
   first with  load <= mean + stddev_factor * std  (mean and population std over ALL ready pods' loads).
4. No match, or none within the bound -> least-loaded ready pod (ties random).
5. The request's block hashes are recorded under the chosen pod (AddPrefix). The table is one LRU of
   max_blocks entries; entries not touched for eviction_duration_s are dropped every eviction_interval_s (on_tick).

Defaults (source): imbalance_factor 2.0, min_gap 8, stddev_factor 1, max_blocks 200000, eviction 20 min checked
every 1 s, KV-event sync off (so the table is the router's guess, not the engines' caches).
Differences: blocks are the request's 16-token chained block hashes (AIBrix's tokenizer default is characters,
blocks of AIBRIX_PREFIX_CACHE_BLOCK_SIZE; its README recommends 16 for tiktoken tokens); matching does not refresh
LRU recency (select is pure; AddPrefix at dispatch does); random orders come from a hash of the request id.
specs/peers.md summarises an older rule (max - min > 16 -> least running; mean + 2 sigma); the current source's
gate and factor are the defaults here, the older rule is `imbalance_factor=0, min_gap=17, stddev_factor=2`.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from switchyard.router.policies.base import Decision, FleetView, Policy, RoutingContext, candidates
from switchyard.router.policies.smg_least_load import tie_draw

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AibrixPrefixConfig:
    imbalance_factor: float = 2.0  # gate: max > factor * (mean + 1) ...
    imbalance_min_gap: int = 8  # ... and max - min >= gap
    stddev_factor: float = 1.0  # matched pod must have load <= mean + factor * std
    max_blocks: int = 200_000  # entries in the hash table (one LRU for all pods)
    eviction_duration_s: float = 1200.0  # an entry untouched this long is dropped
    eviction_interval_s: float = 1.0


class PrefixHashTable:
    """block hash -> {pod: last access}; one LRU over hashes (AIBrix's PrefixHashTable)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._store: OrderedDict[int, dict[str, float]] = OrderedDict()

    def match(self, hashes: Sequence[int], ready: Collection[str]) -> dict[str, int]:
        """pod -> integer match percent, for pods holding a leading run of `hashes`."""
        alive = set(ready)
        out: dict[str, int] = {}
        n = len(hashes)
        for i, h in enumerate(hashes):
            pods = self._store.get(h)
            if not pods:
                break
            alive = {p for p in alive if p in pods}
            if not alive:
                break
            pct = (i + 1) * 100 // n
            for p in alive:
                out[p] = pct
        return out

    def add(self, hashes: Sequence[int], pod: str, now: float) -> None:
        for h in hashes:
            pods = self._store.get(h)
            if pods is None:
                self._store[h] = {pod: now}
                if len(self._store) > self.capacity:
                    self._store.popitem(last=False)
            else:
                pods[pod] = now
                self._store.move_to_end(h)

    def evict_older_than(self, cutoff: float) -> int:
        # Every add moves a hash to the end, so the front holds the least recently touched: stop at a fresh one.
        n = 0
        while self._store:
            h, pods = next(iter(self._store.items()))
            if max(pods.values()) >= cutoff:
                break
            del self._store[h]
            n += 1
        return n

    def __len__(self) -> int:
        return len(self._store)


class AibrixPrefix(Policy):
    name = "aibrix_prefix"

    def __init__(self, config: AibrixPrefixConfig | None = None) -> None:
        self.config = config or AibrixPrefixConfig()
        self._tables: dict[str, PrefixHashTable] = {}  # per model
        self._last_eviction_s: float | None = None

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        cfg = self.config
        loads = {w.worker_id: w.in_flight for w in pool}
        values = list(loads.values())
        hi, lo = max(values), min(values)
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        gated = hi > cfg.imbalance_factor * (mean + 1) and hi - lo >= cfg.imbalance_min_gap
        ready = [wid for wid, v in loads.items() if v == lo] if gated else list(loads)
        table = self._tables.get(ctx.model)
        matched = table.match(ctx.block_hashes, ready) if table is not None and ctx.block_hashes else {}
        bound = mean + cfg.stddev_factor * std
        pick, reason = None, ""
        if matched:
            order = sorted(matched, key=lambda p: _shuffle_key(ctx, p))  # random order for equal keys
            order.sort(key=lambda p: (-matched[p], loads[p]))
            for p in order:
                if loads[p] <= bound:
                    pick, reason = p, f"prefix_match {matched[p]}% load={loads[p]} <= {bound:.2f}"
                    break
        if pick is None:
            tied = [wid for wid, v in loads.items() if v == lo]
            pick = tied[tie_draw(ctx, len(tied), "aibrix")] if len(tied) > 1 else tied[0]
            reason = ("prefix_match_skipped" if matched else "least_request_fallback") + f" load={lo}"
        log.debug("request=%s aibrix_prefix gate=%s (max %d > %.1f*(%.2f+1) and %d-%d >= %d) matched=%s "
                  "bound=%.2f+%.1f*%.2f -> %s (%s)", ctx.request_id, gated, hi, cfg.imbalance_factor, mean, hi, lo,
                  cfg.imbalance_min_gap, matched, mean, cfg.stddev_factor, std, pick, reason)
        return Decision(worker_id=pick, reason=reason)

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        if ctx.block_hashes:
            table = self._tables.setdefault(ctx.model, PrefixHashTable(self.config.max_blocks))
            table.add(ctx.block_hashes, decision.worker_id, now)

    def state_sizes(self) -> dict[str, int]:
        return {"table_blocks": sum(map(len, self._tables.values()))}  # bounded by `max_blocks` per model

    def on_tick(self, now: float) -> None:
        if self._last_eviction_s is not None and now - self._last_eviction_s < self.config.eviction_interval_s:
            return
        self._last_eviction_s = now
        for table in self._tables.values():
            table.evict_older_than(now - self.config.eviction_duration_s)


def _shuffle_key(ctx: RoutingContext, pod: str) -> bytes:
    return hashlib.blake2b(f"{ctx.request_id}:{ctx.attempt}:{pod}".encode(), digest_size=8).digest()
