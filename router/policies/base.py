"""The one policy protocol, and the plain data it reads and returns.

A policy's `select` has no side effects: it reads the request and a live read-only fleet view and returns a
`Decision`. State changes arrive only through the event hooks, which the daemon (live) and the simulator
(virtual time) call in the same order. No I/O, threads, wall clock or global random in a policy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NewType, Protocol

from switchyard.workers.engine.kv_events import KvEventBatch

WorkerId = NewType("WorkerId", str)


@dataclass(frozen=True, slots=True)
class RoutingContext:
    """Everything a policy may know about one request when choosing a worker."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]  # chained uint64 hashes of the prompt's full blocks (the workers' recipe)
    max_tokens: int
    arrival_s: float  # router clock
    priority: int = 0
    predicted_output_tokens: int | None = None  # from a predictor or the client hint; None = unknown
    lora_name: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    app_id: str | None = None
    attempt: int = 0  # 0 for the first dispatch, > 0 for a retry
    excluded_workers: frozenset[WorkerId] = field(default_factory=frozenset)  # failed earlier attempts
    # the prompt's length where its token ids are not carried (another replica's request, from a worker's event:
    # `router.peer_mirror`); -1: len(prompt_token_ids)
    prompt_len: int = -1

    @property
    def num_prompt_tokens(self) -> int:
        n = self.prompt_len
        return n if n >= 0 else len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Decision:
    """A chosen worker plus the hints forwarded to it."""

    worker_id: WorkerId
    priority: int = 0  # engine priority (lower first)
    predicted_output_tokens: int = 0  # 0 = no hint
    reason: str = ""  # short, for DEBUG logs and traces


class WorkerView(Protocol):
    """Read-only state of one worker as the router sees it (from Info, Stats, KV events and its own dispatches)."""

    @property
    def worker_id(self) -> WorkerId: ...
    @property
    def model(self) -> str: ...
    @property
    def is_routable(self) -> bool: ...  # healthy, ready and not draining
    @property
    def block_size(self) -> int: ...
    @property
    def kv_capacity_blocks(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def in_flight(self) -> int: ...  # dispatched by this router and not finished
    @property
    def peer_in_flight(self) -> int: ...  # other router replicas' requests open there (the worker's request events)
    @property
    def num_running(self) -> int: ...  # from the last Stats
    @property
    def num_waiting(self) -> int: ...  # from the last Stats
    @property
    def kv_usage_frac(self) -> float: ...  # from the last Stats
    @property
    def num_waiting_uncached_tokens(self) -> int: ...
    @property
    def stats_age_s(self) -> float: ...
    @property
    def dispatched_since_stats(self) -> int: ...  # dispatches after the last Stats sample (incast guard)
    @property
    def num_iterations(self) -> int: ...  # engine iterations so far, from the last Stats (anticipator clock)
    @property
    def num_requests_received(self) -> int: ...  # requests the worker accepted so far (all routers), last Stats


class FleetView(Protocol):
    """A live, read-only view of the fleet; never a per-request copy."""

    def workers(self, model: str) -> Sequence[WorkerView]: ...
    def routable(self, model: str) -> Sequence[WorkerView]: ...
    def get(self, worker_id: WorkerId) -> WorkerView | None: ...
    def cached_prefix_blocks(self, model: str, block_hashes: Sequence[int]) -> Mapping[WorkerId, int]:
        """Per worker, how many leading blocks of `block_hashes` its KV events say are resident."""
        ...


class Policy:
    """Base class: `select` plus no-op event hooks. Subclasses keep their own state and change it only in hooks."""

    name = "base"
    # the most workers whose state it can hold at once (None: no limit); the registry refuses workers past it
    max_workers: int | None = None
    # True: other router replicas' requests reach its hooks too (`router.peer_mirror`), request ids namespaced by
    # replica, so replicas side by side keep the same state; False: it knows only its own dispatches
    mirrors_peers: bool = False
    # a peer baseline whose decisions read polled load (Stats) and whose own deployment polls faster than the
    # daemon: that period, s (llm-d: 50 ms), which caps the Stats poll period wherever it runs (`load_poll_period`)
    load_poll_s: float | None = None

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        """Choose a worker among `fleet.routable(ctx.model)` minus `ctx.excluded_workers`; None if none."""
        raise NotImplementedError

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        """The request was sent to `decision.worker_id` (called once per dispatch attempt)."""

    def on_peer_dispatch(self, ctx: RoutingContext, decision: Decision, fleet: FleetView, now: float) -> None:
        """Another router replica's request reached `decision.worker_id` (from the worker's request events, for a
        policy that `mirrors_peers`; `ctx.request_id` is namespaced by that replica). Default: as if this replica
        had sent it; a policy that keeps what its own select saw overrides it to read that from `fleet`."""
        self.on_dispatch(ctx, decision, now)

    def on_first_token(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        pass

    def on_finish(self, request_id: str, worker_id: WorkerId, now: float, num_output_tokens: int) -> None:
        pass

    def on_abort(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        """Cancelled, timed out, or the worker failed: the attempt ends without a finish."""

    def on_kv_events(self, worker_id: WorkerId, batch: KvEventBatch) -> None:
        pass

    def on_worker_change(self, worker_id: WorkerId, now: float) -> None:
        """A worker was added, removed, drained, or changed health."""

    def on_tick(self, now: float) -> None:
        """Periodic background work (rebalancing, GC), driven by the daemon or the simulator."""

    def counters(self) -> dict[str, int]:
        """Cumulative counts of the policy's own actions that no routing outcome shows (E2: rebalancing redirects,
        replicas), for reports; {} when it has none."""
        return {}

    def state_sizes(self) -> dict[str, int]:
        """The sizes of what the policy holds now (E2: its tree's nodes and blocks, the block index's bytes), so an
        operator sees its memory follow the load and fall back after a burst; {} when it holds nothing that grows."""
        return {}


def load_poll_period(policy: Policy, configured_s: float) -> float:
    """The Stats poll period with `policy` routing: the configured one (`workers.stats_interval_s`, `bench sim
    --stats-interval`), capped at the policy's `load_poll_s`, so a peer baseline sees load as fresh as its own
    deployment does, in the daemon and in the simulator alike (a policy built from an older revision may lack it)."""
    own = getattr(policy, "load_poll_s", None)
    return min(configured_s, own) if own else configured_s


def candidates(ctx: RoutingContext, fleet: FleetView) -> list[WorkerView]:
    """The routable workers for `ctx.model`, minus those that already failed this request."""
    if not ctx.excluded_workers:  # the common case, a first attempt: nothing to filter (a hot path)
        return list(fleet.routable(ctx.model))
    return [w for w in fleet.routable(ctx.model) if w.worker_id not in ctx.excluded_workers]
