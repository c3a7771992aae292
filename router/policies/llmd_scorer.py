"""llmd_scorer: llm-d Router's default scheduling profile (weighted scorers + max-score picker), as a peer baseline.

Source: llm-d/llm-d-inference-scheduler (llm-d Router) HEAD 520af47: default profile
`config/charts/epplib/templates/_config.yaml`; scorers `pkg/epp/framework/plugins/scheduling/scorer/{queuedepth,
kvcacheutilization,prefix}/README.md` and the approximate prefix data producer (`approximateprefix`, ex GIE
`plugins/multi/prefix/plugin.go`); specs/peers.md §3. Each scorer maps a worker to [0, 1]; the picker takes

    total_w = 2 * queue_w + 2 * kv_util_w + 3 * prefix_w            argmax, ties uniform at random
    queue_w   = (max_q - q_w) / (max_q - min_q)   over the candidates; 1.0 for all when max_q == min_q
                (q = waiting-queue depth from the last Stats; llm-d scrapes it every 50 ms, `load_poll_s`)
    kv_util_w = 1 - kv_usage_frac_w
    prefix_w  = matched_blocks_w / total_blocks,  total_blocks = min(prompt blocks, max_prefix_blocks)

The prefix scorer is the DEFAULT, approximate one (`prefix-cache-scorer`), not `precise-prefix-cache-scorer`: it
never reads KV events. After each pick it records the request's block hashes under the chosen worker in a
router-side per-worker LRU (capacity = the worker's KV blocks under autoTune, else lru_capacity_per_server) with a
reverse map hash -> workers. matched_blocks_w follows llm-d's greedy scan: walk the prompt's blocks in order, stop
at the first block no worker holds, count for each worker the scanned blocks it holds.
Block hashes: llm-d hashes 16-token blocks approximated as 64 characters (4 chars/token), chained with the model
name; here the request's exact 16-token chained block hashes are used (autoTune picks up vLLM's block size), so
the approximation error of character blocks is absent. Ties are broken by a hash of the request id (llm-d's
max-score picker shuffles). Inactive-pod cleanup (every 2 min) is left to the candidate filter.

Knobs (llm-d defaults): queue_weight 2, kv_util_weight 2, prefix_weight 3, max_prefix_blocks 256,
lru_capacity_per_server 31250, auto_tune True.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from switchyard.router.policies.base import (
    Decision,
    FleetView,
    Policy,
    RoutingContext,
    WorkerId,
    WorkerView,
    candidates,
)
from switchyard.router.policies.smg_least_load import tie_draw

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LlmdScorerConfig:
    queue_weight: float = 2.0
    kv_util_weight: float = 2.0
    prefix_weight: float = 3.0
    max_prefix_blocks: int = 256  # longest prompt prefix considered, blocks
    lru_capacity_per_server: int = 31250  # blocks remembered per worker when not auto-tuned
    auto_tune: bool = True  # capacity = the worker's reported KV blocks
    # "approximate" (the default `prefix-cache-scorer`: what this router sent where) or "precise"
    # (`precise-prefix-cache-scorer`: the workers' KV events, the mode llm-d documents for active-active replicas)
    prefix_scorer: Literal["approximate", "precise"] = "approximate"


class ApproxPrefixIndex:
    """Per-worker LRU of block hashes this router sent there, plus hash -> workers (llm-d's approximate index)."""

    def __init__(self) -> None:
        self._lru: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}

    def add(self, worker_id: str, hashes: Sequence[int], capacity: int) -> None:
        lru = self._lru.setdefault(worker_id, OrderedDict())
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._holders.setdefault(h, set()).add(worker_id)
            while len(lru) > capacity:
                old, _ = lru.popitem(last=False)
                holders = self._holders[old]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[old]

    def match_longest_prefix(self, hashes: Sequence[int]) -> dict[str, int]:
        """llm-d's greedy scan: per worker, how many of the leading (commonly held) blocks it holds."""
        res: dict[str, int] = {}
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            for s in holders:
                res[s] = res.get(s, 0) + 1
        return res

    def num_blocks(self, worker_id: str) -> int:
        return len(self._lru.get(worker_id, ()))

    def sizes(self) -> tuple[int, int]:
        """(distinct block hashes, (worker, hash) entries): what the index holds."""
        return len(self._holders), sum(map(len, self._lru.values()))


