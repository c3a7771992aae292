"""`switchyard bench sim`: discrete-event replay of a trace against N simulated engines in virtual time.

Dynamo-style offline replay: a logical clock over a heap of events (engine step completions, KV-event
deliveries) merged with the sorted arrivals and two periodic ticks (Stats polls, policy ticks). Each worker is
the same `EngineCore` the simulated worker process runs; every router-side concern goes through the daemon's
own code: `Fleet` (the one ingestion path for Stats and KV events), the policy registry, and the router queue's
hold condition. What a policy sees is what it would see live: Stats every `--stats-interval`, KV events
`--event-lag` after the step that produced them. `--router-replicas K` runs K routers side by side over the same
engines (each its own policy, fleet view, queue and timers; arrivals in turn), which learn each other's requests
only from the workers' request events, `--event-lag` late (`router.peer_mirror`).

Run: `switchyard bench sim --trace mooncake-conversation --workers 8 --policies round_robin,least_request`.
"""

from __future__ import annotations

import argparse
import gc
import heapq
import logging
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from switchyard.bench import conversations, report, servegen
from switchyard.bench import preble_workloads as preble
from switchyard.bench.metrics import (
    INCOMPLETE,
    NO_WORKER,
    OK,
    REJECTED_QUEUE_FULL,
    REJECTED_TOO_LONG,
    RequestRecord,
    dist,
    load_imbalance,
    summarize,
    warm_start_s,
)
from switchyard.bench.micro.revision import policy_at
from switchyard.bench.traces import (
    PromptFactory,
    Trace,
    TraceRequest,
    fill_outputs,
    has_clock,
    load_trace,
    pace_batch,
    parse_where,
    resolve_trace_path,
    scale_time,
    scale_to_rate,
    spread_ties,
    take_slice,
    ttft_floors,
)
from switchyard.bench.workloads import ARRIVALS, WorkloadSpec, make_workload, parse_length_dist
from switchyard.router.clock import VirtualClock
from switchyard.router.config import WorkersConfig, split_assignment
from switchyard.router.fleet import Fleet, StatsSample, WorkerInfo
from switchyard.router.peer_mirror import PeerMirror
from switchyard.router.policies.base import Policy, RoutingContext, WorkerId, load_poll_period
from switchyard.router.policies.oracle_partition import OraclePartition
from switchyard.router.policies.preble_cost import profile_cost
from switchyard.router.policies.preble_e2 import E2Config
from switchyard.router.policies.registry import POLICIES, make_policy
from switchyard.router.predictor.fallback import LengthFallback
from switchyard.router.queue import QueueEntry, QueueFull, RequestQueue, should_hold
from switchyard.workers.engine.core import SCHEDULINGS, EngineConfig
from switchyard.workers.engine.kv_events import (
    KvEventBatch,
    RequestAdmitted,
    RequestEnded,
    RequestEvent,
    RequestFirstToken,
)
from switchyard.workers.engine.types import EngineRequest, StepResult

log = logging.getLogger(__name__)

INF = math.inf
DEFAULT_PROFILE = "llama3-8b-a100"
MODEL = "sim-model"

PREDICTORS = ("none", "oracle", "fallback", "table")

# Heap event kinds; the number is also the tie-break order at equal times.
_STEP_DONE = 0
_KV_DELIVERY = 1
_REQ_DELIVERY = 2  # a worker's request event (admitted, first token, ended) reaching the router replicas


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation run: the fleet, the policy, and the router's modelled signal delays."""

    policy: str = "round_robin"
    num_workers: int = 8
    profile: str = DEFAULT_PROFILE  # every worker's, or a mixed fleet's `NAME:COUNT,...` (`fleet_profiles`)
    block_size: int = 16
    stats_interval_s: float = WorkersConfig().stats_interval_s  # the daemon's Stats poll period
    event_lag_s: float = 0.005  # step end -> KV events ingested by the router
    tick_interval_s: float = 0.1  # Policy.on_tick period (RoutingConfig.tick_interval_ms default)
    use_queue: bool = True  # hold requests in the router queue while every worker is saturated
    queue_max_size: int = 1024  # QueueConfig.max_size default
    kv_usage_hold_frac: float = 0.95  # QueueConfig.kv_usage_hold_frac default
    seed: int = 0  # prompt tokens and engine output tokens
    engine_overrides: dict[str, Any] = field(default_factory=dict)  # extra EngineConfig fields
    # Where RoutingContext.predicted_output_tokens comes from (see `LengthSource`): "none" (None, the default),
    # "oracle" (the true length), "fallback" (router/predictor/fallback.py, learning from finishes) or "table"
    # (request id -> tokens, precomputed offline; passed to the Simulator as `predictions`).
    predictor: str = "none"
    policy_params: dict[str, Any] = field(default_factory=dict)  # the policy's knobs (`make_policy`'s params)
    # Router replicas side by side over the same workers, each with its own policy, fleet view, queue and
    # predictor; arrivals reach them in turn (a round-robin load balancer in front). Each sees every worker's
    # Stats and KV events, its own dispatches, first tokens and finishes at once, and the other replicas' only
    # through the workers' request events, one event lag late, as live.
    router_replicas: int = 1


