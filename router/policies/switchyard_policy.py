"""switchyard: the router's default policy. One cost in seconds per worker, the latency placing request r there
adds: r's own wait, prefill and decode on that worker, plus (weighted) the delay it imposes on other requests.

Specs: specs/preble.md §5.1-5.2, §11 (E2's Q/R/M, the radix tree, eviction); specs/preserve.md §5-6 (the load
anticipator, predicted lengths, T_mem). Every term is seconds priced with the worker's own iteration-time model
(`preble_cost`: its named `PerfProfile`, or the online TTFT/TPOT fit of a real vLLM worker), so terms add
without exchange rates. Own-latency terms weigh 1; terms that are other requests' latency weigh λ (the
externality weight, an exchange rate between a second of someone else's decode and a second of r's own), M
included (E2 weighs it 1: below), except O, kept at PreServe's weight 1. For r (P prompt tokens, D predicted
output tokens) on worker w:

    cost_w = Q + R + λ·M + (D_self + D_in + λ·D_out) + λ·(I + B) + β·O + W                       [seconds]

  own latency (TTFT and decode of r)
    Q_w      wait for r's first token beyond its own prefill. The T missed tokens queued on w (this router's
             dispatches without a first token, E2's `Outstanding`: no Stats lag) run in k = ceil(T / B) chunked
             iterations (B = max_num_batched_tokens), and every iteration until r's first token carries w's n
             decoders (running + queued ahead, mean context c̄): half the one in flight, then r's own:
                 Q_w = k × PREFILLTIME(T/k, 0) + (k + 1.5) × decode_marginal_s(n, c̄)
             When r's m missed tokens fit beside T in one iteration (T + m <= B, `joint_prefill`), the engine
             schedules them together: Q_w = PREFILLTIME(T + m, 0) − PREFILLTIME(m, 0) + 1.5 × decode_marginal_s.
             (`queue_pricing="sum"`: E2's Σ single-request PT; it over-prices bursts of short prefills that the
             engine batches into one iteration.)
    R_w      E2's R: PREFILLTIME(P − cached_w, cached_w), r's prefill of the tokens w does not hold (KV events,
             or this router's dispatches until events disagree; errata E4). The prefix term.
    D_self_w DECODETIME(D, P + D/2): r's D iterations alone; equal on workers of one profile, ranks others.
    D_in_w   r slowed by w's anticipated batch: each co-runner x (running: the anticipator's record, remaining
             rem_x with overrun extensions, context c_x; queued ahead: rem_x = its prediction, c_x = its prompt)
             shares m_x = min(D, rem_x) iterations with r and adds its marginal sequence cost to each
             (`decode_marginal_s`: iteration(D=2) − iteration(D=1) at that context):
                 D_in_w = Σ_x decode_marginal_s(m_x, c_x + (m_x − 1)/2)
             The marginal is linear in context, so the sum is one call at the m-weighted mean context. This is
             what predicted lengths buy: a batch that will live long costs a long request more than one draining.
             Fill level (`decode_fill`, on since 2026-12-07): the batches now are not what r meets. While r
             decodes, the router's next arrivals go where their decode is quickest first, so a worker quicker
             than the rest does not stay so: D_self_w + D_in_w = max(D_self_w + D_in_w, L), where L is the level
             F seconds of co-running poured over the pool's D_self + D_in values reach, the lowest filled first
             (Σ_w max(0, L − D_self_w − D_in_w) = F):
                 F = a × D_self × decode_marginal_s(⌊D/2⌋, P + ⌊D/2⌋)
             (a = the model's arrivals per second, B's rate; each arrival during r's decode shares half of r's
             iterations at r's context; priced on the worker the arrivals fill first, the least D_self + D_in,
             so the level does not depend on the order the workers joined in). On one profile D_self is
             the same everywhere and L − D_self the level of the D_in values. On a mixed fleet a slower GPU's
             larger D_self keeps the arrivals off it until the faster ones' batches reach it: a level of D_in
             alone (the first version) raised the idle slow workers first, as if they were as fast, so the
             policy loaded the fast ones and left the slow ones idle (4 H100 + 4 A100: 97% of requests on the
             H100s, TTFT ×1.7 e2's at toolbench's 32 req/s; README "A mixed fleet"). Without it a worker's
             batch pushed r off its cache to an idle worker whose idleness the next arrivals end: follow-ups of a
             multi-turn conversation spilled at light load, and the fleet recomputed their prefixes. Measured
             (bench sim, seeds 0-2, the same runs without it; README "Fill level"): ours ÷ the best peer at 8
             workers and the peers' knee ×0.916 → ×0.871 (TTFT mean, p99, warm p99 of 8 workloads), over the
             suite's 80 cells on 4 workers ×0.914 → ×0.900; PreServe's ShareGPT near capacity SLO +0.05 to +0.11.
    W_w      KV wait: when r's private prompt does not fit beside U'[0] (below), the iterations j* until
             U'[j*] + P_priv ≤ M_kv, times w's iteration at its batch: r waits for memory, not compute (FCFS
             admission blocks behind a full cache, which Q cannot see).
  others' latency
    M_w      E2's eviction cost: when r's missed blocks exceed w's free blocks, the blocks w's LRU would evict,
             each PT_j × N_j (recompute of node j's evicted tokens × requests through j on w in W; errata E3).
             Others pay it, if they come back: weighed λ like the rest of this group. At E2's weight 1 it held
             long-document traffic on full workers to spare their caches (bench sim, 4 workers, seeds 0-2, ×
             the best peer policy's: LooGLE at 2 req/s TTFT mean ×1.09 → ×0.85 and E2E p99 ×1.36 → ×0.71 with
             λ·M, VideoQA ×1.02 → ×0.95, Azure mix ×0.97 → ×0.94, Mooncake ×0.83 → ×0.88; the tool, agent and
             programming workloads, where M is rarely priced, unchanged: README).
    D_out_w  w's batch slowed by r: Σ_x decode_marginal_s(m_x, P + (m_x − 1)/2), the other half of the sharing.
    I_w      prefill-decode interference: r's prefill rides in iterations that carry w's n decoders (chunked
             prefill) and delays each by what it adds to the step: I_w = n × max(0, R_w − PREFILLTIME(0, 0)).
             A miss is dear on a busy worker, a hit cheap anywhere: Preble's P/D balancing (§5.3) as a price.
             With T missed tokens already queued on w and T + m <= B, r's prefill grows the iteration w runs
             for them instead of adding its own (`joint_prefill`), so the step is the marginal
             PREFILLTIME(T + m, 0) − PREFILLTIME(T, 0), plus r's attention over its cached prefix,
             R_w − PREFILLTIME(m, 0): a per-iteration prefill overhead (llama3-8b-a100: 16.2 ms, and its first
             400 tokens under the knee) is paid once per iteration, not once per prompt. Spreading short prompts
             over the fleet multiplies slow prefill iterations; this lets them share one. Beyond B (long prompts,
             chunked over several iterations, likely already under way) r is priced as running alone: pricing
             those jointly too cost Mooncake's long-prompt traffic 3-12% TPOT in bench sim.
    B_w      arrivals behind r: I's step for the requests not yet on w. Those that reach w before r's prefill is
             done queue behind it (FCFS admission) and wait its step too: B_w = a_w × (Q_w + R_w) × step_w, a_w
             = the model's arrival rate over the last 10 s (`arrival_window_s`, `ArrivalRate`: the larger of
             this router's dispatches and the workers' Stats counters of requests received, which count every
             router replica's) / routable workers (an even share). A recompute on a backlogged worker delays
             everything that follows it there, which r's own Q and R do not see: in a cold start, when a prefix's
             holder is still prefilling it, a follow-up request otherwise spills and recomputes the prefix
             elsewhere (cost 1.14 s on the holder, 1.00 s away) and the fleet prefills it twice. Measured (bench
             sim, 4 workers, seeds 0-2; README): preble-agent at 64 req/s TTFT mean 0.138 / 0.106 / 0.106 →
             0.111 / 0.100 / 0.103 s, most other shared-prefix runs a few % better, a few a few % worse; ShareGPT
             (no sharing) near the knee within noise.
             Busy period (`busy_period`, on since 2026-11-27): requests keep arriving, and waiting behind r's
             step, until w's prefill backlog drains, not only until r's first token. An M/G/1 queue at
             utilisation ρ drains a backlog V in the busy period V / (1 − ρ), so
                 B_w = a_w × min(S_w, (Q_w + R_w) / (1 − ρ_w)) × step_w     (never under ρ = 0's B_w)
             ρ_w = the fraction of the arrival window during which w had this router's requests waiting for
             their first token (`BusyFraction`: measured, so it sees decode-slowed prefills and bursts), S_w the
             span it was measured over (the window, or the time since the router's first dispatch to w): a
             busy period is not extrapolated past what was seen, so a backlog that would not drain (ρ >= 1)
             counts the window's arrivals, and a cold start, with every queue busy for its first seconds, only
             those seconds'. Near capacity a recompute on a busy worker delays every later request there, which
             B at ρ = 0 priced as a light load's. Measured (bench sim, 4 workers, seeds 0-2, × the best peer
             policy; README "Busy period"): over 80 cells ×0.927 → ×0.901; VideoQA at 1.5× the suite's load
             TTFT mean ×1.09 → ×0.93 and hit ratio 0.582 → 0.610, LooGLE ×0.76 → ×0.72; Zipf toolbench's
             whole-run TTFT p99 at 1.5× ×1.29 → ×1.56 (its warm p99 ×0.87 → ×0.83).
    O_w      overflow risk: U_k = max_{j<l} (U'[j] + (P_priv + j)·[j < D]) / M_kv, the virtual peak over the next
             l iterations of the anticipated occupancy U' = the anticipator's map + the requests queued ahead
             (P_x + j for j < D_x from offset 0: PreServe leaves them out, but they will be admitted before r);
             tokens above T_mem would be preempted and recomputed, priced as requests of the running mean
             context c̄ re-prefilled: O_w = (max(0, U_k − T_mem) × M_kv / c̄) × PREFILLTIME(c̄, 0). β = 1 is
             PreServe's (one overflow token = one prefill token). With `overflow_wait` (default) O_w adds the
             victims' wait for KV: under recompute preemption a victim waits at the head of the queue until
             memory frees, so A = Σ_j max(0, U'_r[j] − T_mem·M_kv) token-iterations above T_mem are A / c̄
             request-iterations of waiting, each one decode iteration of w's batch (as W's clock). Measured: at
             1.0× on 70B ShareGPT (300 s, 3 seeds) SLO 0.55 / 0.64 / 0.41 → 0.61 / 0.67 / 0.43 and a third fewer
             preemptions; identical results wherever U' stays under T_mem.
             T_mem = 0.9, not PreServe's 0.8: the margin under 1.0 is for prediction error, and at 0.8 O priced
             occupancy that never overflowed, so near capacity placement chased anticipated peaks and queues grew
             (worst with true lengths). 70B ShareGPT, seeds 0 and 1, 0.95× and 0.975× capacity: SLO with the
             fallback +0.01 to +0.04, with true lengths +0.08 to +0.14; 1.0 (no margin) lost with the fallback at
             0.975× (0.78 → 0.75). Identical on 8B ShareGPT at 0.7-0.8× and the shared-prefix suite's 20k-block runs.
    P_priv   r's prompt minus the prefix w already holds: with `discount_shared_prefix` (PreServe §5.5's
             [project] flag) the map holds each request's private KV, so 100 requests sharing a 4k-token system
             prompt do not count 400k tokens.

Weights: λ = 0.1, measured (bench/sim.py, 4 workers, mean of 3 seeds; λ ∈ {0.05, 0.1, 0.25}). At λ = 1 the
cost is the marginal total latency (the social optimum), but I and D_out then outweigh r's own queueing: misses
pile onto the worker with the fewest decoders and a burst of one prefix serialises on its holder, costing TTFT
(preble-programming at 48 req/s: TTFT mean 1.11 vs 0.93 s at λ = 0.1); without I nothing but R holds a
prefix's traffic together (switchyard-no_interference, preble-toolbench at 34 req/s: hit ratio 0.817 → 0.771, TTFT
mean 0.133 → 0.246 s). λ = 0.05 favours programming's TTFT, 0.25 toolbench's.
Placement (`placement`): "argmin" (default) over every routable worker: R and I hold a prefix's traffic on its
holders, Q/D_in/W push back when they are loaded, so a hot prefix spills to a second worker when waiting costs more
than recomputing. "e2" keeps E2's exploit/explore split (exploit the key-portion holders when cached_len >
missed_len, with E2's rebalancing redirects and replicas) with this cost inside: better in the first seconds of a
cold toolbench trace (every request a miss at 34 req/s: TTFT p99 0.72 vs 0.91 s), worse on the programming trace,
whose bursts of one problem it serialises on the holder (TTFT mean 1.14 vs 0.93 s at 40 req/s). E2's P/D
balancing is off (I prices it), its history L is off (`load_signal="outstanding"`): Q, D and W are the current
load L approximated. M, O and W only act under KV pressure (they are inert on the 70B profile's 496k-token cache).

Predicted lengths: `RoutingContext.predicted_output_tokens` (the router's predictor or a client hint); when None,
this policy's `LengthFallback` (running mean per (model, prompt-length bucket), learning from every `on_finish`).
Clamped to [1, max_len], not to `max_tokens` (in the simulator that is the true length: it would leak the
oracle). Returned in `Decision.predicted_output_tokens` and fed to the anticipator at dispatch.

Missing signals: no Stats → the anticipator's clock counts from first sight; no KV events → R uses this router's
dispatches; no profile → the online fit (the default profile until it has samples); no max_num_batched_tokens →
`default_batched_tokens`. Ties: lowest cost, then E2's rotation (candidate index − dispatches) mod n; no RNG.
Cost per decision: branch and bound over the pool (`prune`). Every worker gets an O(1) lower bound (R and D_self
exact, Q's prefill part, I over its queued requests only; every other term >= 0; computed and sorted in Cython,
`ext/e2_select.argmin_order`, as is the pool's clock sync, `ext/anticipator.sync_known`); workers are then priced
in bound order, O(requests on the worker + l) each, until the next bound exceeds the best cost found; a priced
worker whose cost without M, O and W already exceeds the best is dropped before those are priced. Exact: the
same pick as pricing every worker (a test replays loaded runs both ways). It cuts most of the pricing where
misses are dear (R spreads the bounds); where decode co-residency dominates (long answers, busy workers: the
bound has no D_in) nearly every worker is still priced. The fill level reads every worker's D_in once before any
is priced (`ext/e2_select.fill_level`: each worker's `Anticipator.decode_in` sums its map's records in C, O(records),
and its requests without a first token, `queued`; D_self once per run of workers sharing a cost model); each bound holds
d·max(0, L − the pool's largest D_self), the D_in every cost holds at least. bench
decisions, 16 workers: see README.

Ablation keys, one term dropped each: switchyard-no_queue, switchyard-no_prefix (R and M: no prefix awareness),
switchyard-no_evict, switchyard-no_decode (D_self + D_in + λ·D_out), switchyard-no_interference,
switchyard-no_behind, switchyard-no_overflow, switchyard-no_kv_wait; switchyard-e2_split (placement "e2");
switchyard-no_fill (D_in without the fill level); and switchyard-no_mirror (router replicas side by side see only
their own requests: `router.peer_mirror`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import add
from typing import Any, Literal, NamedTuple

from pydantic import Field

from switchyard.ext.anticipator import Anticipator
from switchyard.ext.e2_select import (
    ArgminEnv,
    argmin_bounds,
    argmin_order,
    fill_level,
    head_terms,
    raw_bounds,
)
from switchyard.router.policies.anticipation import AnticipationTracker
from switchyard.router.policies.base import (
    Decision,
    FleetView,
    Policy,
    RoutingContext,
    WorkerId,
    WorkerView,
)
from switchyard.router.policies.preble_cost import CostModel
from switchyard.router.policies.preble_e2 import E2Config, PrebleE2
from switchyard.router.predictor.fallback import LengthFallback

log = logging.getLogger(__name__)


class SwitchyardConfig(E2Config):
    """E2's knobs (tree windows, eviction pricing, profiles, online fit) plus the cost's weights and the
    anticipator's. Defaults differ from E2 where the cost replaces an E2 mechanism (see the module docstring)."""

    placement: Literal["argmin", "e2"] = "argmin"
    queue_weight: float = Field(default=1.0, ge=0)  # q: weight of Q_w
    prefix_weight: float = Field(default=1.0, ge=0)  # p: weight of R_w
    eviction_weight: float = Field(default=1.0, ge=0)  # e: weight of M_w on top of λ (0 drops it)
    decode_weight: float = Field(default=1.0, ge=0)  # d: weight of D_self + D_in + λ·D_out
    interference_weight: float = Field(default=1.0, ge=0)  # i: weight of I_w on top of λ (0 drops it)
    # λ: what a second of other requests' latency (D_out, I, B, M) is worth against a second of r's own
    externality_weight: float = Field(default=0.1, ge=0)
    behind_weight: float = Field(default=1.0, ge=0)  # weight of B_w on top of λ (0 drops it)
    arrival_window_s: float = Field(default=10.0, gt=0)  # B_w's arrival rate: dispatches over this window
    # B_w counts the arrivals until w's prefill backlog drains at w's measured load ρ_w (the busy period
    # (Q + R) / (1 − ρ_w)), not only until r's first token
    busy_period: bool = True
    overflow_weight: float = Field(default=1.0, ge=0)  # β: weight of O_w (PreServe β = 1)
    # O_w: the preempted requests' wait for KV (the area of U' above T_mem) besides their re-prefill
    overflow_wait: bool = True
    kv_wait_weight: float = Field(default=1.0, ge=0)  # weight of W_w
    queue_pricing: Literal["sum", "batched"] = "batched"  # Q: E2's Σ single-request PT, or batched (Q_w)
    default_batched_tokens: int = Field(default=8192, ge=1)  # B when a worker does not report it (vLLM's)
    # the map holds prompt − the prefix the worker already caches (PreServe §5.5 [project] flag)
    discount_shared_prefix: bool = True
    # Q_w, I_w: r's prefill joins the prompts queued on w when they fit one iteration (T + m <= B), instead of
    # running in an iteration of its own
    joint_prefill: bool = True
    # D_self_w + D_in_w: at least the water level L the router's next arrivals fill the quicker workers to while r
    # decodes
    decode_fill: bool = True
    # T_mem: the KV fraction above which O prices the anticipated occupancy as preempted (PreServe §6: 0.8; why
    # 0.9 here: the module docstring's O)
    t_mem: float = Field(default=0.9, gt=0, le=1)
    horizon: int = Field(default=100, ge=1)  # l: iterations of the virtual peak (PreServe §5.1)
    max_len: int = Field(default=4096, ge=1)  # L: longest record the anticipator keeps (PreServe §5.1)
    ext_frac: float = Field(default=0.2, ge=0)  # overrun extension / prediction (PreServe §5.2)
    fallback_prior_tokens: float = Field(default=256.0, gt=0)  # LengthFallback's prior before any finish
    # E2 defaults changed: Q only (no 3-minute history L), no P/D balancing (I_w prices it); rebalancing and
    # replication stay on but run only in placement "e2" (`_skew_rules_steer`)
    load_signal: Literal["history", "outstanding", "both"] = "outstanding"
    enable_pd_balancing: bool = False
    # branch and bound: price workers in order of a cheap lower bound, stop when it exceeds the best cost so far
    # (the same pick as pricing every worker; False prices all, the reference the tests compare with)
    prune: bool = True


