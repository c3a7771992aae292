"""Per-worker anticipation state for policies: PreServe's load anticipator plus the prefills still queued ahead.

Shared by `preserve` and the default policy (specs/preserve.md §5-6). Fed only by the policy hooks, so it runs the
same in the daemon and in `bench/sim.py`:

    dispatch ──> pending (queued_prefill_tokens += P) ──first token──> Anticipator.add(rid, P, D)
                     │                                                   │
                     └──────────── finish / abort ───────────────────────┴──> dropped (Anticipator.finish)

A request enters the map once its prefill completes (the paper's rule, §5.5: queued requests are the router's
L_p term, not the map's), and leaves it at finish or abort (an early finish drops its unused tail, §5.2). Its
record holds the KV it adds (the caller's `prompt_tokens`: its private part) and, as its context, its whole prompt:
what its decode attends to, which the default policy's D_in reads from the map (`Anticipator.decode_in`).

Iteration clock (§5.3 [inferred]; the paper does not say how the map moves): the map's offset 0 must track the
worker's next decode iteration. The router sees the worker's iteration counter only in Stats (every ~0.2 s), so
between samples it extrapolates:

    iteration(now) = base + Stats.num_iterations + ∫_{sample}^{now} rate(batch) dt

- rate = 1 / PerfProfile.iteration_time_s(P=0, A=0, D=n, C=c) for a worker with a profile (simulated workers;
  an unknown profile name falls back to the default profile, as `preble_cost.profile_cost` does), where n is the
  number of requests in the map and c their resident tokens: the decode iteration time at the current batch
  (`ProfileCost.decode_iteration_s`: that call written out, the same floats without its call chain).
- Workers with no profile (real vLLM, `perf_profile == ""`): the iterations per second observed between the last
  two Stats samples that showed progress [inferred]; the default profile until two such samples exist. NOTE: a
  worker idle for part of that interval is under-rated; the next sample corrects the clock.
- rate = 0 while the map is empty [inferred]: then the worker runs no decode iterations the map could count (it
  may run prefill-only iterations; the next Stats sample accounts for them).
- The integral is taken piecewise: every hook advances the clock before it changes the batch.
- The clock is `ext/anticipator.IterationClock` (C fields and the rate's formula in C in its Cython build), and a
  select syncs every known worker in one call (`sync_known`).
- The clock never runs backwards: a sample behind the extrapolation holds the map until the count catches up.
  A counter that goes down (the worker restarted) re-bases `base` so the clock continues from where it was.
- A worker with no Stats yet counts from 0 at the first time the tracker saw it.

Predicted lengths are the caller's (`predicted_tokens`): the router's predictor, a client hint, or the policy's
fallback when neither is known. They are clamped to [1, max_len].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from switchyard.ext.anticipator import Anticipator, IterationClock, sync_known
from switchyard.router.policies.base import RoutingContext, WorkerId, WorkerView
from switchyard.router.policies.preble_cost import profile_cost
from switchyard.workers.engine.profiles import DEFAULT_PROFILE


@dataclass(slots=True)
class _Request:
    worker_id: WorkerId
    prompt_tokens: int
    predicted_tokens: int
    context_tokens: int  # its whole prompt, shared prefix included: what its decode attends to
    running: bool = False  # past its first token: in the anticipator (or deferred until the worker is synced)


@dataclass(slots=True)
class _Worker:
    """One worker's map, its pending prefills, and its iteration clock."""

    anticipator: Anticipator | None = None  # created at the first sync (its capacity comes from the view)
    clock: IterationClock | None = None  # created with the map (its cost model comes from the view)
    queued_prefill_tokens: int = 0
    pending_decode_tokens: int = 0
    num_pending: int = 0
    deferred: dict[str, _Request] = field(default_factory=dict)  # first token before the anticipator existed