# ---------------------------------------------------------------------------------------------------- predictors
class LengthSource:
    """Output-length predictions as the daemon makes them: at arrival (tokenized), learning at each finish."""

    name = "none"

    def predict(self, request_id: str, num_prompt_tokens: int, true_output_tokens: int) -> int | None:
        """The prediction for a request that will generate `true_output_tokens` (only the oracle looks)."""
        return None

    def observe(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """The request finished with `num_output_tokens`."""


class OracleLengths(LengthSource):
    """The true output length: the upper bound any predictor can reach."""

    name = "oracle"

    def predict(self, request_id: str, num_prompt_tokens: int, true_output_tokens: int) -> int | None:
        return true_output_tokens


class FallbackLengths(LengthSource):
    """The daemon's fallback: a running mean per prompt-length bucket, observed on every finish."""

    name = "fallback"

    def __init__(self, fallback: LengthFallback | None = None) -> None:
        self.fallback = fallback or LengthFallback()

    def predict(self, request_id: str, num_prompt_tokens: int, true_output_tokens: int) -> int | None:
        return self.fallback.predict(MODEL, num_prompt_tokens)

    def observe(self, request_id: str, num_prompt_tokens: int, num_output_tokens: int) -> None:
        self.fallback.observe(MODEL, num_prompt_tokens, num_output_tokens)


class TableLengths(LengthSource):
    """Predictions computed offline (e.g. the trained ONNX predictor over the workload's prompt texts)."""

    name = "table"

    def __init__(self, table: Mapping[str, int]) -> None:
        self.table = table

    def predict(self, request_id: str, num_prompt_tokens: int, true_output_tokens: int) -> int | None:
        try:
            return int(self.table[request_id])
        except KeyError:
            raise KeyError(f"no precomputed prediction for request {request_id!r}") from None


def make_length_source(name: str, predictions: Mapping[str, int] | None = None) -> LengthSource:
    """A fresh source per run (the fallback's state must not leak between runs)."""
    if name == "table":
        if predictions is None:
            raise ValueError("predictor 'table' needs a predictions table (request id -> tokens)")
        return TableLengths(predictions)
    if predictions is not None:
        raise ValueError(f"a predictions table only goes with predictor 'table', not {name!r}")
    if name == "none":
        return LengthSource()
    if name == "oracle":
        return OracleLengths()
    if name == "fallback":
        return FallbackLengths()
    raise ValueError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}")


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    records: list[RequestRecord]
    worker_ids: list[str]
    engine_stats: list[Any]  # EngineStats per worker at the end
    sim_end_s: float  # virtual time when the last event ran
    wall_s: float
    num_events: int
    num_engine_steps: int
    num_engine_iterations: int
    policy_counters: dict[str, int] = field(default_factory=dict)  # `Policy.counters()` at the end

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, Any]:
        out = summarize(
            self.records,
            self.worker_ids,
            prefix_cache_queries=sum(s.prefix_cache_queries for s in self.engine_stats),
            prefix_cache_hits=sum(s.prefix_cache_hits for s in self.engine_stats),
            num_preemptions=sum(s.num_preemptions for s in self.engine_stats),
            slo_ttft_s=slo_ttft_s,
            slo_tpot_s=slo_tpot_s,
        )
        e2 = E2Config()  # claim 7's measure at E2's defaults, for every policy (the suite's skew section)
        out["preble_load_imbalance"] = self.load_imbalance(e2.history_window_s, e2.rebalance_threshold)
        out["policy_counters"] = dict(self.policy_counters)
        out["num_engine_steps"] = self.num_engine_steps
        out["num_engine_iterations"] = self.num_engine_iterations
        out["num_events"] = self.num_events
        return out

    def load_imbalance(self, window_s: float, threshold: float) -> dict[str, float]:
        """Preble's per-worker load imbalance in this run (`metrics.load_imbalance`), each request's work priced as
        Alg 2 prices L: PREFILLTIME of its uncached tokens + single-request DECODETIME, on its worker's profile."""
        names = fleet_profiles(self.config.profile, len(self.worker_ids))
        costs = {w: profile_cost(n) for w, n in zip(self.worker_ids, names, strict=True)}

        def work_s(r: RequestRecord) -> float:
            cost = costs[r.worker_id]
            return cost.prefill_s(r.num_prompt_tokens - r.num_cached_tokens, r.num_cached_tokens) + cost.decode_s(
                r.num_output_tokens, r.num_prompt_tokens + r.num_output_tokens / 2)

        return load_imbalance(self.records, self.worker_ids, work_s, window_s, threshold)


# ---------------------------------------------------------------------------------------------------- engine
def fleet_profiles(spec: str, num_workers: int | None = None) -> list[str]:
    """Each worker's profile name, w0 first: `NAME` for every worker (`num_workers` of them, default 8), or a
    mixed fleet `NAME:COUNT,NAME:COUNT,...` in that order (`num_workers`, if given, must be their sum). A fleet
    serves one model, so its profiles must share one; ValueError otherwise, or for an unknown name."""
    from switchyard.workers.engine.profiles import get_profile

    parts = [x.strip() for x in spec.split(",") if x.strip()]
    if not parts:
        raise ValueError("--profile is empty")
    if len(parts) == 1 and ":" not in parts[0]:
        names = [parts[0]] * (8 if num_workers is None else num_workers)
    else:
        names = []
        for part in parts:
            name, sep, count = part.partition(":")
            if not sep or not count.strip().isdigit() or int(count) < 1:
                raise ValueError(f"--profile {spec!r}: expected NAME or NAME:COUNT,NAME:COUNT,... (got {part!r})")
            names += [name.strip()] * int(count)
        if num_workers is not None and num_workers != len(names):
            raise ValueError(f"--profile {spec!r} makes {len(names)} workers, --workers says {num_workers}")
    models = {get_profile(n).model.name for n in names}
    if len(models) > 1:
        raise ValueError(f"--profile {spec!r}: a fleet serves one model; these profiles are of {sorted(models)}")
    return names


def describe_fleet(names: Sequence[str]) -> str:
    """'8 x llama3-8b-a100', or '4 x llama2-70b-h100-tp4 + 4 x llama2-70b-a100-tp4' for a mixed fleet."""
    runs: list[list[Any]] = []
    for n in names:
        if runs and runs[-1][1] == n:
            runs[-1][0] += 1
        else:
            runs.append([1, n])
    return " + ".join(f"{k} x {n}" for k, n in runs)


def make_engine(profile_name: str, block_size: int, overrides: dict[str, Any]) -> Any:
    """One EngineCore with the named profile (the same construction the simulated worker uses)."""
    from switchyard.workers.engine.core import EngineConfig, EngineCore
    from switchyard.workers.engine.profiles import get_profile

    profile = get_profile(profile_name)
    return EngineCore(EngineConfig(block_size=block_size, **overrides), profile)


def _stats_sample(s: Any, prev_gen_tokens: int, interval_s: float) -> StatsSample:
    """The Worker.Stats sample a worker with engine stats `s` would send."""
    return StatsSample(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        kv_blocks_used=s.kv_blocks_used,
        kv_blocks_total=s.kv_blocks_total,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
        num_iterations=s.num_iterations,
        num_preemptions=s.num_preemptions,
        num_requests_received=s.num_requests_received,
        generation_tokens_per_s=(s.generation_tokens_total - prev_gen_tokens) / interval_s
        if interval_s
        else 0.0,
    )


# ---------------------------------------------------------------------------------------------------- simulator
@dataclass(slots=True)
class RouterReplica:
    """One router's own state: what it decides with and what only it knows (its dispatches and their ends)."""

    policy: Policy
    fleet: Fleet
    queue: RequestQueue
    lengths: LengthSource
    mirror: PeerMirror  # the other replicas' requests, from the workers' request events