class LlmdScorer(Policy):
    name = "llmd_scorer"
    load_poll_s = 0.05  # the EPP's RefreshMetricsInterval (pkg/epp/server/options.go; specs/peers.md §3)

    def __init__(self, config: LlmdScorerConfig | None = None) -> None:
        self.config = config or LlmdScorerConfig()
        self._index: dict[str, ApproxPrefixIndex] = {}  # per model (llm-d chains the model name into hashes)
        # NOTE: a memo of static worker facts (auto-tune's num_gpu_blocks), filled by select because hooks get no
        # fleet; select's result never reads it.
        self._capacity: dict[WorkerId, int] = {}

    def scores(
        self, ctx: RoutingContext, pool: Sequence[WorkerView], fleet: FleetView | None = None
    ) -> list[tuple[float, float, float, float]]:
        """Per worker: (total, queue, kv_util, prefix); `fleet` for the precise prefix scorer."""
        cfg = self.config
        queues = [w.num_waiting for w in pool]
        hi, lo = max(queues), min(queues)
        hashes = ctx.block_hashes[: cfg.max_prefix_blocks]
        matched: Mapping[str, int]
        if cfg.prefix_scorer == "precise":
            if fleet is None:
                raise ValueError("the precise prefix scorer reads the fleet's KV-event index")
            matched = fleet.cached_prefix_blocks(ctx.model, hashes) if hashes else {}
        else:
            index = self._index.get(ctx.model)
            matched = index.match_longest_prefix(hashes) if index and hashes else {}
        out = []
        for w, q in zip(pool, queues, strict=True):
            queue = 1.0 if hi == lo else (hi - q) / (hi - lo)
            kv = 1.0 - w.kv_usage_frac
            prefix = matched.get(w.worker_id, 0) / len(hashes) if hashes else 0.0
            total = cfg.queue_weight * queue + cfg.kv_util_weight * kv + cfg.prefix_weight * prefix
            out.append((total, queue, kv, prefix))
        return out

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        if self.config.auto_tune:
            for w in pool:
                if w.kv_capacity_blocks > 0:
                    self._capacity.setdefault(w.worker_id, w.kv_capacity_blocks)
        rows = self.scores(ctx, pool, fleet)
        best = max(r[0] for r in rows)
        tied = [i for i, r in enumerate(rows) if r[0] == best]
        i = tied[tie_draw(ctx, len(tied), "llmd")] if len(tied) > 1 else tied[0]
        if log.isEnabledFor(logging.DEBUG):
            cfg = self.config
            for w, (t, q, k, p) in zip(pool, rows, strict=True):
                log.debug("request=%s llmd_scorer worker=%s total %.3f = %.0f*queue %.3f + %.0f*kv %.3f + "
                          "%.0f*prefix %.3f", ctx.request_id, w.worker_id, t, cfg.queue_weight, q,
                          cfg.kv_util_weight, k, cfg.prefix_weight, p)
            log.debug("request=%s llmd_scorer -> %s (ties %d)", ctx.request_id, pool[i].worker_id, len(tied))
        total, q, k, p = rows[i]
        return Decision(worker_id=pool[i].worker_id, reason=f"score={total:.3f} q={q:.2f} kv={k:.2f} prefix={p:.2f}")

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        hashes = ctx.block_hashes[: self.config.max_prefix_blocks]
        if not hashes or self.config.prefix_scorer == "precise":
            return
        capacity = self.config.lru_capacity_per_server
        if self.config.auto_tune:
            capacity = self._capacity.get(decision.worker_id, capacity)
        self._index.setdefault(ctx.model, ApproxPrefixIndex()).add(decision.worker_id, hashes, capacity)

    def state_sizes(self) -> dict[str, int]:
        sizes = [index.sizes() for index in self._index.values()]
        # entries are bounded by the LRU capacity per worker; blocks count a hash held by several workers once
        return {"index_blocks": sum(b for b, _ in sizes), "index_entries": sum(e for _, e in sizes)}