class AnticipationTracker:
    """Per-worker `Anticipator` + pending prefills + iteration clock, fed by a policy's hooks.

    Args:
        horizon: `l`, the look-ahead in iterations policies query (spec §5.1: 100).
        max_len: `L`, the max output tokens a record may reach with extensions (spec §5.1: 4096).
        ext_frac: overrun extension as a fraction of the prediction (spec §5.2: 0.2).
    """

    def __init__(self, horizon: int = 100, max_len: int = 4096, ext_frac: float = 0.2) -> None:
        if horizon < 1 or max_len < 1:
            raise ValueError("horizon and max_len must be >= 1")
        self.horizon = horizon
        self.max_len = max_len
        self.ext_frac = ext_frac
        self._workers: dict[WorkerId, _Worker] = {}
        self._requests: dict[str, _Request] = {}
        self._default_cost = profile_cost(DEFAULT_PROFILE)

    # ------------------------------------------------------------------------------------------ hooks
    def on_dispatch(
        self, ctx: RoutingContext, worker_id: WorkerId, predicted_tokens: int, now: float,
        prompt_tokens: int | None = None,
    ) -> None:
        """The request was sent to `worker_id`: its prompt is queued there until its first token. `prompt_tokens`:
        the prompt KV it will hold privately, when not all of it (a prefix shared with the worker's cache)."""
        if ctx.request_id in self._requests:  # a retry whose earlier attempt was never closed
            old = self._requests[ctx.request_id]
            self.on_abort(ctx.request_id, old.worker_id, now)
        d = max(1, min(int(predicted_tokens), self.max_len))
        req = _Request(worker_id, ctx.num_prompt_tokens if prompt_tokens is None else prompt_tokens, d,
                       ctx.num_prompt_tokens)
        self._requests[ctx.request_id] = req
        st = self._worker(worker_id)
        st.queued_prefill_tokens += req.prompt_tokens
        st.pending_decode_tokens += d
        st.num_pending += 1

    def on_first_token(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        """Prefill done: the request moves from the pending prefills into the map, starting at offset 0."""
        req = self._requests.get(request_id)
        if req is None or req.worker_id != worker_id or req.running:
            return
        st = self._worker(worker_id)
        self._unqueue(st, req)
        req.running = True
        ant = st.anticipator
        if ant is None:
            st.deferred[request_id] = req
            return
        self._advance(st, now)  # the batch is about to change: integrate the clock up to now first
        ant.add(request_id, req.prompt_tokens, req.predicted_tokens, req.context_tokens)

    def on_finish(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        """Done (early, on time or after extensions): its future contribution leaves the map."""
        req = self._requests.get(request_id)
        if req is None or req.worker_id != worker_id:
            return  # unknown, or a stale attempt on another worker
        del self._requests[request_id]
        st = self._worker(worker_id)
        if not req.running:
            self._unqueue(st, req)
            return
        if st.deferred.pop(request_id, None) is not None:
            return
        assert st.anticipator is not None
        self._advance(st, now)
        st.anticipator.finish(request_id)

    def on_abort(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        """Cancelled or failed, pending or running: forgotten the same way as a finish."""
        self.on_finish(request_id, worker_id, now)

    def forget_worker(self, worker_id: WorkerId) -> None:
        """Drop a removed worker's state and its requests."""
        self._workers.pop(worker_id, None)
        for rid in [r for r, req in self._requests.items() if req.worker_id == worker_id]:
            del self._requests[rid]

    # ------------------------------------------------------------------------------------------ queries
    def sync(self, worker: WorkerView, now: float) -> Anticipator:
        """The worker's map advanced to its estimated iteration at `now` (created on first sight)."""
        st = self._workers.get(worker.worker_id)
        if st is None:
            st = self._workers[worker.worker_id] = _Worker()
        ant = st.anticipator
        if ant is None:
            ant = self._create(st, worker, now)
        self._observe_stats(st, worker, now)
        self._advance(st, now)
        return ant

    def sync_all(self, workers: Sequence[WorkerView], now: float) -> list[Anticipator]:
        """`sync` of each worker, in order: a policy that prices a pool moves every clock at every select (the
        integration of the iteration rate depends on when it is sampled).

        NOTE: the hottest loop of a select. Every worker with a map is synced in one call
        (`ext/anticipator.sync_known`, in Cython: `sync`'s steps); one without (first sight) goes through `sync`,
        which creates it (each worker's sync reads and writes its own state alone, so the order between them does
        not matter).
        """
        out = sync_known(self._workers, workers, now)
        for i, ant in enumerate(out):
            if ant is None:
                out[i] = self.sync(workers[i], now)
        return out

    def queued_prefill_tokens(self, worker_id: WorkerId) -> int:
        """L_p's queued_p_i: prompt tokens dispatched to the worker whose prefill has not completed."""
        st = self._workers.get(worker_id)
        return st.queued_prefill_tokens if st is not None else 0

    def remaining_decode_tokens(self, worker_id: WorkerId) -> int:
        """L_d's current_d_i: Σ max(0, eff_r - g_r) over the requests past prefill (as of the last sync)."""
        st = self._workers.get(worker_id)
        if st is None:
            return 0
        deferred = sum(r.predicted_tokens for r in st.deferred.values())
        return deferred + (st.anticipator.remaining_decode_tokens() if st.anticipator is not None else 0)

    def pending_decode_tokens(self, worker_id: WorkerId) -> int:
        """Predicted decode tokens of the requests still waiting for their prefill (not in PreServe's L_d)."""
        st = self._workers.get(worker_id)
        return st.pending_decode_tokens if st is not None else 0

    def num_pending(self, worker_id: WorkerId) -> int:
        st = self._workers.get(worker_id)
        return st.num_pending if st is not None else 0

    def predicted_tokens(self, request_id: str) -> int | None:
        """The (clamped) prediction a tracked request was dispatched with; None if unknown or done."""
        req = self._requests.get(request_id)
        return req.predicted_tokens if req is not None else None

    def anticipator(self, worker_id: WorkerId) -> Anticipator | None:
        """The worker's map as of its last sync, without advancing it (None before the first sync)."""
        st = self._workers.get(worker_id)
        return st.anticipator if st is not None else None

    # ------------------------------------------------------------------------------------------ internals
    def _worker(self, worker_id: WorkerId) -> _Worker:
        st = self._workers.get(worker_id)
        if st is None:
            st = self._workers[worker_id] = _Worker()
        return st

    @staticmethod
    def _unqueue(st: _Worker, req: _Request) -> None:
        st.queued_prefill_tokens -= req.prompt_tokens
        st.pending_decode_tokens -= req.predicted_tokens
        st.num_pending -= 1

    def _create(self, st: _Worker, worker: WorkerView, now: float) -> Anticipator:
        capacity = max(1, worker.kv_capacity_blocks * worker.block_size)
        ant = Anticipator(capacity, max_len=self.max_len, ext_frac=self.ext_frac)
        st.anticipator = ant
        info = getattr(worker, "info", None)  # NOTE: WorkerView has no profile; the fleet's record carries it
        name = getattr(info, "perf_profile", "") or ""
        # its profile's iteration time; None: real vLLM, the rate from observed Stats. No Stats yet: the clock
        # counts from 0 at first sight
        st.clock = IterationClock(profile_cost(name) if name else None, self._default_cost, now)
        for rid, req in st.deferred.items():
            ant.add(rid, req.prompt_tokens, req.predicted_tokens, req.context_tokens)
        st.deferred.clear()
        return ant

    @staticmethod
    def _observe_stats(st: _Worker, worker: WorkerView, now: float) -> None:
        """Re-anchor the clock on the worker's Stats sample (`IterationClock.observe`: nothing when it is the one
        anchored on, or there is none yet)."""
        assert st.clock is not None and st.anticipator is not None
        st.clock.observe(st.anticipator, getattr(worker, "stats_at", None), worker.stats_age_s,
                         worker.num_iterations, now)

    @staticmethod
    def _advance(st: _Worker, now: float) -> None:
        """The clock integrated up to now, and the map moved with it (before any change to the batch); nothing
        before the map exists (`_create` makes both)."""
        if st.clock is not None:
            st.clock.advance(st.anticipator, now)
