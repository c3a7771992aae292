"""preserve: PreServe's anticipation-aware routing (specs/preserve.md §6), plus its MU baseline `min_usage`.

`preserve` sends request r (P prompt tokens, D predicted output tokens) to the argmin over routable workers of

    L_i [tok] = L_p_i + L_d_i + beta * L_m_i
    L_p_i     = queued_p_i + P                       prefill work ahead of r: prompts dispatched to i whose
                                                     prefill has not completed [inferred reading, §6], plus r's
    L_d_i     = current_d_i + D                      decode work: Σ max(0, eff - g) remaining predicted decode
                                                     tokens of i's requests past prefill [inferred, §6], plus r's
    L_m_i     = max(0, U_k - T_mem) * M_kv           memory-overflow penalty: U_k = the peak KV fraction over the
                                                     next l iterations if r were added at offset 0 (the
                                                     anticipator's virtual add, no mutation), M_kv = KV capacity

All three terms are in tokens; the penalty is 0 until the projected peak passes T_mem of the KV cache, the level
"that would not incur preemption latency". The paper prints Eq. (1) as argmax; the text says minimum (§6).
Ties [inferred, §6]: fewest requests in flight, then a uniform draw from `random.Random` seeded by
(seed, request id, attempt), so `select` stays pure and a replay picks the same worker.

D: the router normally supplies it in `RoutingContext.predicted_output_tokens` (the trained predictor, with its
own running-mean fallback when the model is late, or a client hint). Only when it is None does this policy use
its own `LengthFallback` (router/predictor/fallback.py), a running mean per (model, prompt-length bucket) that it
updates from every `on_finish`. D is returned in `Decision.predicted_output_tokens`. NOTE: D is not clamped to
`max_tokens`: in the simulator `max_tokens` is the true length, and clamping would leak the oracle.

The per-worker state (map, pending prefills, iteration clock) is `AnticipationTracker` (anticipation.py).

Knobs (`PreserveConfig`): t_mem 0.8, beta 1, horizon l = 100 iterations (spec §6 table, §5.1), max_len L = 4096
and ext_frac 0.2 (§5.1-5.2), fallback_prior_tokens 256 (LengthFallback's prior), seed 0.

`min_usage` (MU, §6 baselines): argmin of w_gpu * gpu_util + w_kv * kv_usage_frac, weights 0.5 / 0.5 (not given
by the paper [inferred, §11]). The paper's "GPU utilization" is a device counter the router cannot see; here
[inferred] gpu_util = min(1, (num_running + dispatched_since_stats) / max_num_seqs), the batch-slot fill from
the last Stats plus what this router sent since (the incast guard: without it every request between two polls
would go to the same worker). kv_usage_frac is the last Stats' KV usage. Ties as `preserve`.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from switchyard.router.policies.anticipation import AnticipationTracker
from switchyard.router.policies.base import (
    Decision,
    FleetView,
    Policy,
    RoutingContext,
    WorkerId,
    WorkerView,
    candidates,
)
from switchyard.router.predictor.fallback import LengthFallback

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PreserveConfig:
    t_mem: float = 0.8  # T_mem, KV fraction above which the overflow penalty starts (spec §6)
    beta: float = 1.0  # β, weight of L_m (spec §6)
    horizon: int = 100  # l, iterations the virtual add looks ahead (spec §5.1, §6)
    max_len: int = 4096  # L, max output tokens a record may reach (spec §5.1)
    ext_frac: float = 0.2  # overrun extension, fraction of the prediction (spec §5.2)
    fallback_prior_tokens: float = 256.0  # LengthFallback's prior before any finish is observed
    seed: int = 0  # tie-break draws


@dataclass(frozen=True, slots=True)
class Load:
    """One worker's PreServe load for one request, term by term (tokens)."""

    queued_prefill: int  # queued_p_i
    prefill: int  # L_p = queued_p_i + P
    decode: int  # L_d = current_d_i + D
    peak_frac: float  # U_k
    memory: float  # L_m = max(0, U_k - T_mem) * M_kv
    total: float  # L = L_p + L_d + beta * L_m


def pick(ctx: RoutingContext, pool: list[WorkerView], scores: list[float], seed: int) -> int:
    """Index of the argmin; ties by fewest in flight, then a draw seeded by (seed, request, attempt)."""
    best = min(scores)
    tied = [i for i, s in enumerate(scores) if s == best]
    if len(tied) > 1:
        fewest = min(pool[i].in_flight for i in tied)
        tied = [i for i in tied if pool[i].in_flight == fewest]
    if len(tied) == 1:
        return tied[0]
    return random.Random(f"{seed}:{ctx.request_id}:{ctx.attempt}").choice(tied)