class Terms(NamedTuple):
    """One worker's cost for one request, term by term (seconds, unweighted) and the weighted total. A tuple: a
    select prices ~3 of them, and a frozen dataclass of 13 fields took ~1.4 µs to build against ~0.3 µs."""

    queue_s: float  # Q
    prefill_s: float  # R
    evict_s: float  # M
    decode_self_s: float  # D_self
    decode_in_s: float  # D_in: r slowed by w's batch
    decode_out_s: float  # D_out: w's batch slowed by r
    interference_s: float  # I
    behind_s: float  # B
    overflow_s: float  # O
    kv_wait_s: float  # W
    history_s: float  # E2's L (0 unless load_signal includes "history")
    peak_frac: float  # U_k
    total_s: float

    @property
    def decode_co_s(self) -> float:
        """D_co = D_in + D_out, unweighted."""
        return self.decode_in_s + self.decode_out_s


@dataclass(slots=True)
class _Req:
    worker: WorkerId
    prompt_tokens: int
    predicted_tokens: int
    model: str
    kv_prompt_tokens: int  # prompt tokens not shared with w's cache at dispatch (what the map holds for it)


class _Window:
    """A count of events over the last `window_s`, or over the time since the window opened while it is not yet
    full (at least `MIN_SPAN_S`, about one prefill, under which a count is noise)."""

    MIN_SPAN_S = 0.1

    __slots__ = ("window_s", "events", "total", "first")

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.events: deque[tuple[float, int]] = deque()  # (t, count), t non-decreasing: the expired are a prefix
        self.total = 0  # Σ counts
        self.first: float | None = None

    def add(self, now: float, k: int = 1) -> None:
        """`k` events at `now` (k = 0 only opens the window)."""
        if self.first is None:
            self.first = now
        if k:
            self.events.append((now, k))
            self.total += k
        cutoff = now - self.window_s
        events = self.events
        while events and events[0][0] < cutoff:
            self.total -= events.popleft()[1]

    def rate(self, now: float) -> float:
        """Read-only (select is pure): the expired head is only stepped over, O(expired); `add` drops it."""
        if self.first is None:
            return 0.0
        cutoff = now - self.window_s
        n = self.total
        for t, k in self.events:
            if t >= cutoff:
                break
            n -= k
        return n / min(self.window_s, max(self.MIN_SPAN_S, now - self.first))


