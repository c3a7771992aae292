"""Per-request records of a simulation run, and the summary numbers computed from them (latency percentiles,
throughput, cache hit ratio, balance, SLO attainment). Plain data in, a JSON-ready dict out."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

# Request outcomes
OK = "ok"
REJECTED_TOO_LONG = "rejected_too_long"  # prompt does not fit max_model_len (admission)
REJECTED_QUEUE_FULL = "rejected_queue_full"  # router queue at max_size
NO_WORKER = "no_worker"  # the policy returned no decision
INCOMPLETE = "incomplete"  # still running when the simulation stopped (should not happen)


@dataclass(slots=True)
class RequestRecord:
    """What the collector learned about one request; times on the virtual clock, seconds."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    max_tokens: int
    status: str = INCOMPLETE
    worker_id: str = ""
    dispatch_s: float = -1.0  # left the router queue / was routed
    first_scheduled_s: float = -1.0  # start of the first engine step that computed some of its prompt
    first_token_s: float = -1.0
    finish_s: float = -1.0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens the engine served from its prefix cache

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def norm_latency_s(self) -> float:
        """E2E per output token (PreServe's "normalized latency"), seconds per token."""
        return self.e2e_s / max(1, self.num_output_tokens)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first; 0 for single-token outputs."""
        if self.num_output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.num_output_tokens - 1)


def dist(values: Sequence[float] | np.ndarray) -> dict[str, float]:
    """mean, p50, p90, p99 (numpy 'linear' percentiles), max and n; zeros when empty."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "n": 0}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max()),
            "n": int(a.size)}


def norm_latency_slo(
    records: Sequence[RequestRecord], slo_s_per_token: Mapping[str, float] | float
) -> dict[str, float]:
    """Normalized-latency SLO attainment: the fraction of all requests that completed with E2E / output tokens
    <= their SLO (one value, or a per-request-id map). A request that did not complete is a miss."""
    met = 0
    for r in records:
        if r.status != OK or r.finish_s < 0:
            continue
        slo = slo_s_per_token if isinstance(slo_s_per_token, (int, float)) else slo_s_per_token[r.request_id]
        met += r.norm_latency_s <= slo
    n = len(records)
    return {"attainment": met / n if n else 0.0, "num_met": met, "num_violations": n - met, "num_requests": n}


def load_imbalance(
    records: Sequence[RequestRecord],
    worker_ids: Sequence[str],
    work_s: Callable[[RequestRecord], float],
    window_s: float,
    threshold: float,
    step_s: float = 1.0,
) -> dict[str, float]:
    """Preble's per-GPU load imbalance, the quantity its rebalancing tests (specs/preble.md §5.4, claim 7): every
    `step_s` from the first dispatch + `window_s` to the last dispatch, each worker's L = Σ `work_s(r)` over the
    completed requests dispatched to it in the last `window_s`, and the ratio max L / min L. Returns the ratio's
    p50 / p90 / max over the samples with every L > 0, `frac_over` (the share of samples with max L > `threshold` ×
    min L; a worker with L = 0 counts as over), `n` samples and `num_idle` (samples with some L = 0). Computed from
    what the engines did (the requests' real cache hits and output lengths), not from a policy's own bookkeeping,
    so policies compare on one measure. A run shorter than `window_s` has no sample (n = 0)."""
    done = sorted((r for r in records if r.status == OK and r.worker_id in worker_ids), key=lambda r: r.dispatch_s)
    out: dict[str, float] = {"p50": 0.0, "p90": 0.0, "max": 0.0, "frac_over": 0.0, "n": 0, "num_idle": 0,
                             "window_s": window_s, "threshold": threshold}
    if not done:
        return out
    t = np.array([r.dispatch_s for r in done])
    samples = np.arange(t[0] + window_s, t[-1] + 1e-9, step_s)
    if samples.size == 0:
        return out
    col = {w: i for i, w in enumerate(worker_ids)}
    per = np.zeros((len(done) + 1, len(worker_ids)))
    per[np.arange(1, len(done) + 1), [col[r.worker_id] for r in done]] = [work_s(r) for r in done]
    cum = per.cumsum(axis=0)  # cum[k] = each worker's work over the first k dispatches
    hi = np.searchsorted(t, samples, side="right")  # dispatches at or before the sample ...
    lo = np.searchsorted(t, samples - window_s, side="right")  # ... and after its window's start
    loads = cum[hi] - cum[lo]
    lmin, lmax = loads.min(axis=1), loads.max(axis=1)
    busy = lmin > 0
    ratio = lmax[busy] / lmin[busy]
    out["n"] = int(samples.size)
    out["num_idle"] = int((~busy).sum())
    out["frac_over"] = float(((lmax > threshold * lmin) | ~busy).mean())
    if ratio.size:
        p50, p90 = np.percentile(ratio, [50, 90])
        out.update(p50=float(p50), p90=float(p90), max=float(ratio.max()))
    return out