def _sum_counters(routers: Sequence[RouterReplica]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in routers:
        for k, v in r.policy.counters().items():
            out[k] = out.get(k, 0) + v
    return out


class Simulator:
    """One run: a trace, a fleet of engines, one policy. `run()` once."""

    def __init__(
        self,
        trace: Trace,
        cfg: SimConfig,
        prompts: PromptFactory | None = None,
        policy: Policy | None = None,
        predictions: Mapping[str, int] | None = None,
    ) -> None:
        """`policy` overrides `cfg.policy` (tests pass a spy; one router only); `prompts` may be shared between
        runs (its memo); `predictions` (request id -> predicted output tokens) is the table of
        `cfg.predictor == "table"`."""
        if cfg.router_replicas < 1:
            raise ValueError(f"router_replicas must be >= 1, not {cfg.router_replicas}")
        if policy is not None and cfg.router_replicas != 1:
            raise ValueError("a given policy object is one router's: router_replicas must be 1")
        self.trace = trace
        self.cfg = cfg
        self.prompts = prompts or PromptFactory(cfg.block_size, seed=cfg.seed)
        self.routers: list[RouterReplica] = []
        for i in range(cfg.router_replicas):
            pol = policy if policy is not None else build_policy(cfg.policy, cfg.policy_params)
            if isinstance(pol, OraclePartition):  # the baseline's offline oracle: this very trace's key portions
                pol.set_partition(preble.oracle_partition_table(trace))
            fleet = Fleet()
            self.routers.append(RouterReplica(
                pol, fleet, RequestQueue(cfg.queue_max_size), make_length_source(cfg.predictor, predictions),
                PeerMirror(f"r{i}", pol, fleet),
            ))
        self._peers = cfg.router_replicas > 1  # workers' request events matter only to another replica
        first = self.routers[0]
        self.policy, self.fleet, self.queue, self.lengths = first.policy, first.fleet, first.queue, first.lengths
        # as the daemon's registry polls with this policy: a peer that polls faster where it runs at that period
        self.stats_interval_s = load_poll_period(self.policy, cfg.stats_interval_s)
        self._router_of: dict[str, RouterReplica] = {}  # request id -> the replica that took it
        self.clock = VirtualClock()  # the routers' clock; advanced by the event loop
        self.cores: list[Any] = []
        self.worker_ids: list[WorkerId] = []
        self.profiles = fleet_profiles(cfg.profile, cfg.num_workers)
        for i, profile in enumerate(self.profiles):
            core = make_engine(profile, cfg.block_size, cfg.engine_overrides)
            wid = WorkerId(f"w{i}")
            c = core.config
            info = WorkerInfo(
                worker_id=wid,
                model=MODEL,
                max_model_len=c.max_model_len,
                block_size=c.block_size,
                kv_capacity_blocks=core.stats().kv_blocks_total,
                block_hash_algo=core.block_hash_algo,
                block_hash_seed=core.block_hash_seed,
                max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
                perf_profile=profile,
            )
            for r in self.routers:
                r.fleet.add_worker(info)
                r.policy.on_worker_change(wid, 0.0)
            self.cores.append(core)
            self.worker_ids.append(wid)
        c0 = self.cores[0]
        if (self.prompts.block_size, self.prompts.hash_algo, self.prompts.hash_seed) != (
            cfg.block_size,
            c0.block_hash_algo,
            c0.block_hash_seed,
        ):
            raise ValueError("the PromptFactory's block size / hash recipe differs from the engines'")
        self.max_model_len = self.cores[0].config.max_model_len
        self._index = {w: i for i, w in enumerate(self.worker_ids)}

        self._heap: list[tuple[float, int, int, int, Any]] = []  # (time, kind, seq, worker, payload)
        self._seq = 0
        self._busy = [False] * cfg.num_workers
        self._kick: set[int] = set()  # workers to (re)start once all events at the current time ran
        self._kv_seq = [0] * cfg.num_workers
        self._prev_gen = [[0] * cfg.num_workers for _ in self.routers]  # per replica: its last poll's counters
        self._records: dict[str, RequestRecord] = {}
        self._next_arrival_s = INF
        self._next_periodic_s = 0.0  # the next Stats poll or policy tick
        self.num_events = 0
        self.num_engine_steps = 0
        self.num_engine_iterations = 0

    # -------------------------------------------------------------------- heap
    def _push(self, t: float, kind: int, worker: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, kind, self._seq, worker, payload))

    # -------------------------------------------------------------------- main loop
    def run(self) -> SimResult:
        # NOTE: the run allocates millions of long-lived small objects (blocks, events, token lists); the cyclic
        # GC's repeated scans of them cost ~20% of the loop and free nothing (no cycles are made per event).
        gc_was_enabled = gc.isenabled()
        gc.freeze()
        gc.disable()
        try:
            return self._run()
        finally:
            gc.unfreeze()
            if gc_was_enabled:
                gc.enable()

    def _run(self) -> SimResult:
        wall0 = time.perf_counter()
        reqs = self.trace.requests
        n = len(reqs)
        ai = 0
        self._next_arrival_s = reqs[0].arrival_s if n else INF
        # Each replica polls Stats on connect, then every interval, and ticks on its own timer: replica i's timers
        # run i/K of a period after replica 0's (live they are not in step; in step, every replica would release
        # its held requests at the same instant, none seeing the others' dispatches yet).
        k = len(self.routers)
        stats_s, tick_s = self.stats_interval_s, self.cfg.tick_interval_s
        next_stats = [stats_s * i / k for i in range(k)]
        next_tick = [tick_s * (1 + i / k) for i in range(k)]
        heap = self._heap
        now = 0.0
        idle_polls = 0  # stats polls with held requests but nothing running or arriving (stuck guard)
        while True:
            t_heap = heap[0][0] if heap else INF
            t_arr = self._next_arrival_s
            t_stats, t_tick = min(next_stats), min(next_tick)
            self._next_periodic_s = min(t_stats, t_tick)
            t = min(t_heap, t_arr, self._next_periodic_s)
            idle = t_heap == INF and t_arr == INF
            if self._kick and (t > now or idle):
                self._run_kicks(now)  # all events at `now` ran: start the engines that got work
                continue
            if idle and not self._num_held():
                break  # no work left anywhere: every engine is idle (a busy one has a STEP_DONE queued)
            now = t
            self.clock.advance_to(now)
            self.num_events += 1
            if t_heap <= t:
                _, kind, _, w, payload = heapq.heappop(heap)
                if kind == _STEP_DONE:
                    self._on_step_done(w, payload, now)
                elif kind == _KV_DELIVERY:
                    self._on_kv_delivery(w, payload, now)
                else:
                    self._on_request_event(w, payload, now)
            elif t_stats <= t:
                i = next_stats.index(t_stats)
                self._on_stats_poll(i, now)
                next_stats[i] = now + stats_s
                if i == 0:
                    idle_polls = idle_polls + 1 if idle else 0
                if idle_polls > 10:
                    log.warning("held requests with an idle fleet at t=%.3f: releasing them", now)
                    for r in self.routers:
                        self._drain_queue(r, now, force=True)
            elif t_tick <= t:
                i = next_tick.index(t_tick)
                r = self.routers[i]
                r.fleet.set_time(now)
                r.policy.on_tick(now)
                self._drain_queue(r, now)
                next_tick[i] = now + tick_s
            else:
                req = reqs[ai]
                ai += 1
                self._next_arrival_s = reqs[ai].arrival_s if ai < n else INF
                self._on_arrival(req, now)
        for rec in self._records.values():
            if rec.status == OK and rec.finish_s < 0:
                rec.status = INCOMPLETE
        wall = time.perf_counter() - wall0
        records = [self._records[r.request_id] for r in reqs if r.request_id in self._records]
        return SimResult(
            config=self.cfg,
            records=records,
            worker_ids=list(self.worker_ids),
            engine_stats=[c.stats() for c in self.cores],
            sim_end_s=now,
            wall_s=wall,
            num_events=self.num_events,
            num_engine_steps=self.num_engine_steps,
            num_engine_iterations=self.num_engine_iterations,
            policy_counters=_sum_counters(self.routers),
        )

    # -------------------------------------------------------------------- engines
    def _horizon(self, now: float) -> float:
        """Until when an engine may fast-forward: the next moment a request could be dispatched to it."""
        h = self._next_arrival_s
        if self._num_held():
            # a held request may be released by any event (a finish, a Stats poll, a tick)
            h = min(h, self._next_periodic_s, self._heap[0][0] if self._heap else INF)
        return h

    def _num_held(self) -> int:
        return sum(len(r.queue) for r in self.routers)

    def _run_kicks(self, now: float) -> None:
        if not self._kick:
            return
        kicks = sorted(self._kick)
        self._kick.clear()
        for w in kicks:
            self._start_step(w, now)

    def _start_step(self, w: int, now: float) -> None:
        if self._busy[w]:
            return
        core = self.cores[w]
        if not core.has_unfinished():
            return
        res: StepResult | None = core.step(now, horizon_s=self._horizon(now))
        if res is None:
            return  # nothing schedulable; a later dispatch kicks it again
        self._busy[w] = True
        self.num_engine_steps += 1
        self.num_engine_iterations += res.num_iterations
        end = res.start_s + res.duration_s
        self._push(end, _STEP_DONE, w, res)
        events = core.take_kv_events()
        if events:
            self._kv_seq[w] += 1
            batch = KvEventBatch(seq=self._kv_seq[w], ts=end, events=tuple(events))
            self._push(end + self.cfg.event_lag_s, _KV_DELIVERY, w, batch)

    def _on_step_done(self, w: int, res: StepResult, now: float) -> None:
        self._busy[w] = False
        wid = self.worker_ids[w]
        records = self._records
        router_of = self._router_of
        finished: list[RouterReplica] = []
        for out in res.outputs:
            rec = records.get(out.request_id)
            if rec is None:
                continue
            r = router_of[out.request_id]
            policy = r.policy
            if rec.first_scheduled_s < 0:  # every scheduled request has an output: its first is the step's start
                rec.first_scheduled_s = res.start_s
            if out.new_token_ids and rec.first_token_s < 0:
                # a fast-forwarded result is decode-only, so a first token comes from a 1-iteration step;
                # if not, it appeared at the end of the first iteration
                first = now if res.num_iterations == 1 else res.start_s + res.duration_s / res.num_iterations
                rec.first_token_s = first
                rec.num_cached_tokens = out.num_cached_tokens
                policy.on_first_token(out.request_id, wid, now)
                if self._peers:
                    self._announce(w, RequestFirstToken(out.request_id, r.mirror.origin), now)
            if out.finish_reason is not None:
                rec.finish_s = now
                rec.num_output_tokens = out.num_output_tokens
                if rec.first_token_s < 0:
                    rec.first_token_s = now
                if r not in finished:
                    finished.append(r)
                r.lengths.observe(out.request_id, rec.num_prompt_tokens, out.num_output_tokens)
                r.fleet.set_time(now)
                r.fleet.note_done(wid)  # the daemon's order (dispatch._end_attempt): note_done, on_finish
                policy.on_finish(out.request_id, wid, now, out.num_output_tokens)
                if self._peers:
                    self._announce(w, RequestEnded(out.request_id, r.mirror.origin, out.num_output_tokens, True), now)
        for r in finished:
            self._drain_queue(r, now)  # the daemon pumps its queue after a finish of its own
        self._kick.add(w)

    def _on_kv_delivery(self, w: int, batch: KvEventBatch, now: float) -> None:
        wid = self.worker_ids[w]
        for r in self.routers:  # every replica subscribes to every worker's events
            r.fleet.apply_kv_events(wid, batch)
            r.policy.on_kv_events(wid, batch)

    def _announce(self, w: int, event: RequestEvent, now: float) -> None:
        """Worker w's request event, reaching every replica one event lag later (live: in its KV event stream)."""
        self._push(now + self.cfg.event_lag_s, _REQ_DELIVERY, w, event)

    def _on_request_event(self, w: int, event: RequestEvent, now: float) -> None:
        wid = self.worker_ids[w]
        for r in self.routers:
            r.mirror.apply(wid, MODEL, (event,), now)  # skips the replica that sent it

    def _on_stats_poll(self, i: int, now: float) -> None:
        """Replica i polls every worker."""
        r = self.routers[i]
        prev = self._prev_gen[i]
        r.fleet.set_time(now)
        for w, core in enumerate(self.cores):
            s = core.stats()
            r.fleet.apply_stats(self.worker_ids[w], _stats_sample(s, prev[w], self.stats_interval_s), now)
            prev[w] = s.generation_tokens_total
        self._drain_queue(r, now)

    # -------------------------------------------------------------------- router side
    def _on_arrival(self, req: TraceRequest, now: float) -> None:
        max_tokens = req.num_output_tokens
        rec = RequestRecord(req.request_id, now, req.num_prompt_tokens, max_tokens)
        self._records[req.request_id] = rec
        if req.num_prompt_tokens > self.max_model_len:
            rec.status = REJECTED_TOO_LONG  # the daemon's admission rejects it before routing
            return
        rec.max_tokens = max(1, min(max_tokens, self.max_model_len - req.num_prompt_tokens))
        routers = self.routers
        r = routers[len(self._router_of) % len(routers)]  # in turn, as a round-robin load balancer
        self._router_of[req.request_id] = r
        tokens = self.prompts.tokens(req)
        ctx = RoutingContext(
            request_id=req.request_id,
            model=MODEL,
            prompt_token_ids=tokens,
            block_hashes=self.prompts.block_hashes(req, tokens),
            max_tokens=rec.max_tokens,
            arrival_s=now,
            # predicted as soon as the request is tokenized (before any queue wait), as in the daemon
            predicted_output_tokens=r.lengths.predict(req.request_id, len(tokens), rec.max_tokens),
        )
        r.fleet.set_time(now)
        if self.cfg.use_queue and (
            len(r.queue) or should_hold(r.fleet.routable(MODEL), self.cfg.kv_usage_hold_frac)
        ):
            try:
                # it waits for the next pump (a Stats poll, a finish, a tick), as in the daemon
                r.queue.push(QueueEntry(req.request_id, MODEL, now, payload=(ctx, rec)))
            except QueueFull:
                rec.status = REJECTED_QUEUE_FULL
            return
        self._dispatch(r, ctx, rec, now)

    def _hold(self, eligible: Sequence[Any]) -> bool:
        return should_hold(eligible, self.cfg.kv_usage_hold_frac)

    def _drain_queue(self, r: RouterReplica, now: float, force: bool = False) -> None:
        """Release r's held requests, head first, while the hold condition is false (the daemon's dispatcher
        loop)."""
        if not len(r.queue):
            return
        r.fleet.set_time(now)
        hold = (lambda eligible: False) if force else self._hold
        while True:
            entry = r.queue.release(MODEL, r.fleet.routable(MODEL), hold)
            if entry is None:
                return
            ctx, rec = entry.payload
            self._dispatch(r, ctx, rec, now)

    def _dispatch(self, r: RouterReplica, ctx: RoutingContext, rec: RequestRecord, now: float) -> None:
        decision = r.policy.select(ctx, r.fleet, now)
        target = r.fleet.get(decision.worker_id) if decision is not None else None
        if decision is None or target is None or not target.is_routable:
            rec.status = NO_WORKER  # the daemon answers UNAVAILABLE
            return
        wid = decision.worker_id
        r.fleet.note_dispatch(wid)  # the daemon's order (dispatch._bind): note_dispatch, on_dispatch
        r.policy.on_dispatch(ctx, decision, now)
        rec.status = OK
        rec.worker_id = wid
        rec.dispatch_s = now
        w = self._index[wid]
        try:
            self.cores[w].add_request(self._engine_request(ctx, decision, now))
        except ValueError as e:  # e.g. prompt + output can never fit this worker's KV cache
            log.warning("request %s rejected by worker %s: %s", ctx.request_id, wid, e)
            rec.status = REJECTED_TOO_LONG
            r.policy.on_abort(ctx.request_id, wid, now)
            r.fleet.note_done(wid)
            return
        if self._peers:
            self._announce(w, RequestAdmitted(
                ctx.request_id, r.mirror.origin, ctx.block_hashes, ctx.num_prompt_tokens, ctx.max_tokens,
                decision.predicted_output_tokens, ctx.lora_name, ctx.cache_salt,
            ), now)
        self._kick.add(w)

    def _engine_request(self, ctx: RoutingContext, decision: Any, now: float) -> EngineRequest:
        return EngineRequest(
            request_id=ctx.request_id,
            prompt_token_ids=ctx.prompt_token_ids,
            max_tokens=ctx.max_tokens,
            arrival_s=now,
            ignore_eos=False,
            seed=self.cfg.seed,
            priority=decision.priority,
            predicted_output_tokens=decision.predicted_output_tokens,
            target_output_tokens=ctx.max_tokens,
        )