class ArrivalRate:
    """Requests per second reaching one model's workers (B_w's arrival rate): the larger of two counts over the
    last `window_s`. This router's own dispatches (`add`, first attempts only: a retry is not an arrival) are
    current, but see only this replica's share. The workers' Stats (`observe`: each one's cumulative
    `num_requests_received`) count every replica's requests, one Stats poll late. With one router the two agree
    to within that lag, and a cold start's burst reads in the first; with K replicas sharing the workers the
    second is K times the first, and it is the rate B needs (workers are the source of truth)."""

    __slots__ = ("own", "fleet", "seen")

    def __init__(self, window_s: float) -> None:
        self.own = _Window(window_s)
        self.fleet = _Window(window_s)
        self.seen: dict[WorkerId, int] = {}  # each worker's counter at the last observation

    def add(self, now: float) -> None:
        self.own.add(now)

    def observe(self, workers: Sequence[WorkerView], now: float) -> None:
        """The workers' counters (from their last Stats); a worker's first sighting is its baseline."""
        n = 0
        seen = self.seen
        for w in workers:
            c = w.num_requests_received
            last = seen.get(w.worker_id)
            seen[w.worker_id] = c
            if last is not None:
                n += c - last if c >= last else c  # a restarted worker counts from 0
        self.fleet.add(now, n)

    def forget(self, worker_id: WorkerId) -> None:
        self.seen.pop(worker_id, None)

    def rate(self, now: float) -> float:
        return max(self.own.rate(now), self.fleet.rate(now))