WARMUP_FRAC = 0.25  # the first quarter of arrivals is the cold-cache warm-up
LOW_HIT_FRAC = 0.5  # a request with less than this fraction of its prompt cached is "low-hit" (fairness figures)


def warm_start_s(records: Sequence[RequestRecord], warmup_frac: float = WARMUP_FRAC) -> float:
    """The arrival time after which a run counts as warm: the `warmup_frac` quantile of arrival times. It depends on
    the trace alone (every policy has the same records' arrivals), so warm figures compare like with like."""
    if not records:
        return 0.0
    return float(np.quantile([r.arrival_s for r in records], warmup_frac))


def summarize(
    records: Sequence[RequestRecord],
    worker_ids: Sequence[str],
    prefix_cache_queries: int,
    prefix_cache_hits: int,
    num_preemptions: int,
    slo_ttft_s: float,
    slo_tpot_s: float,
) -> dict[str, object]:
    """The metrics of one (policy, rate) run. Rejected requests count as SLO misses.

    `ttft_warm_s` is TTFT over the requests that arrived after the warm-up (`warm_start_s`): a short run starts with
    every cache empty, and its first seconds (a burst of misses on every worker) can dominate the whole run's mean
    and p99, while a router in service spends nearly all its time warm. Both are reported; neither replaces the
    other. `ttft_low_hit_s` is TTFT over the requests that found less than half their prompt cached: what a
    cache-first local scheduler (SGLang's lpm) makes wait, and Preble's priority groups protect (claim 9)."""
    done = [r for r in records if r.status == OK]
    t_warm = warm_start_s(records)
    status_counts: dict[str, int] = {}
    for r in records:
        status_counts[r.status] = status_counts.get(r.status, 0) + 1
    ttft = np.array([r.ttft_s for r in done])
    e2e = np.array([r.e2e_s for r in done])
    multi = [r for r in done if r.num_output_tokens > 1]
    tpot = np.array([r.tpot_s for r in multi])
    norm = np.array([r.norm_latency_s for r in done])
    out_tokens = sum(r.num_output_tokens for r in done)
    t_first = min((r.arrival_s for r in records), default=0.0)
    t_last = max((r.finish_s for r in done), default=t_first)
    makespan = max(t_last - t_first, 1e-9)

    per_worker = {w: 0 for w in worker_ids}
    for r in records:
        if r.worker_id in per_worker:
            per_worker[r.worker_id] += 1
    counts = np.array(list(per_worker.values()), dtype=np.float64)
    mean_count = float(counts.mean()) if counts.size else 0.0

    ttft_ok = np.array([r.ttft_s <= slo_ttft_s for r in done], dtype=bool)
    tpot_ok = np.array([r.tpot_s <= slo_tpot_s for r in done], dtype=bool)
    n = max(1, len(records))
    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "status": dict(sorted(status_counts.items())),
        "ttft_s": dist(ttft),
        "ttft_warm_s": dist([r.ttft_s for r in done if r.arrival_s >= t_warm]),
        "warm_start_s": t_warm,
        "ttft_low_hit_s": dist([r.ttft_s for r in done if r.num_cached_tokens < LOW_HIT_FRAC * r.num_prompt_tokens]),
        "tpot_s": dist(tpot),
        "e2e_s": dist(e2e),
        "norm_latency_s_per_token": dist(norm),
        "queue_wait_s": dist([r.dispatch_s - r.arrival_s for r in done]),  # held in the router queue
        # TTFT = queue_wait + engine_wait + prefill_span: waiting in the engine (its queue, the step in flight), then
        # from the first step computing the prompt to the first token (chunks, and the batch they share)
        "engine_wait_s": dist([r.first_scheduled_s - r.dispatch_s for r in done if r.first_scheduled_s >= 0]),
        "prefill_span_s": dist([r.first_token_s - r.first_scheduled_s for r in done if r.first_scheduled_s >= 0]),
        "num_held": sum(1 for r in done if r.dispatch_s > r.arrival_s),
        "throughput_req_s": len(done) / makespan,
        "throughput_output_tok_s": out_tokens / makespan,
        "prefix_cache_hit_ratio": prefix_cache_hits / prefix_cache_queries if prefix_cache_queries else 0.0,
        "prefix_cache_hits_tokens": prefix_cache_hits,
        "prefix_cache_queries_tokens": prefix_cache_queries,
        "prompt_cached_tokens_frac": (
            sum(r.num_cached_tokens for r in done) / max(1, sum(r.num_prompt_tokens for r in done))
        ),
        "num_preemptions": num_preemptions,
        "requests_per_worker": per_worker,
        "balance_max_over_mean": float(counts.max() / mean_count) if mean_count else 0.0,
        "balance_cv": float(counts.std() / mean_count) if mean_count else 0.0,
        "slo": {
            "ttft_s": slo_ttft_s,
            "tpot_s": slo_tpot_s,
            "ttft_attainment": float(ttft_ok.sum()) / n,
            "tpot_attainment": float(tpot_ok.sum()) / n,
            "attainment": float((ttft_ok & tpot_ok).sum()) / n,
        },
        "sim_duration_s": makespan,
    }
