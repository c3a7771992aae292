"""smg_least_load: SMG's `least_load` expected-wait policy, reimplemented as a peer baseline.

Source: smg-project/smg `model_gateway/src/policies/least_load.rs` (HEAD f8daa88, 2026-08-22; specs/peers.md §1).
Argmin over the routable workers of an expected wait in seconds:

    score_i [s] = (queued_tokens_i + inflight_tokens_i) [tok] / throughput_i [tok/s]
                  + kv_pressure_weight [s] * k_i / (1 - k_i)

- queued_tokens_i: the worker's `num_waiting_uncached_tokens` from its last Stats; when that is 0,
  `num_waiting * mean_prefill_tokens` (SMG's estimate for backends that report a depth but no token count).
- inflight_tokens_i: prompt tokens this router dispatched to i *since that Stats sample* (SMG resets its tally on
  every load poll: the incast guard). Here: the last `dispatched_since_stats` entries of this policy's own
  per-worker dispatch log (the fleet counts dispatches, the policy remembers their sizes).
- throughput_i: the worker's generation tokens/s over its last Stats interval; 0 -> `default_throughput`.
- k_i: KV usage fraction, clamped to [0, 0.999]: the M/M/1 occupancy barrier, divergent at the KV cliff.
Missing signals (as SMG): a worker with no Stats yet while peers report scores
`min(reporting peers' scores) + in_flight * mean_prefill_tokens / nominal_throughput` (nominal = mean of the
reporting peers' positive throughputs, else the default); a fully dark fleet falls back to argmin in_flight.
Equal scores are broken uniformly at random (SMG's reservoir sampling); here the draw is a hash of the request id
and attempt, so `select` stays pure and replays identically.

Knobs (SMG defaults): kv_pressure_weight 0.15 s, mean_prefill_tokens 1024, default_throughput 2000 tok/s,
max_waiting_requests 0 (off; else skip workers whose waiting + since-poll dispatches reached it).
Difference: SMG polls loads every `load_check_interval_secs` (10 s); here the fleet's Stats cadence applies.
"""

from __future__ import annotations

import hashlib
import logging
from collections import deque
from dataclasses import dataclass
from itertools import islice

from switchyard.router.policies.base import (
    Decision,
    FleetView,
    Policy,
    RoutingContext,
    WorkerId,
    WorkerView,
    candidates,
)

log = logging.getLogger(__name__)

_LOG_DEPTH = 4096  # dispatches remembered per worker; far above any realistic since-poll count


@dataclass(frozen=True, slots=True)
class SmgLeastLoadConfig:
    kv_pressure_weight_s: float = 0.15  # λ_t, seconds per unit of k/(1-k)
    mean_prefill_tokens: int = 1024  # p̄: tokens per queued request with no token count
    default_throughput_tok_s: float = 2000.0  # drain rate when a worker reports none
    max_waiting_requests: int = 0  # waiting-queue veto; 0 = off


def tie_draw(ctx: RoutingContext, n: int, salt: str = "") -> int:
    """A uniform index in [0, n) from the request id and attempt (no global random)."""
    digest = hashlib.blake2b(f"{salt}:{ctx.request_id}:{ctx.attempt}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def generation_tokens_per_s(w: WorkerView) -> float:
    # NOTE: WorkerView does not expose the Stats throughput; the fleet's record carries it in `.stats`.
    stats = getattr(w, "stats", None)
    return float(getattr(stats, "generation_tokens_per_s", 0.0) or 0.0)


def has_stats(w: WorkerView) -> bool:
    return w.stats_age_s != float("inf")


class SmgLeastLoad(Policy):
    name = "smg_least_load"

    def __init__(self, config: SmgLeastLoadConfig | None = None) -> None:
        self.config = config or SmgLeastLoadConfig()
        self._dispatched_tokens: dict[WorkerId, deque[int]] = {}

    # ---------------------------------------------------------------- hooks
    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        log_ = self._dispatched_tokens.setdefault(decision.worker_id, deque(maxlen=_LOG_DEPTH))
        log_.append(ctx.num_prompt_tokens)

    # ---------------------------------------------------------------- scoring
    def inflight_tokens(self, w: WorkerView) -> int:
        """Prompt tokens dispatched to `w` after its last Stats sample."""
        n = w.dispatched_since_stats
        tokens = self._dispatched_tokens.get(w.worker_id)
        if not n or not tokens:
            return 0
        return sum(islice(reversed(tokens), n))

    def queued_tokens(self, w: WorkerView) -> float:
        if w.num_waiting_uncached_tokens > 0:
            return float(w.num_waiting_uncached_tokens)
        return float(max(w.num_waiting, 0) * self.config.mean_prefill_tokens)

    def reported_score(self, w: WorkerView) -> float:
        """Expected wait [s] of a worker that has Stats."""
        cfg = self.config
        tput = generation_tokens_per_s(w)
        tput = tput if tput > 0 else cfg.default_throughput_tok_s
        k = min(max(w.kv_usage_frac, 0.0), 0.999)
        return (self.queued_tokens(w) + self.inflight_tokens(w)) / tput + cfg.kv_pressure_weight_s * k / (1.0 - k)

    def scores(self, pool: list[WorkerView]) -> list[float]:
        reporting = [w for w in pool if has_stats(w)]
        if not reporting:
            return [float(w.in_flight) for w in pool]  # dark fleet: join-shortest-queue on live in-flight
        known = {w.worker_id: self.reported_score(w) for w in reporting}
        if len(reporting) == len(pool):
            return [known[w.worker_id] for w in pool]
        tputs = [t for t in map(generation_tokens_per_s, reporting) if t > 0]
        nominal = sum(tputs) / len(tputs) if tputs else self.config.default_throughput_tok_s
        baseline = min(known.values())
        return [
            known[w.worker_id]
            if w.worker_id in known
            else baseline + w.in_flight * self.config.mean_prefill_tokens / nominal
            for w in pool
        ]

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        cap = self.config.max_waiting_requests
        if cap:
            pool = [w for w in pool if not has_stats(w) or w.num_waiting + w.dispatched_since_stats < cap]
        if not pool:
            return None
        scores = self.scores(pool)
        best = min(scores)
        tied = [i for i, s in enumerate(scores) if s == best]
        pick = pool[tied[tie_draw(ctx, len(tied)) if len(tied) > 1 else 0]]
        if log.isEnabledFor(logging.DEBUG):
            w = pick
            log.debug(
                "request=%s smg_least_load -> %s score=%.4fs = (queued %.0f + inflight %d) tok / %.0f tok/s "
                "+ %.2f * k/(1-k) with k=%.3f; ties=%d; all=%s",
                ctx.request_id, w.worker_id, best, self.queued_tokens(w), self.inflight_tokens(w),
                generation_tokens_per_s(w) or self.config.default_throughput_tok_s,
                self.config.kv_pressure_weight_s, w.kv_usage_frac, len(tied),
                {p.worker_id: round(s, 4) for p, s in zip(pool, scores, strict=True)},
            )
        return Decision(worker_id=pick.worker_id, reason=f"expected_wait={best:.4f}s")