# ---------------------------------------------------------------------------------------------------- CLI
TRACE_DEFAULTS: dict[str, dict[str, float]] = {
    # Mooncake conversation: 59 min at 3.4 req/s, 12k-token prompts. Default: the first 10 minutes as recorded.
    "mooncake-conversation": {"duration": 600.0},
    "azure-code": {"duration": 600.0},
    "azure-conv": {"duration": 300.0},
    # Azure code + conversation, first 300 s of the merged trace (~2.4k requests), then inter-arrivals x 0.7
    preble.AZURE_MIX: {"duration": 300.0},
    # the public week-long Azure 2024 files (16.8M and 27.3M rows; not in shared/data), by their file names: the
    # 2023 files' windows (~17k and ~14k requests)
    "azurellminferencetrace-code-1week": {"duration": 600.0},
    "azurellminferencetrace-conv-1week": {"duration": 300.0},
}
LARGE_SLICE = 100_000  # requests: past this a run without --duration or --max-requests gets a hint
# generated at --rate, so --rate is not a rescale for them
SYNTHETIC = (*ARRIVALS, *preble.GENERATORS, conversations.NAME)
# built here, not read from a trace file (the Azure mix rescales Azure's arrivals and ServeGen's are its clients'
# own, so they are not in SYNTHETIC): --where and --spread-ties have no file to act on
GENERATED = (*SYNTHETIC, preble.AZURE_MIX, *servegen.NAMES)


