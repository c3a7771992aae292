"""dynamo_kv: NVIDIA Dynamo's KV router cost function, reimplemented as a peer baseline.

Source: ai-dynamo/dynamo `docs/components/router/router-concepts.md` @1d1a556 and the classic
`DefaultWorkerSelector::select_worker` (`lib/kv-router/src/scheduling/selector.rs`), with the worker load from
its `ActiveSequences` bookkeeping (`potential_blocks_and_tokens`); specs/peers.md §6. Argmin of a cost in KV blocks:

    cost_w [blocks] = overlap_score_weight * prefill_blocks_w + decode_blocks_w
    prefill_blocks_w = (active_prefill_tokens_w + ISL - overlap_w * block_size) / block_size
    decode_blocks_w  = active_blocks_w + new_blocks_w

- overlap_w: leading blocks of the prompt resident on w, from the workers' KV events (Dynamo's KvIndexer; here
  `fleet.cached_prefix_blocks`, the router's one event-fed index).
- active_prefill_tokens_w: uncached prompt tokens of requests this router sent to w that have not produced a
  first token yet (Dynamo marks prefill complete at the first token).
- active_blocks_w: distinct blocks of requests this router has in flight on w (shared prefixes count once; a
  partial last block counts as its own block); new_blocks_w: the request's blocks not among them.
  Output blocks are not tracked (`--router-track-output-blocks` is off by default).
Selection: router_temperature 0 (default) -> argmin, equal costs broken by a hash of the request id (Dynamo's
`min_by` over a hash map: arbitrary); > 0 -> softmax over the costs rescaled to [0, 1] (Dynamo's
`softmax_sample`), sampled with a uniform drawn from the request id.

Knobs (Dynamo defaults): overlap_score_weight 1.0 (`--kv-overlap-score-weight`), router_temperature 0.0.
Newer Dynamo refactors this into overlap_score_credit / prefill_load_scale (same cost at their defaults) and
adds optional OSL-decayed output blocks, AIC prefill decay and predict-on-route: not modelled here.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

from switchyard.router.policies.base import Decision, FleetView, Policy, RoutingContext, WorkerId, candidates
from switchyard.router.policies.smg_least_load import tie_draw

log = logging.getLogger(__name__)

_DEFAULT_BLOCK_SIZE = 16  # only if on_dispatch sees a request this instance did not select


@dataclass(frozen=True, slots=True)
class DynamoKvConfig:
    overlap_score_weight: float = 1.0  # multiplies prefill blocks (cache affinity vs decode load)
    router_temperature: float = 0.0  # 0 = deterministic argmin
    # `--router-replica-sync` (off by default): router replicas share their active sequences (Dynamo over NATS;
    # here the workers' request events, `router.peer_mirror`, one event lag late)
    replica_sync: bool = False


@dataclass(slots=True)
class _Active:
    """One worker's in-flight requests as this router tracks them."""

    block_refs: Counter[int] = field(default_factory=Counter)  # block hash -> requests holding it
    num_partial_blocks: int = 0  # one per request whose prompt ends mid-block
    prefill_tokens: int = 0  # uncached prompt tokens not yet prefilled


@dataclass(frozen=True, slots=True)
class _Request:
    worker_id: WorkerId
    block_hashes: tuple[int, ...]
    has_partial: bool
    prefill_tokens: int