class BusyFraction:
    """ρ_w for B's busy period: the fraction of the last `window_s` during which w had requests waiting for their
    first token (this router's dispatches), i.e. its prefill queue was not empty: an M/G/1 queue is busy a
    fraction ρ of the time. Measured, not modelled: it sees decode-slowed prefills and bursts as they were. With
    it, the span it covers: the window, or less while the router has known w for less."""

    __slots__ = ("window_s", "closed", "total", "since", "first")

    def __init__(self, window_s: float, now: float) -> None:
        self.window_s = window_s
        self.closed: deque[tuple[float, float]] = deque()  # busy intervals (start, end), in order
        self.total = 0.0  # Σ their lengths
        self.since: float | None = None  # the open interval's start while busy
        self.first = now  # the router's first dispatch to w: the span until the window fills (>= MIN_SPAN_S)

    def set_busy(self, busy: bool, now: float) -> None:
        """At each change of w's state; the intervals that left the window are dropped then."""
        since = self.since
        if busy == (since is not None):
            return
        if since is None:
            self.since = now
        else:
            if now > since:
                self.closed.append((since, now))
                self.total += now - since
            self.since = None
        cutoff = now - self.window_s
        closed = self.closed
        while closed and closed[0][1] <= cutoff:
            a, b = closed.popleft()
            self.total -= b - a

    def load(self, now: float) -> tuple[float, float]:
        """(ρ, the span it was measured over). Read-only (select is pure): the intervals reaching back past the
        window are only stepped over, O(expired); `set_busy` drops them."""
        start = now - self.window_s
        if start < self.first:
            start = self.first
        span = now - start
        if span < _Window.MIN_SPAN_S:  # as the arrival rate: under about one prefill a fraction is noise
            span = _Window.MIN_SPAN_S
        busy = self.total
        for a, b in self.closed:
            if a >= start:
                break
            busy -= (b if b < start else start) - a
        if self.since is not None:
            busy += now - (self.since if self.since > start else start)
        return busy / span, span