def build_parser() -> argparse.ArgumentParser:
    from switchyard.workers.engine.profiles import PROFILES

    p = argparse.ArgumentParser(prog="switchyard bench sim", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--trace",
        default="mooncake-conversation",
        help="mooncake-conversation | azure-code | azure-conv | poisson | gamma | "
        f"{' | '.join(preble.TRACE_NAMES)} | {conversations.NAME} | {' | '.join(servegen.NAMES)} | PATH (.jsonl/.csv)",
    )
    p.add_argument("--workers", type=int, default=None, help="default 8, or the sum of a mixed --profile's counts")
    p.add_argument(
        "--policies",
        default="round_robin,least_request,power_of_two",
        help=f"comma-separated, the first is the baseline; known: {','.join(sorted(POLICIES))}",
    )
    p.add_argument(
        "--profile", default=DEFAULT_PROFILE,
        help="every worker's performance profile, or a mixed fleet of one model, NAME:COUNT,... in worker order "
        "(e.g. llama2-70b-h100-tp4:4,llama2-70b-a100-tp4:4); known: " + ", ".join(sorted(PROFILES)),
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load and slice")
    g.add_argument(
        "--time-scale", type=float, default=None, help="multiply inter-arrival times (<1 = more load)"
    )
    g.add_argument(
        "--rate", type=float, default=None,
        help="rescale arrivals to this mean req/s (a batch job's trace, every request at one instant: sent as a "
        "Poisson stream at this rate, in the file's order)",
    )
    g.add_argument("--rates", default=None, help="comma-separated req/s values to sweep")
    g.add_argument(
        "--start", type=float, default=0.0,
        help="slice start, trace seconds (servegen-*: from the trace's first local midnight; 72000 = 20:00)",
    )
    g.add_argument(
        "--duration",
        type=float,
        default=None,
        help="slice length in trace seconds before rescaling (default per trace: mooncake 600, "
        "azure-code 600, azure-conv 300, servegen-* 600 (with --max-requests too), also for a path to their files, "
        "and Azure 2024's week files by name as their 2023 counterparts; other files, or with --max-requests: no "
        "time limit; the window is cut while the file is read)",
    )
    g.add_argument("--max-requests", type=int, default=None)
    g.add_argument(
        "--where", action="append", default=[], metavar="COLUMN=VALUE",
        help="a trace file's rows with this value in this column (CSV) or field (JSONL), before slicing; again for "
        "another column, or the same column for either value: e.g. --where Model=ChatGPT --where 'Log Type=API "
        "log' (BurstGPT), --where type=text (Qwen-Bailian)",
    )
    g.add_argument(
        "--spread-ties", action="store_true",
        help="a trace file whose clock steps coarsely (Mooncake's conversation trace: 3 s, ~10 requests a step): "
        "each request moved to a seeded uniform time within its step, not replayed as one burst per step",
    )
    g = p.add_argument_group("router model")
    g.add_argument(
        "--stats-interval", type=float, default=WorkersConfig().stats_interval_s,
        help="Stats poll period, s (the daemon's default, 0.2); a peer that polls faster where it runs is polled at "
        "that, as the daemon does (llmd_scorer 0.05)",
    )
    g.add_argument("--event-lag", type=float, default=0.005, help="KV event delivery lag, s")
    g.add_argument("--tick-interval", type=float, default=0.1, help="policy on_tick period, s")
    g.add_argument("--no-queue", action="store_true", help="route at arrival; never hold in the router queue")
    g.add_argument(
        "--router-replicas", default="1", metavar="K[,K...]",
        help="router replicas side by side over the same workers, arrivals to them in turn; a list runs every "
        "policy at each K (rows 'POLICY xK routers')",
    )
    g.add_argument(
        "--param", action="append", default=[], metavar="POLICY.KEY=VALUE",
        help="set one knob of one policy of --policies (its config's field), e.g. switchyard.externality_weight=1",
    )
    g.add_argument(
        "--predictor",
        choices=("none", "oracle", "fallback"),
        default="none",
        help="RoutingContext.predicted_output_tokens: none, the true length, or the running-mean fallback",
    )
    g.add_argument("--max-num-seqs", type=int, default=None, help="override the engine's max_num_seqs")
    g.add_argument("--num-kv-blocks", type=int, default=None, help="override the profile's KV capacity")
    g.add_argument(
        "--engine-scheduling",
        choices=SCHEDULINGS,
        default=None,
        help="engine admission order (default fcfs); preble_groups = Preble's local priority groups; lpm = SGLang's "
        "longest-prefix-match first",
    )
    g.add_argument("--num-priority-groups", type=int, default=None, help="preble_groups: P (default 10)")
    g.add_argument("--priority-group-quota", type=int, default=None, help="preble_groups: k (default 10)")
    g = p.add_argument_group("synthetic workloads (--trace poisson|gamma|preble-*)")
    g.add_argument(
        "--num-requests", type=int, default=None,
        help="requests to generate (default 200; preble-*: 2000; conversations: 5000)"
    )
    g.add_argument("--cv", type=float, default=2.0, help="gamma inter-arrival CV")
    g.add_argument("--prompt-len", default="lognormal:1024:0.6")
    g.add_argument(
        "--output-len", default="lognormal:128:0.8",
        help="output lengths (also of a trace file's requests without one: ACDC's content-hash jobs)",
    )
    g.add_argument("--prefix-groups", type=int, default=0)
    g.add_argument("--prefix-len", type=int, default=512)
    g = p.add_argument_group("Preble workloads (--trace preble-*, specs/preble.md §7)")
    g.add_argument(
        "--num-tools", type=int, default=200, help="preble-toolbench / azure-mix: tools (paper: 200, 1500)"
    )
    g.add_argument(
        "--zipf",
        type=float,
        default=None,
        help="preble-toolbench / azure-mix: Zipf exponent of tool popularity (paper: 1.1); default uniform",
    )
    g.add_argument(
        "--samples-apart",
        action="store_true",
        help="preble-programming: a problem's samples arrive as separate Poisson arrivals, not at one instant",
    )
    g = p.add_argument_group("multi-turn conversations (--trace conversations, Bailian-shaped: bench/conversations.py)")
    g.add_argument("--follow-frac", type=float, default=0.5, help="share of requests that continue an earlier one")
    g.add_argument("--recent", type=int, default=0,
                   help="a follow-up continues one of the last N requests (default 0: any earlier one)")
    g.add_argument("--output-max", type=int, default=500, help="outputs uniform in [1, N)")
    g = p.add_argument_group("report")
    g.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO, s")
    g.add_argument("--slo-tpot", type=float, default=0.1, help="TPOT SLO, s")
    g.add_argument("--out", default=None, help="output folder (default results/sim-<trace>/)")
    g.add_argument("--no-plots", action="store_true")
    g.add_argument("--jobs", type=int, default=1, help="run the (policy, load) pairs in this many processes")
    g.add_argument(
        "--profile-cpu", action="store_true", help="run under cProfile and print the top functions"
    )
    return p


def _preble_spec(args: argparse.Namespace) -> preble.PrebleSpec:
    from switchyard.workers.engine.profiles import get_profile

    return preble.PrebleSpec(
        num_requests=args.max_requests or args.num_requests or 2000,
        rate=args.rate or 4.0,
        # prompt + output never exceed any engine's limit
        max_model_len=min(get_profile(n).max_model_len for n in set(fleet_profiles(args.profile, args.workers))),
        num_tools=args.num_tools,
        zipf=args.zipf,
        samples_together=not args.samples_apart,
    )


def load_workload(args: argparse.Namespace) -> Trace:
    where = parse_where(args.where)
    if where and args.trace in GENERATED:
        raise ValueError(f"--where selects rows of a trace file; {args.trace} is generated")
    if args.spread_ties and args.trace in GENERATED:
        raise ValueError(f"--spread-ties spreads a trace file's coarse clock; {args.trace} is generated")
    if args.trace in preble.GENERATORS:
        trace = preble.make_preble_trace(args.trace, _preble_spec(args), seed=args.seed)
        return take_slice(trace, args.start, args.duration, args.max_requests)
    if args.trace == preble.AZURE_MIX:
        duration = args.duration
        if duration is None and args.max_requests is None:
            duration = TRACE_DEFAULTS[preble.AZURE_MIX]["duration"]
        return preble.azure_mix(_preble_spec(args), args.seed, args.start, duration, args.max_requests)
    if args.trace in servegen.NAMES:
        return servegen.servegen_trace(args.trace.removeprefix(servegen.PREFIX), args.start,
                                       args.duration or servegen.WINDOW_S, args.seed, args.max_requests)
    if args.trace == conversations.NAME:
        conv = conversations.ConversationSpec(
            num_requests=args.max_requests or args.num_requests or 5000,
            rate=args.rate or 8.0,
            follow_frac=args.follow_frac,
            recent=args.recent,
            output_max=args.output_max,
        )
        return take_slice(conversations.make_conversations(conv, seed=args.seed), args.start, args.duration,
                          args.max_requests)
    if args.trace in ARRIVALS:
        spec = WorkloadSpec(
            arrival=args.trace,
            rate=args.rate or 4.0,
            cv=args.cv if args.trace == "gamma" else 1.0,
            num_requests=args.max_requests or args.num_requests or 200,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            prefix_groups=args.prefix_groups,
            prefix_len=args.prefix_len,
        )
        trace = make_workload(spec, seed=args.seed)
        return take_slice(trace, args.start, args.duration, args.max_requests)
    duration = args.duration
    if duration is None and args.max_requests is None:
        duration = TRACE_DEFAULTS.get(resolve_trace_path(args.trace)[0], {}).get("duration")
    trace = load_trace(args.trace, args.start, duration, args.max_requests, where)
    if args.spread_ties:
        trace = spread_ties(trace, args.seed)
    if not has_clock(trace) and (args.rate or args.rates):  # a batch job: the sweep rescales this to its rates
        trace = pace_batch(trace, 1.0, args.seed)
        trace = replace(trace, source=f"{trace.source}; a batch job sent as a Poisson stream (seed {args.seed})")
    without = sum(r.num_output_tokens == 0 for r in trace.requests)
    if without:
        trace = fill_outputs(trace, parse_length_dist(args.output_len), args.seed)
        trace = replace(trace, source=f"{trace.source}; {without} output lengths drawn from {args.output_len} "
                                      f"(seed {args.seed})")
    return trace


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """A registry policy, or `NAME@REV`: NAME as git revision REV's `router/policies/` (and `ext/`) wrote it
    (`bench/micro/revision.py`, as `bench decisions` takes it), so a change's placement is measured against the
    code it replaced in one run."""
    if "@" in name:
        base, rev = name.split("@", 1)
        return policy_at(base, rev, params)
    return make_policy(name, params)


def parse_policies(spec: str) -> list[str]:
    """--policies: registry names or `NAME@REV`; each revision's copy is built here, before any run forks."""
    policies = [p.strip() for p in spec.split(",") if p.strip()]
    for name in policies:
        if name.split("@", 1)[0] not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))} (or NAME@REV)")
        if "@" in name:
            build_policy(name)
    if len(set(policies)) != len(policies):
        raise ValueError(f"--policies lists a policy twice: {spec}")
    if not policies:
        raise ValueError("--policies is empty")
    return policies