class DynamoKv(Policy):
    name = "dynamo_kv"

    def __init__(self, config: DynamoKvConfig | None = None) -> None:
        self.config = config or DynamoKvConfig()
        self.mirrors_peers = self.config.replica_sync
        self._active: dict[WorkerId, _Active] = {}
        self._requests: dict[str, _Request] = {}
        self._prefilling: set[str] = set()
        # NOTE: a memo, not state: select records the overlap it saw so on_dispatch can charge the same uncached
        # tokens Dynamo's add_request does; select's result never reads it.
        self._overlap_seen: dict[tuple[str, int], tuple[int, int]] = {}  # -> (overlap blocks, block size)

    def costs(self, ctx: RoutingContext, fleet: FleetView, workers: list) -> list[tuple[float, int, float, int]]:
        """Per worker: (cost, overlap blocks, prefill blocks, decode blocks)."""
        overlaps = fleet.cached_prefix_blocks(ctx.model, ctx.block_hashes)
        isl = ctx.num_prompt_tokens
        out = []
        for w in workers:
            bs = w.block_size
            overlap = overlaps.get(w.worker_id, 0)
            act = self._active.get(w.worker_id) or _Active()
            prefill_blocks = (act.prefill_tokens + max(isl - overlap * bs, 0)) / bs
            new_blocks = sum(1 for h in ctx.block_hashes if h not in act.block_refs) + (1 if isl % bs else 0)
            decode_blocks = len(act.block_refs) + act.num_partial_blocks + new_blocks
            out.append((self.config.overlap_score_weight * prefill_blocks + decode_blocks, overlap,
                        prefill_blocks, decode_blocks))
        return out

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        rows = self.costs(ctx, fleet, pool)
        costs = [r[0] for r in rows]
        temp = self.config.router_temperature
        if temp > 0:
            i = self._softmax_pick(ctx, costs, temp)
        else:
            best = min(costs)
            tied = [j for j, c in enumerate(costs) if c == best]
            i = tied[tie_draw(ctx, len(tied), "dynamo")] if len(tied) > 1 else tied[0]
        cost, overlap, prefill, decode = rows[i]
        if log.isEnabledFor(logging.DEBUG):
            for w, (c, o, p, d) in zip(pool, rows, strict=True):
                log.debug("request=%s dynamo_kv worker=%s with %d cached blocks: %.3f = %.1f * prefill_blocks + "
                          "decode_blocks = %.1f * %.3f + %d", ctx.request_id, w.worker_id, o, c,
                          self.config.overlap_score_weight, self.config.overlap_score_weight, p, d)
            log.debug("request=%s dynamo_kv -> %s cost %.3f", ctx.request_id, pool[i].worker_id, cost)
        if len(self._overlap_seen) > 65536:
            self._overlap_seen.clear()
        self._overlap_seen[(ctx.request_id, ctx.attempt)] = (overlap, pool[i].block_size)
        return Decision(worker_id=pool[i].worker_id,
                        reason=f"cost={cost:.3f} prefill={prefill:.3f} decode={decode} overlap={overlap}")

    @staticmethod
    def _softmax_pick(ctx: RoutingContext, costs: list[float], temperature: float) -> int:
        lo, hi = min(costs), max(costs)
        if lo == hi:
            probs = [1.0] * len(costs)
        else:
            scale = -1.0 / ((hi - lo) * temperature)
            probs = [math.exp(c * scale - lo * scale) for c in costs]
        total = sum(probs)
        digest = hashlib.blake2b(f"softmax:{ctx.request_id}:{ctx.attempt}".encode(), digest_size=8).digest()
        u = int.from_bytes(digest, "little") / 2**64
        acc = 0.0
        for i, p in enumerate(probs):
            acc += p / total
            if u <= acc:
                return i
        return len(costs) - 1

    # ---------------------------------------------------------------- hooks: ActiveSequences bookkeeping
    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        wid = decision.worker_id
        overlap, bs = self._overlap_seen.pop((ctx.request_id, ctx.attempt), (0, _DEFAULT_BLOCK_SIZE))
        act = self._active.setdefault(wid, _Active())
        has_partial = bool(ctx.num_prompt_tokens % bs)
        prefill = max(ctx.num_prompt_tokens - overlap * bs, 0)
        act.block_refs.update(ctx.block_hashes)
        act.num_partial_blocks += has_partial
        act.prefill_tokens += prefill
        self._requests[ctx.request_id] = _Request(wid, ctx.block_hashes, has_partial, prefill)
        self._prefilling.add(ctx.request_id)

    def state_sizes(self) -> dict[str, int]:
        # Dynamo's ActiveSequences: what its decode-block term counts; the overlaps come from the router's index
        return {"in_flight_requests": len(self._requests),
                "active_blocks": sum(len(a.block_refs) for a in self._active.values())}  # fmt: skip

    def on_peer_dispatch(self, ctx: RoutingContext, decision: Decision, fleet: FleetView, now: float) -> None:
        """Replica sync's AddRequest carries the overlap the sending router saw: read here from the same KV events."""
        w = fleet.get(decision.worker_id)
        overlap = fleet.cached_prefix_blocks(ctx.model, ctx.block_hashes).get(decision.worker_id, 0)
        self._overlap_seen[(ctx.request_id, ctx.attempt)] = (overlap, w.block_size if w else _DEFAULT_BLOCK_SIZE)
        self.on_dispatch(ctx, decision, now)

    def on_first_token(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        self._end_prefill(request_id)

    def on_finish(self, request_id: str, worker_id: WorkerId, now: float, num_output_tokens: int) -> None:
        self._free(request_id)

    def on_abort(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        self._free(request_id)

    def _end_prefill(self, request_id: str) -> None:
        if request_id in self._prefilling:
            self._prefilling.discard(request_id)
            req = self._requests[request_id]
            self._active[req.worker_id].prefill_tokens -= req.prefill_tokens

    def _free(self, request_id: str) -> None:
        self._end_prefill(request_id)
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        act = self._active[req.worker_id]
        act.block_refs.subtract(req.block_hashes)
        for h in req.block_hashes:
            if act.block_refs[h] <= 0:
                del act.block_refs[h]
        act.num_partial_blocks -= req.has_partial
