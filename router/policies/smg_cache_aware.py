"""smg_cache_aware: SMG / sglang-router `cache_aware` (the default policy), reimplemented as a peer baseline.

Source: smg-project/smg `model_gateway/src/policies/cache_aware.rs` and its approximate tree (`crates/kv_index`),
in the form the CLI ships and documents (sglang `docs/advanced_features/sgl_model_gateway.md` @5a0cb04; the same
algorithm in sglang-router 0.3.2 and vllm-router 0.1.17; specs/peers.md §1, vllm-and-peer-routers.md §2).

1. Imbalance test on router-local load (`w.load()` = requests this router has in flight on the worker):
       imbalanced  iff  (max_load - min_load) > balance_abs_threshold  and  max_load > balance_rel_threshold * min_load
   Imbalanced -> the least-loaded worker (shortest queue); the tree is still updated with the request.
2. Balanced -> prefix match in the policy's OWN approximate radix tree of what it routed (multi-tenant: each
   node records the workers it sent that prefix to, with a last-access time):
       match_rate = matched_tokens / prompt_tokens
       match_rate > cache_threshold  -> a worker holding the deepest matched node
       otherwise                     -> the worker with the smallest tree (fewest tokens routed to it and not
                                        yet evicted: "most free cache", an approximation)
3. Every dispatch inserts the prompt under the chosen worker. Eviction (on_tick, every eviction_interval_s):
   per worker whose tree exceeds max_tree_size, drop its least-recently-used leaves until it fits.

It never reads KV events or engine stats: its view of a worker's cache is only what it routed there.
Differences from SMG: the tree is over token ids (SMG's HTTP path uses raw characters, its gRPC path page-aligned
tokens; sizes here are in tokens, not chars); ties among holders of the deepest node, and among equally small
trees, are broken by a hash of the request id (SMG takes DashMap iteration order: arbitrary); the tree only
counts routable, non-excluded workers as holders. Current SMG HEAD routes both fallbacks (imbalance and miss) with
its `least_load` expected-wait scorer instead of shortest-queue / smallest-tree; this file is the documented
CLI behaviour.

Knobs (CLI defaults, not the struct defaults 0.5/32/1.1/30 s/10000): cache_threshold 0.3, balance_abs_threshold
64, balance_rel_threshold 1.5, eviction_interval_s 120, max_tree_size 67108864.

`mesh` (registry name `smg_mesh`): SMG's mesh HA for router replicas side by side (`crates/mesh`,
`mesh/adapters/tree_sync.rs`: SWIM gossip of the tree's insert and remove operations, specs/peers.md §1 (8)). Every
replica's inserts reach the others' trees. Here the other replicas' requests come from the workers' request events
(`PeerMirror`, one event lag late: likely sooner than a gossip round, so this favours SMG), which carry block hashes,
not tokens, so in this mode the tree is over the prompt's full blocks, as SMG's gRPC path is page-aligned: matches
count whole blocks (the partial last block never matches). Loads stay per replica: the mesh syncs the tree, not
the in-flight counts.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from switchyard.router.policies.base import (
    Decision,
    FleetView,
    Policy,
    RoutingContext,
    WorkerView,
    candidates,
)
from switchyard.router.policies.smg_least_load import tie_draw

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SmgCacheAwareConfig:
    cache_threshold: float = 0.3  # min match rate (matched / prompt tokens) to follow the tree
    balance_abs_threshold: int = 64  # in-flight requests: max - min must exceed this ...
    balance_rel_threshold: float = 1.5  # ... and max must exceed this x min, to count as imbalanced
    eviction_interval_s: float = 120.0
    max_tree_size: int = 67_108_864  # per worker, tokens (SMG: chars)
    mesh: bool = False  # SMG's mesh: the other replicas' inserts reach this tree (a tree over full blocks)


class _Node:
    __slots__ = ("children", "key", "parent", "tenants", "seq")

    _count = itertools.count()  # creation order: the eviction heap's tie-break (an id() would follow addresses)

    def __init__(self, key: tuple[int, ...], parent: _Node | None) -> None:
        self.seq = next(_Node._count)
        self.key = key  # the edge label: tokens from the parent to this node
        self.parent = parent
        self.children: dict[int, _Node] = {}  # first token -> child
        self.tenants: dict[str, float] = {}  # worker -> last access


def _shared(key: tuple[int, ...], tokens: Sequence[int], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    n = len(key)
    if tuple(tokens[start : start + n]) == key:
        return n
    i = 0
    limit = min(n, len(tokens) - start)
    while i < limit and key[i] == tokens[start + i]:
        i += 1
    return i


class ApproxTree:
    """Multi-tenant radix tree over token ids (SMG's approximate tree). A worker's nodes are prefix-closed: an
    insert touches the whole path, eviction removes a worker from its leaves first."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self.tenant_size: dict[str, int] = {}  # worker -> tokens in the nodes it holds
        self.num_nodes = 0  # below the root
        self.num_keys = 0  # Σ edge lengths: the tokens (or, with `mesh`, the block hashes) the tree holds

    def insert(self, tokens: Sequence[int], tenant: str, now: float) -> None:
        size = self.tenant_size.setdefault(tenant, 0)
        node, i, n = self.root, 0, len(tokens)
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                leaf = _Node(tuple(tokens[i:]), node)
                leaf.tenants[tenant] = now
                node.children[tokens[i]] = leaf
                size += n - i
                self.num_nodes += 1
                self.num_keys += n - i
                break
            k = _shared(child.key, tokens, i)
            if k < len(child.key):  # split: a new parent for the shared part
                mid = _Node(child.key[:k], node)
                mid.tenants = dict(child.tenants)
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                node.children[tokens[i]] = mid
                child = mid
                self.num_nodes += 1
            if tenant not in child.tenants:
                size += len(child.key)
            child.tenants[tenant] = now
            node, i = child, i + k
        self.tenant_size[tenant] = size

    def match(self, tokens: Sequence[int], allowed: Collection[str]) -> tuple[int, list[str]]:
        """(matched tokens, allowed workers holding the deepest matched node); a partial edge counts."""
        node, i, n = self.root, 0, len(tokens)
        holders: list[str] = []
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                break
            alive = [t for t in child.tenants if t in allowed]
            if not alive:
                break
            k = _shared(child.key, tokens, i)
            i += k
            holders = alive
            if k < len(child.key):
                break
            node = child
        return i, holders

    def evict_tenant_by_size(self, max_size: int) -> int:
        """Per worker over `max_size`, drop its LRU leaves until it fits; returns tokens evicted."""
        evicted = 0
        for tenant, size in list(self.tenant_size.items()):
            if size <= max_size:
                continue
            heap = [(n.tenants[tenant], n.seq, n) for n in self._leaves_of(tenant)]
            heapq.heapify(heap)
            while size > max_size and heap:
                _, _, node = heapq.heappop(heap)
                del node.tenants[tenant]
                size -= len(node.key)
                evicted += len(node.key)
                parent = node.parent
                assert parent is not None
                if not node.tenants and not node.children:
                    del parent.children[node.key[0]]
                    self.num_nodes -= 1
                    self.num_keys -= len(node.key)
                if parent is not self.root and tenant in parent.tenants and not any(
                    tenant in c.tenants for c in parent.children.values()
                ):
                    heapq.heappush(heap, (parent.tenants[tenant], parent.seq, parent))
            self.tenant_size[tenant] = size
        return evicted

    def _leaves_of(self, tenant: str) -> list[_Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            if tenant not in node.tenants:
                continue
            held = [c for c in node.children.values() if tenant in c.tenants]
            if held:
                stack.extend(held)
            else:
                out.append(node)
        return out


class SmgCacheAware(Policy):
    name = "smg_cache_aware"

    def __init__(self, config: SmgCacheAwareConfig | None = None) -> None:
        self.config = config or SmgCacheAwareConfig()
        self.mirrors_peers = self.config.mesh
        self._trees: dict[str, ApproxTree] = {}  # per model
        self._last_eviction_s: float | None = None
        self._unit = 1  # tokens per tree element: 1, or with `mesh` the workers' block size (from the last select)

    def _keys(self, ctx: RoutingContext) -> Sequence[int]:
        """What the tree holds of a prompt: its tokens, or with `mesh` its full blocks' hashes."""
        return ctx.block_hashes if self.config.mesh else ctx.prompt_token_ids

    def tree(self, model: str) -> ApproxTree:
        return self._trees.setdefault(model, ApproxTree())

    def is_imbalanced(self, pool: Sequence[WorkerView]) -> tuple[bool, int, int]:
        loads = [w.in_flight for w in pool]
        hi, lo = max(loads), min(loads)
        cfg = self.config
        return (hi - lo) > cfg.balance_abs_threshold and hi > cfg.balance_rel_threshold * lo, hi, lo

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        imbalanced, hi, lo = self.is_imbalanced(pool)
        if imbalanced:
            pick = min(pool, key=lambda w: w.in_flight)  # SMG min_by_key: the first least-loaded
            log.debug("request=%s smg_cache_aware imbalanced: max %d - min %d > %d and %d > %.2f*%d -> %s",
                      ctx.request_id, hi, lo, self.config.balance_abs_threshold, hi,
                      self.config.balance_rel_threshold, lo, pick.worker_id)
            return Decision(worker_id=pick.worker_id, reason=f"imbalanced max={hi} min={lo}")
        tree = self._trees.get(ctx.model)
        ids = {w.worker_id for w in pool}
        if self.config.mesh:
            self._unit = pool[0].block_size
        matched, holders = tree.match(self._keys(ctx), ids) if tree else (0, [])
        matched *= self._unit
        n = ctx.num_prompt_tokens
        rate = matched / n if n else 0.0
        if rate > self.config.cache_threshold and holders:
            wid = holders[tie_draw(ctx, len(holders), "holder")] if len(holders) > 1 else holders[0]
            reason = f"match {matched}/{n}={rate:.3f}"
        else:
            sizes = tree.tenant_size if tree else {}
            smallest = min(sizes.get(w.worker_id, 0) for w in pool)
            tied = [w.worker_id for w in pool if sizes.get(w.worker_id, 0) == smallest]
            wid = tied[tie_draw(ctx, len(tied), "smallest")] if len(tied) > 1 else tied[0]
            reason = f"miss {matched}/{n}={rate:.3f}; smallest tree {smallest * self._unit} tok"
        log.debug("request=%s smg_cache_aware balanced (max %d, min %d): match_rate %d/%d = %.3f vs threshold %.2f "
                  "-> %s (%s)", ctx.request_id, hi, lo, matched, n, rate, self.config.cache_threshold, wid, reason)
        return Decision(worker_id=wid, reason=reason)  # type: ignore[arg-type]

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        self.tree(ctx.model).insert(self._keys(ctx), decision.worker_id, now)

    def state_sizes(self) -> dict[str, int]:
        trees = self._trees.values()
        return {"tree_nodes": sum(t.num_nodes for t in trees),
                "tree_tokens": sum(t.num_keys for t in trees) * self._unit,
                # what `max_tree_size` bounds, per worker: a shared node counts once per worker holding it
                "worker_tokens": sum(sum(t.tenant_size.values()) for t in trees) * self._unit}  # fmt: skip

    def on_tick(self, now: float) -> None:
        if self._last_eviction_s is None:
            self._last_eviction_s = now
        if now - self._last_eviction_s < self.config.eviction_interval_s:
            return
        self._last_eviction_s = now
        for model, tree in self._trees.items():
            evicted = tree.evict_tenant_by_size(self.config.max_tree_size // self._unit) * self._unit
            if evicted:
                log.debug("smg_cache_aware eviction model=%s evicted %d tokens (max %d per worker)",
                          model, evicted, self.config.max_tree_size)