def parse_params(items: Sequence[str], policies: Sequence[str]) -> dict[str, dict[str, str]]:
    """`--param POLICY.KEY=VALUE` items -> {policy: {key: value}}, each checked by building the policy."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        policy, key, raw = split_assignment(item, "--param", "POLICY.KEY=VALUE")
        if policy not in policies:
            raise ValueError(f"--param {item!r}: {policy!r} is not one of --policies ({', '.join(policies)})")
        out.setdefault(policy, {})[key] = raw.strip()
    for policy, params in out.items():
        build_policy(policy, params)
    return out


def parse_replicas(spec: str) -> list[int]:
    """`--router-replicas` "1,3" -> [1, 3]."""
    try:
        ks = [int(k) for k in spec.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--router-replicas {spec!r}: comma-separated integers") from None
    if not ks or min(ks) < 1:
        raise ValueError(f"--router-replicas {spec!r}: each K must be >= 1")
    return ks


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig fields the command line sets."""
    overrides: dict[str, Any] = {}
    if args.max_num_seqs:
        overrides["max_num_seqs"] = args.max_num_seqs
    if args.num_kv_blocks:
        overrides["num_kv_blocks"] = args.num_kv_blocks
    if args.engine_scheduling:
        overrides["scheduling"] = args.engine_scheduling
    if args.num_priority_groups:
        overrides["num_priority_groups"] = args.num_priority_groups
    if args.priority_group_quota:
        overrides["priority_group_quota"] = args.priority_group_quota
    return overrides