class Switchyard(PrebleE2):
    name = "switchyard"

    def __init__(self, config: SwitchyardConfig | None = None) -> None:
        self.sy = cfg = config or SwitchyardConfig()
        super().__init__(cfg)
        self.tracker = AnticipationTracker(cfg.horizon, cfg.max_len, cfg.ext_frac)
        self.fallback = LengthFallback(prior=cfg.fallback_prior_tokens)
        self.reqs: dict[str, _Req] = {}
        # per worker, its requests of `reqs` without a first token yet (the rest are in its map)
        self.queued: dict[WorkerId, dict[str, _Req]] = {}
        self.busy: dict[WorkerId, BusyFraction] = {}  # when queued[w] is not empty, for B's busy period
        self.arrivals: dict[str, ArrivalRate] = {}  # per model, for B_w
        # selects that left a prefix's best holder where E2 would have exploited it (`counters`)
        self.num_prefix_spills = 0
        self._argmin_env = ArgminEnv(  # what the bound pass reads, by reference (`lower_bounds`)
            cost_memo=self._cost_memo, cost_model=self.cost_model, outstanding=self.outstanding,
            queued=self.queued, batched_tokens=self.batched_tokens, queue_weight=cfg.queue_weight,
            prefix_weight=cfg.prefix_weight, decode_weight=cfg.decode_weight,
            interference_weight=cfg.interference_weight * cfg.externality_weight,
            queue_by_sum=cfg.queue_pricing == "sum", joint_prefill=cfg.joint_prefill,
            externality_weight=cfg.externality_weight, interference_term_weight=cfg.interference_weight,
            behind_weight=cfg.behind_weight, window_s=cfg.arrival_window_s,
        )

    def arrival_rate(self, model: str) -> ArrivalRate:
        got = self.arrivals.get(model)
        if got is None:
            got = self.arrivals[model] = ArrivalRate(self.sy.arrival_window_s)
        return got

    # ------------------------------------------------------------------------------------------ cost
    def predicted_tokens(self, ctx: RoutingContext) -> int:
        """D: the router's prediction, else the fallback's running mean; in [1, max_len]."""
        d = ctx.predicted_output_tokens
        if d is None:
            d = self.fallback.predict(ctx.model, ctx.num_prompt_tokens)
        return max(1, min(int(d), self.sy.max_len))

    def shared_tokens(self, w: WorkerId, ctx: RoutingContext) -> int:
        """Prompt tokens whose KV blocks w already holds (resident or assigned), so r's KV shares them."""
        if not ctx.block_hashes:
            return 0
        facts = self._facts.get(w)
        bs = facts.block_size if facts else 16
        return min(self.held(w, ctx)[0] * bs, max(0, ctx.num_prompt_tokens - 1))

    def batch(self, w: WorkerId, ant: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """w's anticipated batch: running [(remaining predicted tokens, context)] and queued [(prompt, private
        prompt, D)].

        Running = in the anticipator (its record, overrun extensions included; the tracker adds r there at its
        first token, with its whole prompt as context: decode attention reads shared blocks too, while the map's
        tokens are the private ones); queued = dispatched without a first token yet (`queued`: not in the map,
        PreServe §5.5), assumed to start decoding before r, its prompt as context.
        """
        return ant.batch(self.queued.get(w, {}))  # `ext/anticipator`: the records' loop in C

    @staticmethod
    def occupancy(ant: Any, queued: list[tuple[int, int]], horizon: int) -> list[int]:
        """U'[j], j < horizon, in tokens: the map plus each queued x holding P_x + j for j < D_x from offset 0.

        Every x starts at offset 0, so the live set only shrinks: between consecutive ends it is fixed, and its
        k members add c + k·j (c = Σ P_x) to U'[j]. One C-level slice update per such segment (integers: the same
        sums in any order)."""
        u = ant.load_tokens(horizon)
        if queued:
            h = len(u)
            live, c, start = len(queued), sum(p for p, _ in queued), 0
            for e, p in sorted((d if d < h else h, p) for p, d in queued):
                if e > start:  # offsets [start, e): every x still live holds its prompt + j
                    u[start:e] = map(add, u[start:e], range(c + live * start, c + live * e, live))
                    start = e
                live -= 1
                c -= p
        return u

    def memory_s(
        self, ant: Any, queued: list[tuple[int, int]], prompt_tokens: int, d: int, cost: CostModel
    ) -> tuple[float, float, float]:
        """(O_w s, W_w s, U_k): overflow risk and KV wait over the anticipated occupancy U' (module docstring)."""
        cfg = self.sy
        cap = ant.capacity_tokens
        p = prompt_tokens
        if not queued:
            # NOTE: the common case, without building U': with nothing queued U' is the map (exact ints >= 0), so
            # U_k is the map's `virtual_peak` (the same max, divided as the int peak / cap is: both < 2^53).
            # U_k < T_mem means peak < T_mem·cap, so peak <= fl(T_mem·cap) and O = 0; U'[0] is the resident
            # tokens, so W = 0 when r's prompt fits beside them. Anything else is priced below.
            frac = ant.virtual_peak(p, d, cfg.horizon)
            if frac < cfg.t_mem and ant.resident_tokens() + p <= cap:
                return 0.0, 0.0, frac
        u = self.occupancy(ant, queued, cfg.horizon)
        e = min(d, len(u))  # r holds p + j at offsets j < D: one C-level pass over each part of the window
        peak = max(max(map(add, u, range(p, p + e)), default=0), max(u[e:], default=0))  # map stops at e
        k = len(ant)
        mean_ctx = max(1, ant.resident_tokens() // k if k else p)
        over = 0.0
        thr = cfg.t_mem * cap
        excess = peak - thr
        if excess > 0:
            over = excess / mean_ctx * cost.prefill_s(mean_ctx, 0)
            if cfg.overflow_wait:
                # the victims also wait, out of KV, until the overflow passes: the area of U' (r included) above
                # T_mem, in token-iterations, is (area / c̄) request-iterations of waiting
                area = sum(x - thr for x in map(add, u, range(p, p + e)) if x > thr)
                area += sum(x - thr for x in u[e:] if x > thr)
                over += area / mean_ctx * self.iteration_s(cost, k, mean_ctx)
        wait = 0.0
        if u and u[0] + p > cap:  # no room for r's prompt now: it waits until the batch frees enough KV
            j = next((i for i, x in enumerate(u) if x + p <= cap), -1)
            if j < 0 and cfg.max_len > len(u):
                j = next(
                    (i for i, x in enumerate(self.occupancy(ant, queued, cfg.max_len)) if x + p <= cap), -1
                )
            if j < 0:
                j = cfg.max_len
            wait = j * self.iteration_s(cost, k, mean_ctx)
        return over, wait, peak / cap

    @staticmethod
    def iteration_s(cost: CostModel, k: int, mean_ctx: int) -> float:
        """One decode iteration of a batch of k requests of mean context c̄ (the clock of O's and W's waits)."""
        return cost.decode_s(1, mean_ctx) + cost.decode_marginal_s(max(0, k - 1), mean_ctx)

    @staticmethod
    def missed_tokens(w: WorkerView, cached_blocks: int, p: int) -> int:
        """r's prompt tokens w must compute: those past the prefix it caches (the last one always)."""
        shared = cached_blocks * w.block_size
        last = p - 1 if p > 1 else 0
        return p - (shared if shared <= last else last)

    def batched_tokens(self, w: WorkerView) -> int:
        """B: w's max_num_batched_tokens, or `default_batched_tokens` when it does not report it."""
        info = getattr(w, "info", None)
        return max(1, int(getattr(info, "max_num_batched_tokens", 0) or self.sy.default_batched_tokens))

    def lower_bounds(
        self, pool: Sequence[WorkerView], ctx: RoutingContext, cached: dict[WorkerId, int], d: int
    ) -> list[float]:
        """Per pool worker, in pool order, a cost no higher than `terms(...).total_s`, from O(1) state (no
        anticipator sync, no batch walk): R and D_self exactly, Q without its decode part, I with the queued
        requests alone as co-runners, every other term 0 (`ext/e2_select.argmin_bounds`: the loop every select
        runs over the whole pool, in Cython; the same floats as the terms `head_terms` prices, which a test checks)."""
        return argmin_bounds(self._argmin_env, pool, cached, ctx.num_prompt_tokens, d)

    def terms(
        self, w: WorkerView, ctx: RoutingContext, cached_blocks: int, path: list[Any], d: int, now: float,
        beat: float | None = None, ant: Anticipator | None = None, arrivals_per_s: float = 0.0,
        prefill_load: float = 0.0, load_span_s: float | None = None, level: float = 0.0,
    ) -> Terms | None:
        """Every term of w's cost; None when `beat` is given and the cost already exceeds it without M, or without
        M, O and W (M, an LRU eviction simulation, is the dearest term, then O and W's walk over the occupancy;
        all three are >= 0 and rounded float addition is monotone, so each partial sum is <= the total). `ant`:
        w's map already synced at `now` in this select (a second sync at the same `now` and the same Stats
        changes nothing), else it is synced here. `arrivals_per_s`: the requests expected at w per second (B_w;
        0 prices no arrivals). `level`: the fill level L, the floor of D_self + D_in (`fill_level`; 0: none)."""
        cfg = self.sy
        lam = cfg.externality_weight
        wid = w.worker_id
        cost = self.cost_model(wid)
        p = ctx.num_prompt_tokens
        # E2's bound kernel for w alone: Q, R (and L when load_signal asks for it), the blocks r would evict; M next
        load, r, q, evict = raw_bounds(self._bounds_env, (w,), {wid: cached_blocks}, p, now)[0]
        m = 0.0
        if evict > 0 and beat is None:
            m = self._evict_s(w, evict, now, self._protected(path))
        if ant is None:
            ant = self.tracker.sync(w, now)
        running, queued = self.batch(wid, ant)
        # Q (batched, or E2's under "sum" pricing), D_self, D_co of the running and the queued, I (r's step gain
        # on each co-runner) and B: the requests that reach w before r's prefill is done wait behind it (FCFS
        # admission), each by its step, and under prefill load ρ they keep arriving until w's backlog drains
        # (the busy period: module docstring); with their weighted sums head = L + Q + R, dec = D and
        # inter = λ·(I + B). One call: `ext/e2_select.head_terms` (its reference's docstring has each formula).
        queue, d_self, d_in, d_out, interference, behind, missed, head, dec, inter = head_terms(
            self._argmin_env, w, cost, running, queued, p, d, cached_blocks, load, r, q, arrivals_per_s,
            prefill_load, load_span_s)
        if d_self + d_in < level:  # the next arrivals fill w to L while r decodes (module docstring: D_in)
            d_in = level - d_self
            dec = cfg.decode_weight * (d_self + d_in + lam * d_out)
        # the total's sum, left to right: head + λe·M + d·D + λ·(i·I + b·B) + β·O + W (the same float as one
        # expression); the checks against `beat` price the terms not known yet at 0, in the same sum
        ew, ow, kw = lam * cfg.eviction_weight, cfg.overflow_weight, cfg.kv_wait_weight
        if beat is not None and head + ew * 0.0 + dec + inter + ow * 0.0 + kw * 0.0 > beat:
            return None  # loses before M, O and W are priced
        kv_p = missed if cfg.discount_shared_prefix else p
        over, wait, peak = self.memory_s(ant, [(kx, dx) for _, kx, dx in queued], kv_p, d, cost)
        if evict > 0 and beat is not None:
            if head + ew * 0.0 + dec + inter + ow * over + kw * wait > beat:
                return None
            m = self._evict_s(w, evict, now, self._protected(path))
        total = head + ew * m + dec + inter + ow * over + kw * wait
        return Terms(
            queue,
            r,
            m,
            d_self,
            d_in,
            d_out,
            interference,
            behind,
            over,
            wait,
            load,
            peak,
            total,
        )

    # ------------------------------------------------------------------------------------------ select
    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = full = self.pool(ctx, fleet)
        if not pool:
            return None
        self._remember(fleet, pool, ctx.model)
        cached, best_blocks, path = self.prefix(ctx, pool)
        cached_len = min(best_blocks * pool[0].block_size, ctx.num_prompt_tokens)
        exploitable = cached_len > ctx.num_prompt_tokens - cached_len  # E2's exploit test (errata E1)
        why = "argmin"
        if self.sy.placement == "e2":
            if exploitable:
                key, key_end = self._key_end(path, best_blocks)
                ks = self._exploit_set(key, key_end, pool, cached, now)
                if ks:
                    pool, why = ks, "exploit"
                else:
                    why = "explore"
            else:
                why = "explore"
        d = self.predicted_tokens(ctx)
        n = len(pool)
        rate = self.arrival_rate(ctx.model).rate(now)
        per_worker = rate / n  # B_w: an even share of the model's arrivals
        turn = self._turn
        ants: list[Anticipator] | list[None]
        level = floor = 0.0
        if self.sy.decode_fill and rate > 0.0:
            # L over the whole pool (the arrivals fill every routable worker, held prefix or not)
            synced = self.tracker.sync_all(full, now)
            level, floor = fill_level(self._argmin_env, full, synced, ctx.num_prompt_tokens, d, rate)
            ants = synced if pool is full else self.tracker.sync_all(pool, now)
        elif self.sy.prune:
            # every clock moves now, priced or not: the anticipator's integration of the iteration rate depends
            # on when it is sampled, so a pruned worker synced later would drift from the reference
            ants = self.tracker.sync_all(pool, now)
        else:
            ants = [None] * n  # the reference: each worker synced as it is priced
        if self.sy.prune:
            # (lower bound, E2's rotation (i - turn) mod n, i), ascending: the rotation is a permutation, so no two
            # keys tie (the bounds hold under the level: it only raises D_in)
            order = argmin_order(self._argmin_env, pool, cached, ctx.num_prompt_tokens, d, turn)
        else:
            order = [(0.0, (i - turn) % n, i) for i in range(n)]
        terms: dict[WorkerId, Terms] = {}
        best: tuple[float, int] | None = None
        pick = pool[0]
        busy = self.busy if self.sy.busy_period and per_worker > 0.0 else {}  # B's ρ_w (none: ρ = 0)
        lift = self.sy.decode_weight * floor  # every cost holds d·floor (D_in >= floor); the bounds hold no D_in
        for bound, r, i in order:
            # exact: an unpriced worker costs >= its bound > the best cost (the margin absorbs float rounding
            # between the bound's and the total's sums, so a tie is always priced and broken by rotation)
            beat = None if best is None else best[0] + 1e-9 * max(1.0, best[0])
            if beat is not None and bound + lift > beat:
                break
            w = pool[i]
            wb = busy.get(w.worker_id)
            got = self.terms(w, ctx, cached[w.worker_id], path, d, now, beat if self.sy.prune else None, ants[i],
                             per_worker, *(wb.load(now) if wb is not None else (0.0, None)), level)
            if got is None:
                continue  # its cost without M (or M, O and W) already exceeds the best: they are not priced
            t = terms[w.worker_id] = got
            key = (t.total_s, r)
            if best is None or key < best:
                best, pick = key, w
        t = terms[pick.worker_id]
        if exploitable and cached[pick.worker_id] < best_blocks:
            self.num_prefix_spills += 1
        reason = why  # its figures only where a DEBUG line prints them (formatting them was ~2% of a select)
        if log.isEnabledFor(logging.DEBUG):
            reason = f"{why} cost={t.total_s:.3f}s R={t.prefill_s:.3f} D_co={t.decode_co_s:.3f} peak={t.peak_frac:.2f}"
            cfg = self.sy
            lam = cfg.externality_weight
            log.debug(
                "request=%s switchyard %s -> %s: cost = %g·Q %.4f + %g·R %.4f + %g·M %.4f + %g·(D_self %.4f + D_in %.4f"
                " + %g·D_out %.4f) + %g·I %.4f + %g·B %.4f + %g·O %.4f (peak %.3f) + %g·W %.4f%s = %.4f s; P=%d D=%d%s;"
                " priced %d/%d: %s",
                ctx.request_id,
                why,
                pick.worker_id,
                cfg.queue_weight,
                t.queue_s,
                cfg.prefix_weight,
                t.prefill_s,
                cfg.eviction_weight * lam,
                t.evict_s,
                cfg.decode_weight,
                t.decode_self_s,
                t.decode_in_s,
                lam,
                t.decode_out_s,
                cfg.interference_weight * lam,
                t.interference_s,
                cfg.behind_weight * lam,
                t.behind_s,
                cfg.overflow_weight,
                t.overflow_s,
                t.peak_frac,
                cfg.kv_wait_weight,
                t.kv_wait_s,
                f" + L {t.history_s:.4f}" if t.history_s else "",
                t.total_s,
                ctx.num_prompt_tokens,
                d,
                "" if ctx.predicted_output_tokens is not None else " (fallback)",
                len(terms),
                n,
                {k: round(v.total_s, 4) for k, v in terms.items()},
            )
        return Decision(worker_id=pick.worker_id, predicted_output_tokens=d, reason=reason)

    # ------------------------------------------------------------------------------------------ hooks
    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        w = decision.worker_id
        if not ctx.attempt:  # a retry is not a new arrival
            self.arrival_rate(ctx.model).add(now)
        # before E2 assigns r's path to w (after, the whole prompt would count as cached)
        shared = self.shared_tokens(w, ctx) if self.sy.discount_shared_prefix else 0
        super().on_dispatch(ctx, decision, now)
        d = decision.predicted_output_tokens or self.predicted_tokens(ctx)
        self._drop(ctx.request_id, now)  # a retry: the earlier attempt is gone (the tracker does the same)
        # the map holds r's private KV: its prompt minus the prefix w already holds (PreServe §5.5 [project] flag)
        self.tracker.on_dispatch(ctx, w, d, now, max(0, ctx.num_prompt_tokens - shared))
        rq = _Req(
            w,
            ctx.num_prompt_tokens,
            max(1, min(d, self.sy.max_len)),
            ctx.model,
            ctx.num_prompt_tokens - shared,
        )
        self.reqs[ctx.request_id] = rq
        self.queued.setdefault(w, {})[ctx.request_id] = rq
        self._queued_changed(w, now)

    def on_first_token(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        super().on_first_token(request_id, worker_id, now)
        self.tracker.on_first_token(request_id, worker_id, now)
        q = self.queued.get(worker_id)
        if q is not None and q.pop(request_id, None) is not None:  # a duplicate or stale first token: not there
            self._queued_changed(worker_id, now)

    def on_finish(self, request_id: str, worker_id: WorkerId, now: float, num_output_tokens: int) -> None:
        super().on_finish(request_id, worker_id, now, num_output_tokens)
        self.tracker.on_finish(request_id, worker_id, now)
        rq = self.reqs.get(request_id)
        if rq is not None and rq.worker == worker_id:
            self.fallback.observe(rq.model, rq.prompt_tokens, num_output_tokens)
            self._drop(request_id, now)

    def on_abort(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        super().on_abort(request_id, worker_id, now)
        self.tracker.on_abort(request_id, worker_id, now)
        rq = self.reqs.get(request_id)
        if rq is not None and rq.worker == worker_id:
            self._drop(request_id, now)

    def on_worker_change(self, worker_id: WorkerId, now: float) -> None:
        rec = self._fleet.get(worker_id) if self._fleet is not None else None
        super().on_worker_change(worker_id, now)
        if rec is None or not getattr(rec, "healthy", rec.is_routable):  # gone or unhealthy, as E2 decides
            self.tracker.forget_worker(worker_id)
            for rid in [rid for rid, rq in self.reqs.items() if rq.worker == worker_id]:
                del self.reqs[rid]
            self.queued.pop(worker_id, None)
            self.busy.pop(worker_id, None)
            for a in self.arrivals.values():
                a.forget(worker_id)

    def _skew_rules_steer(self) -> bool:
        return self.sy.placement == "e2"  # "argmin" prices every worker: no exploit set reads redirects or replicas

    def counters(self) -> dict[str, int]:
        """prefix_spills: selects whose pick holds fewer of the prompt's leading blocks than its best holder while
        that holder caches more of the prompt than it misses (where E2 would exploit the holders): how often the
        cost sent a request away from its cache to spare it a queue, and the fleet recomputed the prefix. With
        E2's redirects and replicas only where they steer requests (placement "e2"; under "argmin" the passes
        do not run)."""
        out = super().counters() if self._skew_rules_steer() else {}
        out["prefix_spills"] = self.num_prefix_spills
        return out

    def on_tick(self, now: float) -> None:
        super().on_tick(now)
        if self._fleet is not None:  # the workers' arrival counters, for B's rate (every replica's requests)
            for model in self._models:
                self.arrival_rate(model).observe(self._fleet.workers(model), now)

    def _drop(self, request_id: str, now: float) -> None:
        rq = self.reqs.pop(request_id, None)
        if rq is None:
            return
        q = self.queued.get(rq.worker)
        if q is not None and q.pop(request_id, None) is not None:  # before its first token
            self._queued_changed(rq.worker, now)

    def _queued_changed(self, w: WorkerId, now: float) -> None:
        """queued[w] gained or lost a request: w's busy intervals (busy while it holds any)."""
        b = self.busy.get(w)
        if b is None:
            b = self.busy[w] = BusyFraction(self.sy.arrival_window_s, now)
        b.set_busy(bool(self.queued.get(w)), now)

    def prefill_load(self, w: WorkerId, now: float) -> float:
        """ρ_w for B's busy period: the fraction of the window w's prefill queue was busy (0 if never seen)."""
        b = self.busy.get(w)
        return b.load(now)[0] if b is not None else 0.0


def _variant(key: str, doc: str, **overrides: Any) -> Callable[[], Policy]:
    """A registry constructor: the default config with `overrides` (one ablated term)."""

    def make() -> Policy:
        p = Switchyard(SwitchyardConfig(**overrides))
        p.name = key
        return p

    make.__doc__ = doc
    return make


ABLATIONS: dict[str, Callable[[], Policy]] = {
    "switchyard-no_queue": _variant("switchyard-no_queue", "without Q", queue_weight=0.0),
    "switchyard-no_prefix": _variant(
        "switchyard-no_prefix", "without R and M", prefix_weight=0.0, eviction_weight=0.0
    ),
    "switchyard-no_evict": _variant("switchyard-no_evict", "without M", eviction_weight=0.0),
    "switchyard-no_decode": _variant("switchyard-no_decode", "without D", decode_weight=0.0),
    "switchyard-no_interference": _variant(
        "switchyard-no_interference", "without I", interference_weight=0.0
    ),
    "switchyard-no_overflow": _variant("switchyard-no_overflow", "without O", overflow_weight=0.0),
    "switchyard-no_behind": _variant("switchyard-no_behind", "without B", behind_weight=0.0),
    "switchyard-no_kv_wait": _variant("switchyard-no_kv_wait", "without W", kv_wait_weight=0.0),
    "switchyard-e2_split": _variant("switchyard-e2_split", "E2's exploit/explore split", placement="e2"),
    # not a term: D_in as the worker's batch now, without the level L the next arrivals fill the quicker ones to
    "switchyard-no_fill": _variant("switchyard-no_fill", "D_in without the fill level", decode_fill=False),
    # not a term: other router replicas' requests unseen (each replica knows only its own dispatches)
    "switchyard-no_mirror": _variant("switchyard-no_mirror", "without other replicas' requests", mirror_peers=False),
}

__all__ = ["ABLATIONS", "Switchyard", "SwitchyardConfig", "Terms"]