class Preserve(Policy):
    name = "preserve"

    def __init__(self, config: PreserveConfig | None = None) -> None:
        self.config = cfg = config or PreserveConfig()
        self.tracker = AnticipationTracker(cfg.horizon, cfg.max_len, cfg.ext_frac)
        self.fallback = LengthFallback(prior=cfg.fallback_prior_tokens)
        # request id -> (model, prompt tokens): what the fallback learns from at finish
        self._prompts: dict[str, tuple[str, int]] = {}

    # ---------------------------------------------------------------- scoring
    def predicted_tokens(self, ctx: RoutingContext) -> int:
        """D: the router's prediction, else the fallback's running mean."""
        d = ctx.predicted_output_tokens
        if d is None:
            d = self.fallback.predict(ctx.model, ctx.num_prompt_tokens)
        return max(1, min(int(d), self.config.max_len))

    def load(self, w: WorkerView, prompt_tokens: int, predicted_tokens: int, now: float) -> Load:
        cfg = self.config
        ant = self.tracker.sync(w, now)
        queued = self.tracker.queued_prefill_tokens(w.worker_id)
        lp = queued + prompt_tokens
        ld = self.tracker.remaining_decode_tokens(w.worker_id) + predicted_tokens
        u = ant.virtual_peak(prompt_tokens, predicted_tokens, cfg.horizon)
        lm = max(0.0, u - cfg.t_mem) * ant.capacity_tokens
        return Load(queued, lp, ld, u, lm, lp + ld + cfg.beta * lm)

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        d = self.predicted_tokens(ctx)
        loads = [self.load(w, ctx.num_prompt_tokens, d, now) for w in pool]
        i = pick(ctx, pool, [x.total for x in loads], self.config.seed)
        best = loads[i]
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request=%s preserve -> %s L=%.0f = L_p (%d queued + %d) + L_d %d + %.2f * L_m (max(0, %.3f - %.2f)"
                " * M_kv) = %.0f tok; D=%d%s; all=%s",
                ctx.request_id,
                pool[i].worker_id,
                best.total,
                best.queued_prefill,
                ctx.num_prompt_tokens,
                best.decode,
                self.config.beta,
                best.peak_frac,
                self.config.t_mem,
                best.memory,
                d,
                "" if ctx.predicted_output_tokens is not None else " (fallback)",
                {w.worker_id: round(x.total) for w, x in zip(pool, loads, strict=True)},
            )
        return Decision(
            worker_id=pool[i].worker_id,
            predicted_output_tokens=d,
            reason=f"L={best.total:.0f} peak={best.peak_frac:.3f}",
        )

    # ---------------------------------------------------------------- hooks
    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        d = decision.predicted_output_tokens or self.predicted_tokens(ctx)
        self.tracker.on_dispatch(ctx, decision.worker_id, d, now)
        self._prompts[ctx.request_id] = (ctx.model, ctx.num_prompt_tokens)

    def on_first_token(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        self.tracker.on_first_token(request_id, worker_id, now)

    def on_finish(self, request_id: str, worker_id: WorkerId, now: float, num_output_tokens: int) -> None:
        self.tracker.on_finish(request_id, worker_id, now)
        prompt = self._prompts.pop(request_id, None)
        if prompt is not None:
            self.fallback.observe(prompt[0], prompt[1], num_output_tokens)

    def on_abort(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        self.tracker.on_abort(request_id, worker_id, now)
        self._prompts.pop(request_id, None)


@dataclass(frozen=True, slots=True)
class MinUsageConfig:
    gpu_weight: float = 0.5  # weight of the batch-slot fill (spec §6/§11: 0.5 [inferred])
    kv_weight: float = 0.5  # weight of the KV usage fraction (spec §6/§11: 0.5 [inferred])
    seed: int = 0  # tie-break draws


def gpu_util(w: WorkerView) -> float:
    """Batch-slot fill as the router sees it: Stats' running requests plus dispatches since that sample."""
    return min(1.0, (w.num_running + w.dispatched_since_stats) / max(1, w.max_num_seqs))


class MinUsage(Policy):
    name = "min_usage"

    def __init__(self, config: MinUsageConfig | None = None) -> None:
        self.config = config or MinUsageConfig()

    def usage(self, w: WorkerView) -> float:
        cfg = self.config
        return cfg.gpu_weight * gpu_util(w) + cfg.kv_weight * w.kv_usage_frac

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        scores = [self.usage(w) for w in pool]
        i = pick(ctx, pool, scores, self.config.seed)
        w = pool[i]
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "request=%s min_usage -> %s usage=%.3f = %.2f * gpu %.3f + %.2f * kv %.3f; all=%s",
                ctx.request_id,
                w.worker_id,
                scores[i],
                self.config.gpu_weight,
                gpu_util(w),
                self.config.kv_weight,
                w.kv_usage_frac,
                {p.worker_id: round(s, 3) for p, s in zip(pool, scores, strict=True)},
            )
        return Decision(
            worker_id=w.worker_id,
            predicted_output_tokens=ctx.predicted_output_tokens or 0,
            reason=f"usage={scores[i]:.3f}",
        )