def ttft_floor(
    args: argparse.Namespace, trace: Trace, prompts: PromptFactory | None = None
) -> dict[str, dict[str, float]]:
    """The trace's TTFT floor at its arrival times (`traces.ttft_floors`: no router gives a request a lower TTFT on
    these engines), summarised as the runs' TTFT is: over every request and over the warm ones. `prompts` may be
    shared between a sweep's loads (its memo halves the pass)."""
    from switchyard.workers.engine.profiles import get_profile

    engine = EngineConfig(block_size=args.block_size, **engine_overrides(args))
    profiles = [get_profile(n) for n in sorted(set(fleet_profiles(args.profile, args.workers)))]
    prompts = prompts or PromptFactory(args.block_size, seed=args.seed)
    # a mixed fleet: each request on its fastest profile
    floors = np.min([ttft_floors(trace, prompts, p, engine.max_num_batched_tokens) for p in profiles], axis=0)
    # over the requests the admission lets through, as the runs' TTFT is; the warm-up by every arrival, as theirs
    limit = engine.max_model_len or min(p.max_model_len for p in profiles)
    t_warm = warm_start_s(trace.requests)
    kept = [(f, r) for f, r in zip(floors, trace.requests, strict=True) if r.num_prompt_tokens <= limit]
    return {"ttft_s": dist([f for f, _ in kept]), "ttft_warm_s": dist([f for f, r in kept if r.arrival_s >= t_warm])}


def sim_config(
    args: argparse.Namespace, policy: str, params: Mapping[str, str] | None = None, replicas: int = 1
) -> SimConfig:
    """The run's SimConfig; `params`: this policy's checked `--param` knobs (`parse_params`)."""
    return SimConfig(
        policy=policy,
        num_workers=args.workers,
        profile=args.profile,
        block_size=args.block_size,
        stats_interval_s=args.stats_interval,
        event_lag_s=args.event_lag,
        tick_interval_s=args.tick_interval,
        use_queue=not args.no_queue,
        seed=args.seed,
        engine_overrides=engine_overrides(args),
        predictor=args.predictor,
        policy_params=dict(params or {}),
        router_replicas=replicas,
    )


def run_one(
    args: argparse.Namespace,
    trace: Trace,
    policy: str,
    load: tuple[str, float],
    prompts: PromptFactory | None,
    params: Mapping[str, str] | None = None,
    replicas: int = 1,
) -> dict[str, Any]:
    """One (policy, load, replicas) run -> its report entry (module-level so a process pool can call it)."""
    simulator = Simulator(trace, sim_config(args, policy, params, replicas), prompts)
    res = simulator.run()
    sim_s = res.sim_end_s
    speed = sim_s / res.wall_s if res.wall_s > 0 else 0.0
    entry: dict[str, Any] = {"policy": policy, "stats_interval_s": simulator.stats_interval_s}
    if replicas != 1:
        entry["router_replicas"] = replicas
    print(
        f"  {report.run_label(entry):<16} rate={trace.mean_rate:6.2f} req/s  {len(trace.requests)} req  "
        f"simulated {sim_s:8.1f} s in {res.wall_s:6.1f} s wall = {speed:7.1f}x",
        flush=True,
    )
    return entry | {
        "rate": trace.mean_rate,
        "load": {load[0]: load[1]},
        "metrics": res.summary(args.slo_ttft, args.slo_tpot),
        "timing": {"wall_s": res.wall_s, "simulated_s": sim_s, "sim_speed": speed},
    }


def parallel_map(fn: Callable[..., Any], calls: Sequence[tuple[Any, ...]], jobs: int) -> list[Any]:
    """`[fn(*c) for c in calls]`, one forked process per call, `jobs` at a time, results in call order.

    Results equal the serial ones (each run is deterministic on its own). Forked, so module state set up before
    the call (a workload, a token table) reaches the children without pickling.
    """
    if jobs <= 1 or len(calls) <= 1:
        return [fn(*c) for c in calls]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        futures = [pool.submit(fn, *c) for c in calls]
        return [f.result() for f in futures]


def run_sweep(args: argparse.Namespace, base: Trace, floor: bool = True) -> dict[str, Any]:
    """Every (load, policy) pair on the same trace slice; returns the report's data, each run with its load's TTFT
    floor unless `floor` is False (a pass over every prompt's blocks: the suite's capacity ladders skip it)."""
    policies = parse_policies(args.policies)
    params = parse_params(args.param, policies)  # checked once, not per run
    replicas = parse_replicas(args.router_replicas)
    # --rates / --rate rescale to a mean rate and take precedence over --time-scale; a synthetic trace is
    # generated at --rate, so there --rate is not a rescale
    if args.rates:
        loads = [("rate", float(r)) for r in args.rates.split(",") if r.strip()]
    elif args.rate and args.trace not in SYNTHETIC:
        loads = [("rate", args.rate)]
    else:
        loads = [("time_scale", args.time_scale or 1.0)]
    scaled = {(k, v): scale_to_rate(base, v) if k == "rate" else scale_time(base, v) for k, v in loads}
    jobs = [(scaled[load], policy, load, n) for load in loads for policy in policies for n in replicas]
    prompts = PromptFactory(args.block_size, seed=args.seed)  # shared: its hash memo carries over
    if args.jobs > 1 and len(jobs) > 1:
        runs = parallel_map(
            run_one, [(args, t, p, load, None, params.get(p), n) for t, p, load, n in jobs], args.jobs
        )
    else:
        runs = [run_one(args, t, p, load, prompts, params.get(p), n) for t, p, load, n in jobs]
    if floor:
        floors = {load: ttft_floor(args, t, prompts) for load, t in scaled.items()}
        for run, (_, _, load, _) in zip(runs, jobs, strict=True):
            run["ttft_floor"] = floors[load]
    return {
        "trace": {
            "name": base.name,
            "source": base.source,
            "num_requests": len(base.requests),
            "slice_duration_s": base.duration_s,
            "mean_rate_req_s": base.mean_rate,
            "where": parse_where(args.where),
            "spread_ties": args.spread_ties,
        },
        "config": {
            "workers": args.workers,
            "profile": args.profile,
            "block_size": args.block_size,
            "seed": args.seed,
            "stats_interval_s": args.stats_interval,
            "event_lag_s": args.event_lag,
            "tick_interval_s": args.tick_interval,
            "use_queue": not args.no_queue,
            "router_replicas": replicas,
            "predictor": args.predictor,
            "engine_scheduling": args.engine_scheduling or "fcfs",
            "policies": policies,
            "policy_params": params,
            "slo_ttft_s": args.slo_ttft,
            "slo_tpot_s": args.slo_tpot,
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.workers = len(fleet_profiles(args.profile, args.workers))
        parse_params(args.param, parse_policies(args.policies))
        parse_replicas(args.router_replicas)
        base = load_workload(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"bench sim: {e}", file=sys.stderr)
        return 2
    if not base.requests:
        print("bench sim: the trace slice is empty", file=sys.stderr)
        return 2
    out = Path(args.out or f"results/sim-{base.name}")
    print(
        f"bench sim: trace {base.name} ({len(base.requests)} requests over {base.duration_s:.0f} s, "
        f"{base.mean_rate:.2f} req/s), {describe_fleet(fleet_profiles(args.profile, args.workers))}, policies "
        f"{args.policies}",
        flush=True,
    )
    if len(base.requests) > LARGE_SLICE and args.duration is None and args.max_requests is None:
        print(f"bench sim: {len(base.requests)} requests per run; --duration or --max-requests replays a part",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    if args.profile_cpu:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        result = prof.runcall(run_sweep, args, base)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
    else:
        result = run_sweep(args, base)
    elapsed = time.perf_counter() - t0
    paths = report.write_report(result, out, plots=not args.no_plots)
    print()
    print(report.markdown_table(result))
    print(report.outcome_line(result), end="")
    print(report.floor_line(result), end="")
    wall = sum(r["timing"]["wall_s"] for r in result["runs"])
    simulated = sum(r["timing"]["simulated_s"] for r in result["runs"])
    print(
        f"\nsimulator speed: {simulated:.0f} simulated s in {wall:.1f} s of event loop = "
        f"{simulated / max(wall, 1e-9):.1f}x per run ({elapsed:.1f} s elapsed for the whole sweep, "
        f"{simulated / max(elapsed, 1e-9):.1f}x)"
    )
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
