"""e2: Preble's E2 (Exploitation + Exploration) request placement over a global prefix radix tree.

Spec: specs/preble.md §5.1-5.5 (Algorithms 1-2, rebalancing, autoscaling), §4.3 (tree sync), §11 errata.

Per request (`select`, read-only; all costs in seconds):
  cached_w  = blocks of the prompt worker w holds: max(resident run from its KV events, assigned run from this
              router's dispatches cut at the first block an eviction event removed since) (§4.3: predict on
              assignment, reconcile with events, events win on conflict). cached_len = max_w cached_w × block
              size over routable workers (tokens; dead tree nodes that nobody holds do not count), missed_len =
              prompt_len − cached_len.
  EXPLOIT iff cached_len > missed_len (errata E1: the text and code, not Alg 1's literal test):
      KS = routable workers holding the whole key portion (§3 definition, errata E5: the deepest matched node
      with more blocks than its predecessors; `key_portion="longest"` = Alg 1's longest node), with a
      rebalancing redirect heavy → light applied and replicas added. |KS| = 1 → it; else argmin LOADCOST.
      KS empty → explore.
  EXPLORE: DECODERATIO_i = windowed prefix hit ratio (errata E9; tokens the router expected cached / prompt
      tokens over the last `hit_ratio_window_s`); if max_i > IMBALR (0.7) → argmax_i (P/D balancing, §5.3);
      else argmin over all routable workers of LOADCOST.
  LOADCOST(i) = L_i + M_i + R_i  [s]
      L_i = Σ_{r∈H_i} PT_r + |H_i| × DECODETIME(mean decode tokens in H_i, mean context in H_i)  (Alg 2; H = last
            `history_window_s`, optionally capped at `history_max_requests`, errata E2). PT_r was priced at r's
            dispatch on i; decode tokens are predicted at dispatch and replaced by the observed count on finish.
            Maintained incrementally (`WorkerHistory`); plus the load rebalancing moved onto/off i within H.
      M_i = eviction cost of making room for R_k's missed blocks: when they exceed i's free blocks (capacity −
            resident blocks per events, or KV usage per Stats, whichever is larger; `assume_full` = the code's
            "always full"), the blocks i's LRU would evict (simulated: leaves first, oldest first, not R_k's own
            path) each cost PT_j × N_j (text, errata E3: recompute j's evicted tokens × requests through j on i
            within W) or Σ_l PREFILLTIME(missed_l) (`eviction_cost="alg2"`); "off" = 0.
      R_i = PREFILLTIME(prompt_len − cached_i, cached_i): R_k's own uncached prefill on i (errata E4).
  PREFILLTIME / DECODETIME: the worker's named PerfProfile (single-request regressions, `preble_cost`); an
  unknown name → `default_profile`; perf_profile == "" (real vLLM) → online least-squares fit of observed
  TTFT/TPOT, the default profile until `online_fit_min_samples`. Decode of a new request: median observed output
  of its key node, else the request's predicted_output_tokens, else max_tokens.
  Ties: lowest (cost, (candidate index − dispatch count) mod n): a rotation advanced in on_dispatch, no RNG.

Load-aware additions [inferred] (defaults; `E2Config.paper()` restores the spec as written). Measured cause:
on shared-prefix traces E2 lost p99 to smg_cache_aware because (a) L priced every request in H with the
single-request DECODETIME (~29 ms/token on llama2-70b-h100-tp4), so L ≈ 1.2 s × requests in H: a windowed request
count in which the explored requests' prefill (what actually queues) barely registered, and the cold-start burst
of misses piled multi-thousand-token prefills onto whichever worker had the fewest requests; (b) the 3-minute
history cannot see that a worker has prefills queued right now. Changes:
  decode_pricing="marginal": DT_r = what r's decode tokens add to iterations that run anyway (one more decoding
      sequence, `ProfileCost.decode_marginal_s`), not a single-request decode; L becomes the GPU work assigned in
      H, dominated by prefill, as §5.2's "load" means (Alg 2 keeps "single").
  load_signal="both": LOADCOST = L + M + R + Q, Q_i = Σ PT_r over requests dispatched to i with no first token yet
      (`Outstanding`, kept from on_dispatch / on_first_token / on_finish / on_abort, no Stats lag): the prefill R_k
      waits behind. The spec avoids "the current load" because it changes before R_k runs; Q is the one part of it
      that R_k cannot avoid. "outstanding" = Q alone, "history" = L alone (spec).
  decode_ratio="decode_tokens" (errata E9's option): DECODERATIO_i = decoding requests / (decoding requests +
      queued uncached prompt tokens) on i: the decode-token fraction of the work ahead, instead of the windowed hit
      ratio, which stays > IMBALR on every worker of a high-sharing trace and so sent every explore to argmax.
  pd_pick="lightest": among the workers over IMBALR, argmin LOADCOST (the spec's argmax piles onto one worker).
  exploit_overflow (off by default): explore instead of exploiting when a non-holder's Q + M + R beats the holder's
      Q + M + R. Measured harmful at ≥ 70 % load (toolbench rate 96: hit ratio 0.83 → 0.61, mean TTFT 0.19 → 1.8 s):
      the recompute it chooses per request is extra work for the fleet, and under load that cascades.

Background (`on_tick`): every `rebalance_interval_s`, if windowed requests ≥ `rebalance_min_requests_per_worker` ×
workers and max L > Th_bal × min L, redirect the heavy worker's cheapest key nodes (≥ 2 requests in H) to the
lightest until the gap closes (§5.4, the code's REBALANCE); a key node whose TTFT on a worker doubles over H
(2nd-half mean ≥ `replication_ttft_factor` × 1st-half) gets a replica on the lightest worker not serving it
(§5.5). Redirects and replicas last H. Every `gc_interval_s` (default: every tick), `tree.gc` drops nodes nobody
holds and nobody used within W (claim 10), within a work budget per tick (blocks freed plus candidates visited:
`gc_budget_blocks`, or twice the blocks inserted since the last gc if more), the rest on the next ticks: the gc
keeps pace with the inserts, and a mass expiry (a burst's prompts, all unused since) is spread over the ticks
rather than stalling one (README "Decision cost"). Every tick
simulates each worker's eviction order as far as the largest of the recent Ms needed, and prices its victims
(`warm_eviction_orders`), so a select's M is mostly a bisection and memo hits. Switches
`enable_rebalancing`, `enable_replication`, `enable_pd_balancing` give the ablation keys `e2_base` (all off),
`e2_rebal` (+rebalancing, replication), `e2` (all on).

State changes only in hooks: on_dispatch inserts the prompt and assigns the path; on_kv_events mirrors
BlockStored/BlockRemoved/AllBlocksCleared into resident runs; on_worker_change drops a worker that is gone or
unhealthy from the tree and the loads. `select` memoises only the fleet reference, each worker's static
WorkerInfo facts (profile, block size, capacity), which hooks need and do not receive, and its last prefix match,
which the dispatch of that request reuses while no hook has changed the tree since (`held`). M's eviction orders
and victim terms are caches (each the same however far it was computed), and the sizes M was asked to price are
kept for the tick to compute those caches ahead of the selects (`warm_eviction_orders`); no decision reads them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from switchyard.ext.e2_select import (
    BoundsEnv,
    Outstanding,
    Priced,
    SelectEnv,
    cheapest,
    exploit_set,
    raw_bounds,
    select_e2,
)
from switchyard.ext.lru_order import touch_holders
from switchyard.ext.lru_order_py import cold_bucket
from switchyard.ext.radix import MAX_WORKERS, RadixTree
from switchyard.ext.samples import Samples
from switchyard.router.policies.base import (
    Decision,
    FleetView,
    Policy,
    RoutingContext,
    WorkerId,
    WorkerView,
    candidates,
)
from switchyard.router.policies.preble_cost import CostModel, OnlineFit, ProfileCost, profile_cost
from switchyard.router.policies.preble_load import (
    HistoryEntry,
    HitRatioWindow,
    LruIndex,
    LruPricing,
    MovedLoad,
    NodeStats,
    WorkerHistory,
    merged_stats,
)
from switchyard.router.policies.preble_rebalance import maybe_replicate, rebalance
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from switchyard.workers.engine.profiles import DEFAULT_PROFILE

log = logging.getLogger(__name__)

# pieces of L memoised past the current one by on_finish and on_tick (`load_s`): a worker's oldest entry or move
# expires about once between two of its hooks, so two more pieces keep most selects on the memo
LOAD_PIECES_AHEAD = 2


class E2Config(BaseModel):
    """Every knob of E2; defaults from specs/preble.md §6 ([code] values where the paper gives none)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    history_window_s: float = Field(default=180.0, gt=0)  # H (and the TTFT-doubling window): 3 min [code]
    history_max_requests: int | None = Field(default=None, ge=1)  # H as a count too (errata E2); None = time only
    node_window_s: float = Field(default=180.0, gt=0)  # W: per-node request counts (N_j) and GC
    key_portion: Literal["study", "longest"] = "study"  # errata E5
    eviction_cost: Literal["text", "alg2", "off"] = "text"  # errata E3
    assume_full: bool = False  # the code's "GPU always full": M for every missed block
    enable_pd_balancing: bool = True  # §5.3
    imbalance_ratio: float = Field(default=0.7, ge=0, le=1)  # IMBALR [code]; the test is ratio > IMBALR
    hit_ratio_window_s: float = Field(default=30.0, gt=0)  # DECODERATIO window [code]
    enable_rebalancing: bool = True  # §5.4
    rebalance_threshold: float = Field(default=1.5, ge=1)  # Th_bal [code HIGH_LOAD_THRESHOLD]
    rebalance_min_requests_per_worker: int = Field(default=50, ge=0)  # [code] only with ≥ 50 × GPUs requests
    rebalance_min_node_requests: int = Field(default=2, ge=1)  # [code] key nodes with window count ≥ 2
    rebalance_interval_s: float = Field(default=1.0, gt=0)  # on_tick cadence of the background pass
    enable_replication: bool = True  # §5.5
    replication_ttft_factor: float = Field(default=2.0, gt=1)  # "average queueing time doubles over H"
    gc_interval_s: float = Field(default=0.0, ge=0)  # 0: every tick
    # one tick's gc work, in blocks freed plus candidates visited: at least this (~0.1-1 ms), at most twice the
    # blocks inserted since the last gc run, so it keeps pace with the inserts; the rest on the next ticks
    gc_budget_blocks: int = Field(default=2_000, gt=0)
    # on_tick extends each worker's eviction order to the largest of the last N evictions M was asked to price,
    # and prices its victims, so selects find M ready (`warm_eviction_orders`; 0 = off; decisions are the same)
    warm_eviction_needs: int = Field(default=256, ge=0)
    # the work one tick's warm-up may do: order steps simulated (~3 µs each) plus victims priced (memo hits mostly)
    warm_eviction_budget: int = Field(default=512, ge=1)
    default_profile: str = DEFAULT_PROFILE  # for unknown profile names and before the online fit is ready
    online_fit_min_samples: int = Field(default=8, ge=1)
    online_fit_decay: float = Field(default=1.0, gt=0, le=1)  # 1.0 = plain running least squares
    # --- [inferred] extensions (see the module docstring, "Load-aware additions"); the spec's behaviour is
    # load_signal="history", exploit_overflow=False, decode_ratio="hit_ratio", pd_pick="argmax"
    load_signal: Literal["history", "outstanding", "both"] = "both"  # L = history (Alg 2), Q = queued prefill
    exploit_overflow: bool = False  # explore when a non-holder would serve R_k sooner, recompute included (off: see docstring)
    decode_ratio: Literal["hit_ratio", "decode_tokens"] = "decode_tokens"  # DECODERATIO (errata E9)
    pd_pick: Literal["argmax", "lightest"] = "lightest"  # among workers over IMBALR
    decode_pricing: Literal["single", "marginal"] = "marginal"  # DT in L: Alg 2's single-request, or batched
    # other router replicas' requests, from the workers' events, enter the tree, H and Q as ours do (`peer_mirror`);
    # Preble has one scheduler, so nothing to say there
    mirror_peers: bool = True

    @classmethod
    def paper(cls, **overrides: Any) -> E2Config:
        """The spec's E2 as written (Alg 1-2 with the §11 resolutions), without the [inferred] load-aware additions."""
        base: dict[str, Any] = dict(load_signal="history", exploit_overflow=False, decode_ratio="hit_ratio",
                                    pd_pick="argmax", decode_pricing="single")
        return cls(**(base | overrides))


@dataclass(slots=True)
class _Facts:
    """Static WorkerInfo facts memoised from the fleet (hooks do not see the fleet)."""

    perf_profile: str
    block_size: int
    kv_capacity_blocks: int


@dataclass(slots=True)
class _InFlight:
    worker: WorkerId
    t: float
    block_hashes: tuple[int, ...]  # its key node is resolved at each use (splits move it)
    missed_tokens: int
    prompt_tokens: int
    decode_tokens: int = 0  # predicted at dispatch
    first_token_s: float = -1.0
    key_memo: Any = None  # `PrebleE2.key_of_record`'s: the key node and the path it was found on


# `_decide`'s memo of Decisions per (worker, reason) holds at most this many, then starts over: the reasons are
# four fixed ones and the P/D ratio to two decimals (~100 per worker), so a fleet of up to ~40 workers never clears it
DECISIONS_CAP = 4096


class Cost(NamedTuple):
    """One worker's LOADCOST terms, s. A tuple: selects build several per request, and a tuple is the cheapest
    immutable record to build."""

    load_s: float  # L (0 when load_signal="outstanding")
    evict_s: float  # M
    prefill_s: float  # R
    queue_s: float = 0.0  # Q: prefill already queued ahead on the worker (0 when load_signal="history")

    @property
    def total_s(self) -> float:
        return self.load_s + self.evict_s + self.prefill_s + self.queue_s

    @property
    def wait_s(self) -> float:
        """The short-term part: when R_k's own first token could come, plus the recompute it forces."""
        return self.queue_s + self.evict_s + self.prefill_s


# M's methods as imported (and `_OWN_EVICT_S`, `_OWN_PROTECTED`, below the class), which the fused select's M
# replicates in C: where a class or a patch has others, they are called
_LRU_PRICING = (LruPricing.eviction_cost, LruPricing.order)

# the methods of `select_steps` that `select_e2` runs in C, or calls only off its default path
_FUSED_STEPS = ("pool", "_remember", "_pool_index", "prefix", "_key_end", "_exploit_set", "_cheapest", "_costs",
                "_ratios", "_overflow", "_decide")


class PrebleE2(Policy):
    name = "e2"
    max_workers = MAX_WORKERS  # the radix tree's worker slots (one tree for every model)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass that inherits the fused select and overrides one of its steps selects step by step: the
        fused select would not call the override."""
        super().__init_subclass__(**kwargs)
        if cls.select is PrebleE2.select and any(n in vars(cls) for n in _FUSED_STEPS):
            cls.select = cls.select_steps  # type: ignore[method-assign]

    def __init__(self, config: E2Config | None = None) -> None:
        self.cfg = config or E2Config()
        self.mirrors_peers = self.cfg.mirror_peers
        self.tree = RadixTree(chained=True)  # one tree: hashes are chained, and only a request's candidates are read
        self.history: dict[WorkerId, WorkerHistory] = {}
        self.hit_ratio: dict[WorkerId, HitRatioWindow] = {}
        self.fits: dict[WorkerId, OnlineFit] = {}
        # per worker: assigned block hashes removed by events since their assignment (`tree.block_set()`s)
        self.evicted: dict[WorkerId, Any] = {}
        self.resident_count: dict[WorkerId, int] = {}  # blocks resident per events
        self.lru: dict[WorkerId, LruIndex] = {}  # per worker: M's eviction order, kept by the hooks (`_touch`)
        self.hit_times: dict[WorkerId, deque[float]] = {}  # per worker: dispatch times within W (`cold_floor`)
        # the blocks the last `warm_eviction_needs` Ms were asked to evict (`warm_eviction_orders`)
        self.recent_needs: deque[int] = deque(maxlen=self.cfg.warm_eviction_needs or 1)
        self._warm_from = 0  # the worker (index in `lru`) the next warm-up starts from
        self.moved_load = MovedLoad()  # per worker: (t, Δload s) from rebalancing and replication
        self.dirty_ttft: dict[tuple[int, WorkerId], Any] = {}  # (id(key node), worker) -> node: new TTFT samples
        self.in_flight: dict[str, _InFlight] = {}
        self.outstanding: dict[WorkerId, Outstanding] = {}
        self._turn = 0
        self._facts: dict[WorkerId, _Facts] = {}
        # NOTE: select's hot-path memos, exact (see `cost_model`, `load_s`, `_remember`, `_pool_index`): per worker
        # its cost model and (valid from, oldest live entry's t, L), dropped by its history's and moves' `on_change`;
        # per model the fleet's routable sequence last remembered; per pool (by identity) {worker id: 0} and
        # {worker id: view}
        self._load_memo: dict[WorkerId, tuple[float, float, float]] = {}
        self.moved_load.on_change = self._drop_load_memo
        self._cost_memo: dict[WorkerId, CostModel] = {}
        cfg = self.cfg
        self._bounds_env = BoundsEnv(  # what the bound kernel reads, by reference (`_raw_bounds`)
            cost_memo=self._cost_memo, cost_model=self.cost_model, facts=self._facts, lru=self.lru,
            resident_count=self.resident_count, outstanding=self.outstanding, load_memo=self._load_memo,
            load_s=self.load_s, window_s=cfg.history_window_s, evict_on=cfg.eviction_cost != "off",
            assume_full=cfg.assume_full, with_l=cfg.load_signal != "outstanding",
            with_q=cfg.load_signal != "history",
        )
        self._remembered: dict[str, Any] = {}
        self._pool_memo: tuple[Any, dict[WorkerId, int], dict[WorkerId, WorkerView]] | None = None
        self._models: set[str] = set()
        self._fleet: FleetView | None = None
        # the last select's prefix match (request id, block hashes, tree generation, per-worker cached blocks,
        # path), for its dispatch; `_tree_gen` counts the hooks' changes to the tree and the evicted sets
        self._prefix_memo: tuple[str, tuple[int, ...], int, dict[WorkerId, int], list[Any]] | None = None
        self._tree_gen = 0
        self._decisions: dict[tuple[WorkerId, str], Decision] = {}  # `_decide`'s, per (worker, reason)
        self._next_gc = 0.0
        self._blocks_after_gc = 0  # the tree's blocks after the last gc run: what was inserted since sets the budget
        self._next_rebalance = 0.0
        self.num_redirects = 0
        self.num_replications = 0
        # state is kept only where a decision reads it: the skew passes' redirects and replicas where they steer
        # (`_skew_rules_steer`; not `Switchyard` under placement "argmin"), L and its history window where L is
        # priced or the passes run, the windowed hit ratio where DECODERATIO reads it
        steer = self._skew_rules_steer()
        self._rebalance_on = cfg.enable_rebalancing and steer
        self._replicate_on = cfg.enable_replication and steer
        self._price_l = cfg.load_signal != "outstanding" or self._rebalance_on or self._replicate_on
        self._keep_hit_ratio = cfg.enable_pd_balancing and cfg.decode_ratio == "hit_ratio"  # DECODERATIO's window
        # what the fused select reads (`select`): the tables and flags above, by reference
        self._select_env = SelectEnv(
            self, decision=Decision, node_stats=NodeStats, decisions_cap=DECISIONS_CAP, logger=log,
            m_pricing=(_OWN_EVICT_S, *_LRU_PRICING, ProfileCost, LruPricing.term_for(cfg.eviction_cost),
                       _OWN_PROTECTED),
        )

    def _skew_rules_steer(self) -> bool:
        """Whether rebalancing's redirects and replication's replicas reach a decision (here: the exploit set)."""
        return True

    # ------------------------------------------------------------------------------------------ cost model
    def cost_model(self, w: WorkerId) -> CostModel:
        """Worker w's PREFILLTIME / DECODETIME: its profile's, else its online fit, else the default profile.

        NOTE: the answer is an object that changes only when w's facts or fit object change (`_remember`,
        `on_dispatch`, `on_worker_change` drop the memo then); an online fit's answers change inside it.
        """
        got = self._cost_memo.get(w)
        if got is None:
            got = self._cost_memo[w] = self._cost_model(w)
        return got

    def _cost_model(self, w: WorkerId) -> CostModel:
        facts = self._facts.get(w)
        if facts is not None and facts.perf_profile:
            return profile_cost(facts.perf_profile)
        fit = self.fits.get(w) if facts is not None else None
        return fit or profile_cost(self.cfg.default_profile)

    def load_s(self, w: WorkerId, now: float, ahead: int = 0) -> float:
        """L_i: the history sum plus what rebalancing moved within H.

        NOTE: read for every priced worker of every select, and piecewise constant in `now`: it changes only when
        the worker's history or the moves change (their `on_change` drops the memo) or when `now` passes the
        expiry of the oldest live entry or move. The memo is (valid_from, t_0, L_0, t_1, L_1, ...): from
        valid_from on, L_j holds while now - H <= t_j (the first such j), t_j the time of the oldest entry or
        move still live in piece j (`WorkerHistory.load_pieces`); for a cost model whose answers never change (`ProfileCost`;
        `_remember`, `on_dispatch` and `on_worker_change` drop the memo when the model can change). Exact: the
        same sums give the same float. The hooks that change a history and `on_tick` (expiry, moves) refresh it:
        `on_finish` and `on_tick`, off any request's path, with `ahead` pieces more (`LOAD_PIECES_AHEAD`), so the
        selects between hooks read L from the memo even as entries and moves expire (a move's time is a
        breakpoint too); `on_dispatch`, which runs before its request is sent, with one (pieces ahead there cost
        the dispatch what they saved the selects). A worker given a move out of time order memoises one piece,
        t_0 its oldest live entry or move.
        The selects' bound loop (`ext/e2_select`, `BoundsEnv`) reads this memo by the same rule and calls here on
        a miss: a change to the memo's shape or rule goes there too.
        """
        memo = self._load_memo.get(w)
        cutoff = now - self.cfg.history_window_s
        if memo is not None and memo[0] <= now:
            for j in range(1, len(memo), 2):
                if cutoff <= memo[j]:
                    # a hook asking for pieces ahead extends a memo the dispatch left short (the memo's pieces
                    # are what pricing now gives, so pricing again changes no float)
                    if (ahead and len(memo) - j < 2 * ahead + 2 and memo[-2] != math.inf
                            and w not in self.moved_load.unordered):
                        break
                    return memo[j + 1]
        h = self.history.get(w)
        cost = self.cost_model(w)
        moved = self.moved_load.sum_s(w, cutoff)
        if type(cost) is not ProfileCost:
            return (h.load_s(now, cost, self.cfg.decode_pricing == "marginal") if h is not None else 0.0) + moved
        marginal = self.cfg.decode_pricing == "marginal"
        dq = self.moved_load.by_worker.get(w)
        if not ahead or w in self.moved_load.unordered:  # one piece (out of order: until the oldest live move)
            t, base = h.load_pieces(now, cost, marginal)[0] if h is not None else (math.inf, 0.0)
            v = base + moved
            self._load_memo[w] = (now, min(t, self.moved_load.first_t(w, cutoff)) if dq else t, v)
            return v
        cuts = [t for t, _ in dq if t >= cutoff] if dq else []  # in time order: the moves' expiries cut too
        if h is not None:
            pieces = h.load_pieces(now, cost, marginal, 1 + ahead, cuts)
        else:
            pieces = [(cuts[0] if cuts else math.inf, 0.0)]
        memo: tuple[float, ...] = (now,)
        for j, (t, base) in enumerate(pieces):
            # piece j's moves: those at or after its t_j (none lies between two breakpoints), the same sum
            memo += (t, base + (moved if j == 0 else self.moved_load.sum_s(w, t)))
        self._load_memo[w] = memo
        return memo[2]

    def _drop_load_memo(self, w: str) -> None:
        """The `on_change` of w's history and of the moves: L's memo no longer holds."""
        self._load_memo.pop(w, None)  # type: ignore[call-overload]

    def _cached_blocks(self, w: WorkerId, m: Any, hashes: tuple[int, ...]) -> int:
        """max(resident run, assigned run cut at the first block evicted since assignment)."""
        r = m.resident_blocks.get(w, 0)
        a = m.assigned_blocks.get(w, 0)
        ev = self.evicted.get(w)
        if a > r and ev:
            for k in range(r, a):
                if hashes[k] in ev:
                    a = k
                    break
        return max(r, a)

    def _key_end(self, path: list[Any], upto: int) -> tuple[Any, int]:
        """(key-portion node, its end in blocks) on `path` clipped to the first `upto` blocks (errata E5)."""
        return self.tree.key_portion(path, upto, self.cfg.key_portion == "study")

    def key_of(self, block_hashes: tuple[int, ...]) -> Any:
        """The key-portion node of a prompt in the current tree (None when nothing of it is in the tree)."""
        if not block_hashes:
            return None
        path, matched = self.tree.walk(block_hashes)  # no per-worker runs: ~1/3 of a `match`
        return self._key_end(path, matched)[0]

    def key_of_record(self, rec: HistoryEntry | _InFlight) -> Any:
        """`key_of(rec.block_hashes)`, memoised on the record while the path it was found on keeps its shape.

        NOTE: exact. A prompt the tree matched to its last block walks the same path until a node of that path is
        split (its context and length change) or removed by gc (detached): a leaf added elsewhere is not on it,
        and a block hash is in one node only, so the walk from the root takes the same children. The key portion
        reads only the path's nodes' context and length. Rebalancing resolves every history entry's key node at
        each pass, and the first-token and finish hooks their request's: a ~600-block walk each on video QA,
        against a check of the path's 2-4 nodes here. The memo keeps those nodes alive while its record lives
        (the in-flight record until the finish, the history entry for H at most), detached ones included.
        """
        memo = rec.key_memo
        if memo is not None:
            for node, context, length in memo[1]:
                if not node.is_attached or node.context_blocks != context or node.num_blocks != length:
                    break
            else:
                return memo[0]
        hashes = rec.block_hashes
        if not hashes:
            return None
        path, matched = self.tree.walk(hashes)
        key = self._key_end(path, matched)[0]
        rec.key_memo = (
            (key, tuple((n, n.context_blocks, n.num_blocks) for n in path)) if matched == len(hashes) else None
        )
        return key

    def loadcost(self, w: WorkerView, ctx: RoutingContext, cached_blocks: int, path: list[Any], now: float) -> Cost:
        """LOADCOST(w) = L + M + R (+ Q) of R_k (see the module docstring)."""
        return self._loadcost(w, ctx, cached_blocks, now, self._protected(path))

    def loadcosts(
        self, ws: list[WorkerView], ctx: RoutingContext, cached: dict[WorkerId, int], path: list[Any], now: float
    ) -> dict[WorkerId, Cost]:
        """`loadcost` of every worker in `ws`, in order (the path's node ids, never victims, are collected once)."""
        protected = self._protected(path)
        out: dict[WorkerId, Cost] = {}
        for w in ws:
            wid = w.worker_id
            out[wid] = self._loadcost(w, ctx, cached[wid], now, protected)
        return out

    def _loadcost(
        self, w: WorkerView, ctx: RoutingContext, cached_blocks: int, now: float, protected: set[int]
    ) -> Cost:
        c, evict = self._bound(w, ctx, cached_blocks, now)
        return c if evict <= 0 else self._with_evict(c, w, evict, now, protected)

    def _bound(self, w: WorkerView, ctx: RoutingContext, cached_blocks: int, now: float) -> tuple[Cost, int]:
        """(LOADCOST without M, blocks R_k would evict on w): a lower bound, since M >= 0 (0 blocks: M = 0)."""
        return self._bounds((w,), ctx, {w.worker_id: cached_blocks}, now)[0]

    def _bounds(
        self, ws: Sequence[WorkerView], ctx: RoutingContext, cached: dict[WorkerId, int], now: float
    ) -> list[tuple[Cost, int]]:
        """`_bound` of each worker of `ws`, in order (`_raw_bounds` as `Cost`s)."""
        return [(Cost(load, 0.0, r, q), evict) for load, r, q, evict in self._raw_bounds(ws, ctx, cached, now)]

    def _raw_bounds(
        self, ws: Sequence[WorkerView], ctx: RoutingContext, cached: dict[WorkerId, int], now: float
    ) -> list[tuple[float, float, float, int]]:
        """(L, R, Q, blocks R_k would evict) of each worker of `ws`, in order (`ext/e2_select`: the hot loop of
        every explore and multi-holder exploit, in Cython)."""
        return raw_bounds(self._bounds_env, ws, cached, len(ctx.prompt_token_ids), now)

    def _with_evict(self, c: Cost, w: WorkerView, evict: int, now: float, protected: set[int]) -> Cost:
        """`c` with M (`_evict_s`)."""
        return Cost(c.load_s, self._evict_s(w, evict, now, protected), c.prefill_s, c.queue_s)

    def _evict_s(self, w: WorkerView, evict: int, now: float, protected: set[int]) -> float:
        """M: the recompute cost of what evicting `evict` blocks on w would take from others."""
        wid = w.worker_id
        self.recent_needs.append(evict)
        return self.lru[wid].eviction_cost(
            wid, evict, protected, now, self.cfg.node_window_s, w.block_size, self.cost_model(wid),
            self.cfg.eviction_cost,
        )

    def queue_s(self, w: WorkerId) -> float:
        """Q_i: Σ PT_r over requests dispatched to i that have no first token yet (their prefill is ahead)."""
        o = self.outstanding.get(w)
        return max(0.0, o.queued_s) if o is not None else 0.0

    # ------------------------------------------------------------------------------------------ select
    def _remember(self, fleet: FleetView, pool: Sequence[WorkerView], model: str) -> None:
        """Memo of static facts (idempotent; no decision depends on when it was filled).

        NOTE: skipped while the fleet hands back the same routable sequence object for the model (the `Fleet`
        keeps one per model until any worker's state or health changes; `on_worker_change` forgets it too).
        """
        if self._fleet is fleet and self._remembered.get(model) is pool:
            return
        self._fleet = fleet
        self._models.add(model)
        for w in pool:
            if w.worker_id not in self._facts:
                info = getattr(w, "info", None)
                self._facts[w.worker_id] = _Facts(
                    getattr(info, "perf_profile", ""), w.block_size, w.kv_capacity_blocks
                )
                self._load_memo.pop(w.worker_id, None)  # its cost model may change with its profile
                self._cost_memo.pop(w.worker_id, None)
        self._remembered[model] = pool

    def _pool_index(self, pool: Sequence[WorkerView]) -> tuple[dict[WorkerId, int], dict[WorkerId, WorkerView]]:
        """({worker id: 0} in pool order, {worker id: view}) of `pool`, kept for the last pool object seen."""
        memo = self._pool_memo
        if memo is not None and memo[0] is pool:
            return memo[1], memo[2]
        zero: dict[WorkerId, int] = {w.worker_id: 0 for w in pool}
        by_id = {w.worker_id: w for w in pool}
        self._pool_memo = (pool, zero, by_id)
        return zero, by_id

    def _cheapest(
        self, ws: Sequence[WorkerView], ctx: RoutingContext, cached: dict[WorkerId, int], path: list[Any], now: float
    ) -> tuple[WorkerView, list[Priced]]:
        """The worker of `ws` with the lowest (LOADCOST, rotated index), and the LOADCOSTs it priced as (index in
        `ws`, L, M, R, Q) (`_costs` names them).

        Branch and bound, exact (`ext/e2_select.cheapest`): M (an LRU eviction simulation, hundreds of steps when a
        long prompt must evict many small cold prefixes) is priced only for workers whose bound L + R + Q can
        still win, in bound order, and whose LRU index cannot tell it is 0 (`m_is_zero`, `LruIndex.eviction_cost`'s
        early exits); float addition is monotone, so a bound above the best total cannot become the argmin.
        """
        protected: set[int] | None = None

        def price_m(i: int, evict: int) -> float:
            nonlocal protected
            if protected is None:
                protected = self._protected(path)
            return self._evict_s(ws[i], evict, now, protected)

        best, priced = cheapest(
            self._bounds_env, ws, cached, len(ctx.prompt_token_ids), now, self._turn, price_m, path
        )
        return ws[best], priced

    @staticmethod
    def _costs(ws: Sequence[WorkerView], priced: list[Priced]) -> dict[WorkerId, Cost]:
        """`_cheapest`'s priced LOADCOSTs by worker (built only to be logged or compared, not per select)."""
        return {ws[i].worker_id: Cost(load, m, r, q) for i, load, m, r, q in priced}

    def prefix(
        self, ctx: RoutingContext, pool: Sequence[WorkerView]
    ) -> tuple[dict[WorkerId, int], int, list[Any]]:
        """(per pool worker in pool order, the prompt's leading blocks it holds; the most any holds; the matched
        path): one tree call, `_cached_blocks` for every pool worker (`RadixTree.match_cached`)."""
        hashes = ctx.block_hashes
        zero = self._pool_index(pool)[0]
        if not hashes:
            return zero.copy(), 0, []
        got = self.tree.match_cached(hashes, zero, self.evicted)
        self._prefix_memo = (ctx.request_id, hashes, self._tree_gen, got[0], got[2])
        return got

    def held(self, w: WorkerId, ctx: RoutingContext) -> tuple[int, list[Any]]:
        """(leading blocks of ctx's prompt w holds, `_cached_blocks`; the matched path) for a prompt with blocks.

        NOTE: a dispatch follows its select with the tree unchanged (nothing in between, or only hooks that bump
        `_tree_gen`), so the select's match is reused then: one walk of the prompt instead of two (three for the
        default policy); a walk measured 10-14 µs mean on the video-QA prompts of `bench decisions`. The same
        walk gives the same numbers.
        """
        hashes = ctx.block_hashes
        memo = self._prefix_memo
        if memo is not None and memo[2] == self._tree_gen and memo[1] is hashes and memo[0] == ctx.request_id:
            got = memo[3].get(w)
            if got is not None:
                return got, memo[4]
        m = self.tree.match(hashes)
        got = self._cached_blocks(w, m, hashes)
        self._prefix_memo = (ctx.request_id, hashes, self._tree_gen, {w: got}, m.path)
        return got, m.path

    def pool(self, ctx: RoutingContext, fleet: FleetView) -> Sequence[WorkerView]:
        """`candidates`, but the fleet's own routable sequence when nothing is excluded (no copy: the memos of
        `_remember` and `_pool_index` key on its identity)."""
        return candidates(ctx, fleet) if ctx.excluded_workers else fleet.routable(ctx.model)

    @staticmethod
    def _protected(path: list[Any]) -> set[int]:
        """The ids of a prompt's matched nodes: M never evicts them (its own prefix)."""
        return {id(n) for n in path}

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        """`select_steps`, as one Cython call where the build loaded (`ext/e2_select.select_e2`: the same steps,
        objects and floats, without the bytecode between them)."""
        return select_e2(self._select_env, ctx, fleet, now)

    def select_steps(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        """E2's select, step by step (the module docstring): the reference the Cython build follows."""
        pool = self.pool(ctx, fleet)
        if not pool:
            return None
        self._remember(fleet, pool, ctx.model)
        cached, best_blocks, path = self.prefix(ctx, pool)
        bs = pool[0].block_size
        cached_len = min(best_blocks * bs, ctx.num_prompt_tokens)
        missed_len = ctx.num_prompt_tokens - cached_len
        if cached_len > missed_len:
            key, key_end = self._key_end(path, best_blocks)
            ks = self._exploit_set(key, key_end, pool, cached, now)
            if ks:
                if len(ks) == 1:
                    pick, why, priced = ks[0], "exploit only holder", []
                else:
                    pick, priced = self._cheapest(ks, ctx, cached, path, now)
                    why = "exploit"
                if not self.cfg.exploit_overflow:
                    return self._decide(ctx, pick, why, cached_len, missed_len, partial(self._costs, ks, priced))
                over = self._overflow(ctx, pick, ks, pool, cached, path, now)
                if over is None:
                    return self._decide(ctx, pick, why, cached_len, missed_len, partial(self._costs, ks, priced))
                alt, alt_costs = over
                return self._decide(ctx, alt, "explore overflow", cached_len, missed_len, lambda: alt_costs)
        if self.cfg.enable_pd_balancing:
            ratios = self._ratios(pool, now)
            thr = self.cfg.imbalance_ratio
            over_i = [i for i, r in enumerate(ratios) if r > thr]
            if over_i:
                heavy = [pool[i] for i in over_i]
                if self.cfg.pd_pick == "argmax":  # ties: the rotation (unique), as everywhere
                    n = len(pool)
                    i = max(over_i, key=lambda i: (ratios[i], -((i - self._turn) % n)))
                    w, priced = pool[i], []
                else:  # the lightest of the decode-heavy workers
                    w, priced = self._cheapest(heavy, ctx, cached, path, now)
                    i = next(i for i in over_i if pool[i] is w)
                ratio = ratios[i]
                return self._decide(ctx, w, f"explore P/D ratio={ratio:.2f}>{self.cfg.imbalance_ratio}",
                                    cached_len, missed_len, partial(self._costs, heavy, priced))
        pick, priced = self._cheapest(pool, ctx, cached, path, now)
        return self._decide(ctx, pick, "explore", cached_len, missed_len, partial(self._costs, pool, priced))

    def _overflow(
        self, ctx: RoutingContext, pick: WorkerView, ks: list[WorkerView], pool: list[WorkerView],
        cached: dict[WorkerId, int], path: list[Any], now: float,
    ) -> tuple[WorkerView, dict[WorkerId, Cost]] | None:
        """Exploit overflow [inferred]: (non-holder, costs) when some worker outside KS would finish R_k's prefill
        sooner than the chosen holder, counting its queue Q, the recompute R of the prefix it lacks and the
        eviction M that recompute forces; else None. Compares only these short-term terms (the history L is a
        placement signal for new prefixes, not a wait), so a holder keeps its traffic until it is truly backed
        up, and the overflowing request seeds a second holder (which rebalancing and replication reach only
        after H-scale windows)."""
        held = {w.worker_id for w in ks}
        others = [w for w in pool if w.worker_id not in held]
        if not others:
            return None
        mine = self.loadcost(pick, ctx, cached[pick.worker_id], path, now)
        mine_wait = self.queue_s(pick.worker_id) + mine.evict_s + mine.prefill_s
        alt_costs = self.loadcosts(others, ctx, cached, path, now)
        waits = {k: self.queue_s(k) + c.evict_s + c.prefill_s for k, c in alt_costs.items()}
        n = len(pool)
        idx = {w.worker_id: i for i, w in enumerate(pool)}
        alt = min(others, key=lambda w: (waits[w.worker_id], alt_costs[w.worker_id].total_s,
                                         (idx[w.worker_id] - self._turn) % n))
        if waits[alt.worker_id] >= mine_wait:
            return None
        return alt, alt_costs

    def _ratios(self, pool: Sequence[WorkerView], now: float) -> list[float]:
        """DECODERATIO of each pool worker, in pool order (every explore reads the whole pool's: one pass)."""
        if self.cfg.decode_ratio == "decode_tokens":
            get = self.outstanding.get
            return [o.decode_fraction() if (o := get(w.worker_id)) is not None else 0.0 for w in pool]
        get_hw = self.hit_ratio.get
        return [hw.ratio(now) if (hw := get_hw(w.worker_id)) is not None else 0.0 for w in pool]

    def _exploit_set(
        self, key: Any, key_end: int, pool: list[WorkerView], cached: dict[WorkerId, int], now: float
    ) -> list[WorkerView]:
        """KS: the pool workers holding the key portion (`cached` is in pool order), a rebalancing redirect heavy
        → light applied and replicas added (`ext/e2_select.exploit_set`)."""
        if key is None:
            return []
        st = key.stats
        redirect, replicas = (st.redirect, st.replicas) if isinstance(st, NodeStats) else (None, None)
        return exploit_set(cached, key_end, self._pool_index(pool)[1], redirect, replicas, now)

    def _decide(
        self, ctx: RoutingContext, w: WorkerView, why: str, cached_len: int, missed_len: int,
        costs: Callable[[], dict[WorkerId, Cost]],
    ) -> Decision:
        """The Decision for w; `costs` gives the LOADCOSTs priced on the way, asked only for the DEBUG line."""
        if log.isEnabledFor(logging.DEBUG):
            terms = " ".join(
                f"{k}: L={c.load_s:.3f} + M={c.evict_s:.3f} + R={c.prefill_s:.3f} = {c.total_s:.3f} s;"
                for k, c in costs().items()
            )
            log.debug(
                "e2 %s -> %s (%s): cached_len=%d %s missed_len=%d; LOADCOST = L + M + R: %s",
                ctx.request_id, w.worker_id, why, cached_len, ">" if cached_len > missed_len else "<=", missed_len,
                terms or "-",
            )
        # the costs are in the DEBUG line above, not formatted per select; a Decision is immutable, so one per
        # (worker, reason) is built once (a frozen dataclass's __init__: 0.8 µs warm, ~2.7 µs p50 in a select)
        key = (w.worker_id, why)
        got = self._decisions.get(key)
        if got is None:
            got = Decision(worker_id=w.worker_id, reason=why)
            if len(self._decisions) >= DECISIONS_CAP:
                self._decisions.clear()
            self._decisions[key] = got
        return got

    # ------------------------------------------------------------------------------------------ hooks
    def on_peer_dispatch(self, ctx: RoutingContext, decision: Decision, fleet: FleetView, now: float) -> None:
        """As `on_dispatch`, with the workers' facts (profile, block size) remembered first: a replica may hear of
        the other replicas' requests before its own first select, which is where they are otherwise read."""
        pool = fleet.routable(ctx.model)
        if pool:
            self._remember(fleet, pool, ctx.model)
        self.on_dispatch(ctx, decision, now)

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        w = decision.worker_id
        self._turn += 1
        prev = self.in_flight.get(ctx.request_id)
        if prev is not None and prev.worker != w and prev.worker in self.outstanding:
            self.outstanding[prev.worker].drop(ctx.request_id)  # a retry elsewhere: the old attempt is gone
        hashes = ctx.block_hashes
        facts = self._facts.get(w)
        bs = facts.block_size if facts else 16
        cached_blocks, matched = self.held(w, ctx) if hashes else (0, None)
        cached = min(cached_blocks * bs, max(0, ctx.num_prompt_tokens - 1))
        missed = ctx.num_prompt_tokens - cached
        prefill_s = self.cost_model(w).prefill_s(missed, cached)
        path = self.tree.insert(hashes, now) if hashes else []
        ev = self.evicted.get(w)
        if ev:  # re-assigned: predicted resident again
            # NOTE: exact, and before `assign`: a hash enters evicted[w] only while its node is assigned to w and
            # leaves it when stored on w, so only blocks past w's resident run, in nodes already assigned to w,
            # can be there (a new leaf's were in no node). A video-QA split re-assigns a ~600-block resident node.
            pos = 0
            for node in path:
                nb = node.num_blocks
                if w in node.assigned:
                    r = node.resident_on(w)
                    if r < nb:
                        ev.difference_update(hashes[pos + r: pos + nb])
                pos += nb
            if pos < len(hashes):
                ev.difference_update(hashes[pos:])
        self.tree.assign(path, w, now)
        self._tree_gen += 1
        if self.lru and matched is not None:
            last = matched[-1] if matched else None
            if last is not None and last not in path:  # nodes compare by identity
                # a split moved matched[-1] under a new node, and may have left it with less or nothing resident:
                # every index that can hold it is asked (`touch_holders`' `moved`). The path's other nodes are
                # matched ones (last_access moved) or new (the split's upper half, the leaf), which no index can
                # hold yet: their holders are asked.
                self._touch_holders(path, moved=last)
            else:
                self._touch_holders(matched)  # only last_access moved; the new leaves after it hold nothing yet
        win = self.cfg.node_window_s
        for node in path:
            if not isinstance(node.stats, NodeStats):
                node.stats = merged_stats(node.children.values())  # a split's new upper half
            node.stats.add_hit(w, now, prefill_s, win)
        times = self.hit_times.get(w)
        if times is None:
            times = self.hit_times[w] = deque()
        times.append(now)
        while times[0] < now - win:  # bounded without ticks too (`advance_cold` trims them as well)
            times.popleft()
        key, _ = self._key_end(path, len(hashes))
        med = key.stats.median_decode() if key is not None else None  # every node of path has stats now
        decode = int(med) if med is not None else (ctx.predicted_output_tokens or ctx.max_tokens)
        if self._price_l:  # the history window H is L's (and the skew passes', which need L)
            hist = self.history.get(w)
            if hist is None:
                hist = self.history[w] = WorkerHistory(self.cfg.history_window_s, self.cfg.history_max_requests)
                hist.on_change = partial(self._drop_load_memo, w)
            hist.add(HistoryEntry(now, ctx.request_id, prefill_s, ctx.num_prompt_tokens, decode, hashes))
        if self._keep_hit_ratio:
            hw = self.hit_ratio.get(w)
            if hw is None:
                hw = self.hit_ratio[w] = HitRatioWindow(self.cfg.hit_ratio_window_s)
            hw.add(now, cached, ctx.num_prompt_tokens)
        if w not in self.fits:
            self._cost_memo.pop(w, None)
            self.fits[w] = OnlineFit(
                profile_cost(self.cfg.default_profile), self.cfg.online_fit_min_samples, self.cfg.online_fit_decay
            )
        self.in_flight[ctx.request_id] = _InFlight(w, now, hashes, missed, ctx.num_prompt_tokens, decode)
        out = self.outstanding.get(w)
        if out is None:
            out = self.outstanding[w] = Outstanding()
        out.add(ctx.request_id, missed, prefill_s)
        if self._price_l:
            self.load_s(w, now)  # its history changed: price L here, so the next selects read it from the memo

    def on_first_token(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        rec = self.in_flight.get(request_id)
        if rec is None or rec.worker != worker_id or rec.first_token_s >= 0:
            return
        rec.first_token_s = now
        out = self.outstanding.get(worker_id)
        if out is not None:
            out.first_token(request_id, rec.prompt_tokens + rec.decode_tokens // 2)
        ttft = now - rec.t
        fit = self.fits.get(worker_id)
        if fit is not None:
            fit.add_prefill(rec.missed_tokens, ttft)
        if not self._replicate_on:
            return  # the TTFT samples below feed replication's detector alone
        key = self.key_of_record(rec)
        if key is not None and isinstance(key.stats, NodeStats):
            dq = key.stats.ttft.get(worker_id)
            if dq is None:
                dq = key.stats.ttft[worker_id] = Samples()
            dq.append((now, ttft))
            dq.trim(now - self.cfg.history_window_s)
            self.dirty_ttft[(id(key), worker_id)] = key

    def on_finish(self, request_id: str, worker_id: WorkerId, now: float, num_output_tokens: int) -> None:
        rec = self.in_flight.pop(request_id, None)
        if rec is None or rec.worker != worker_id:
            return
        out = self.outstanding.get(worker_id)
        if out is not None:
            out.drop(request_id)
        hist = self.history.get(worker_id)
        if hist is not None:
            hist.set_decode(request_id, num_output_tokens)
            self.load_s(worker_id, now, LOAD_PIECES_AHEAD)  # as on_dispatch (a history is kept only where L is)
        key = self.key_of_record(rec)
        if key is not None and isinstance(key.stats, NodeStats):
            key.stats.add_decode(num_output_tokens)
        fit = self.fits.get(worker_id)
        if fit is not None and rec.first_token_s >= 0 and num_output_tokens > 1:
            tpot = (now - rec.first_token_s) / (num_output_tokens - 1)
            fit.add_decode(rec.prompt_tokens + num_output_tokens / 2, tpot)

    def on_abort(self, request_id: str, worker_id: WorkerId, now: float) -> None:
        rec = self.in_flight.get(request_id)
        if rec is not None and rec.worker == worker_id:
            del self.in_flight[request_id]
            out = self.outstanding.get(worker_id)
            if out is not None:
                out.drop(request_id)

    def on_kv_events(self, worker_id: WorkerId, batch: KvEventBatch) -> None:
        w, tree = worker_id, self.tree
        self._tree_gen += 1
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                idx = self.lru.get(w)
                if idx is None:
                    idx = self.lru[w] = LruIndex()
                keys = ev.block_hashes if ev.parent_block_hash is None else (ev.parent_block_hash, *ev.block_hashes)
                runs = tree.runs_of(keys)
                before = [run[0] for run in runs]  # a split keeps these
                parents = [node.parent for node in before]
                num_nodes = tree.num_nodes
                tree.mark_resident(w, ev.block_hashes, ev.parent_block_hash, batch.ts)
                if tree.num_nodes == num_nodes:
                    # NOTE: exact: no node added, so none split (a split adds its upper half) and no leaf: the
                    # blocks lie in the same nodes under the same parents, and the runs after are `before` again.
                    # Nearly every event: the router inserted the prompt's nodes at dispatch.
                    self._touch(before, w)
                else:
                    # no split (every node keeps its parent): only w's residency moved, and a new leaf holds w
                    # alone, so only w's index can change (a shared prefix's other holders: the whole fleet) are
                    # not asked
                    split = any(node.parent is not p for node, p in zip(before, parents, strict=True))
                    self._touch(before + [run[0] for run in tree.runs_of(keys)], None if split else w)
                self.resident_count[w] = self.resident_count.get(w, 0) + len(ev.block_hashes)
                evicted = self.evicted.get(w)
                if evicted:
                    # NOTE: exact: a hash enters evicted[w] only through a node noted with w's evictions
                    # (`note_evictions`, below), which a split copies to both halves and gc and unassignment
                    # clear with the set's entries; a block unknown before this event is in no node, so in no set.
                    # A store into a node w never evicted from skips its ~400 cache-cold set probes.
                    first = 0 if ev.parent_block_hash is None else 1  # keys[0] is the parent, not stored here
                    for node, i, j in runs:
                        if j > first and node.has_evictions(w):
                            evicted.difference_update(keys[max(i, first):j])
            elif isinstance(ev, BlockRemoved):
                tree.mark_evicted(w, ev.block_hashes)
                runs = tree.runs_of(ev.block_hashes)
                idx = self.lru.get(w)
                if idx is not None:
                    idx.touch_all(w, [node for node, _, _ in runs])  # once per node of the evicted run
                self.resident_count[w] = max(0, self.resident_count.get(w, 0) - len(ev.block_hashes))
                evicted = self.evicted.get(w)
                if evicted is None:
                    evicted = self.evicted[w] = tree.block_set()
                hs = ev.block_hashes
                for node, i, j in runs:
                    if tree.note_evictions(node, w):  # assigned to w: its blocks now may be in the set
                        evicted.update(hs[i:j])
            elif isinstance(ev, AllBlocksCleared):
                tree.clear_worker(w)
                tree.unassign_worker(w)  # its predictions were about a cache that no longer exists
                self.resident_count[w] = 0
                self.evicted.pop(w, None)
                self.lru.pop(w, None)

    def _touch(self, nodes: list[Any], only: WorkerId | None = None) -> None:
        """Reconcile every tracked worker's LRU index (`only`'s alone, when only its state can have moved) with
        these nodes (residency, parent, last_access).

        NOTE: only the indexes where a node is resident now or was tracked are asked: `LruIndex.touch` returns
        at once for any other (not resident there, no entry), and a KV event or split reaches a handful of the
        fleet's indexes, so most of the 16-fold calls per node did nothing.
        """
        seen: set[int] = set()
        if only is None:
            items: Any = self.lru.items()
        else:
            idx = self.lru.get(only)
            items = [(only, idx)] if idx is not None else []
        for node in nodes:
            k = id(node)
            if k in seen:
                continue
            seen.add(k)
            res = node.resident
            for w, idx in items:
                if w in res or k in idx.entries:
                    idx.touch(w, node, res)

    def _touch_holders(self, nodes: list[Any], moved: Any = None) -> None:
        """`_touch` for nodes whose residency and parents did not change: only the indexes of the workers they are
        resident on can hold them (an index keeps a node only while it is resident there: every residency change
        reaches `_touch` or `LruIndex.touch` from the KV-event hook), so the others are skipped, not asked
        (`ext/lru_order.touch_holders`: ~20 (node, holder) pairs per ToolBench dispatch, in C). `moved`: a split's
        lower half, whose residency and parent did change: the indexes that can hold it are asked first."""
        touch_holders(self.lru, nodes, moved)

    def on_worker_change(self, worker_id: WorkerId, now: float) -> None:
        rec = self._fleet.get(worker_id) if self._fleet is not None else None
        if rec is not None and getattr(rec, "healthy", rec.is_routable):
            self._facts.pop(worker_id, None)  # re-read its Info at the next select (it may have re-registered)
            self._remembered.clear()
            self._load_memo.pop(worker_id, None)
            self._cost_memo.pop(worker_id, None)
            return  # a drain or a state change: keep its cache view and load
        self.tree.remove_worker(worker_id)
        self._tree_gen += 1
        self._remembered.clear()
        for d in (self.history, self.hit_ratio, self.fits, self.evicted, self.resident_count, self.lru,
                  self._facts, self.outstanding, self._load_memo, self._cost_memo):
            d.pop(worker_id, None)  # type: ignore[attr-defined]
        # NOTE: hit_times stays: the nodes keep their hits on the worker, which M counts if it comes back within W
        # (`advance_cold` drops the times once they expire)
        self.moved_load.drop(worker_id)

    def counters(self) -> dict[str, int]:
        return {"rebalance_redirects": self.num_redirects, "replications": self.num_replications}

    def state_sizes(self) -> dict[str, int]:
        out = {"tree_nodes": self.tree.num_nodes, "tree_blocks": self.tree.num_blocks,
               "in_flight_requests": len(self.in_flight)}
        index_bytes = getattr(self.tree, "index_bytes", None)  # the C build's block index (the reference: a dict)
        if index_bytes is not None:
            out["tree_index_bytes"] = index_bytes
        return out

    def on_tick(self, now: float) -> None:
        for h in self.history.values():
            h.expire(now)
        for hw in self.hit_ratio.values():
            hw.expire(now)
        self.moved_load.expire(now - self.cfg.history_window_s)
        if self._replicate_on and self.dirty_ttft:
            maybe_replicate(self, now)
        if self._rebalance_on and now >= self._next_rebalance:
            self._next_rebalance = now + self.cfg.rebalance_interval_s
            for model in sorted(self._models):
                rebalance(self, model, now)
        if now >= self._next_gc:
            before, visits = self.tree.num_blocks, self.tree.gc_visits
            # only gc removes nodes, so the growth since its last run is what was inserted since
            budget = max(self.cfg.gc_budget_blocks, 2 * (before - self._blocks_after_gc))
            self.gc(now, budget)
            self._blocks_after_gc = self.tree.num_blocks
            # a mass expiry (every node of a burst, in one second) goes over the next ticks, not in one stall
            budget_hit = before - self.tree.num_blocks + self.tree.gc_visits - visits >= budget
            self._next_gc = now if budget_hit else now + self.cfg.gc_interval_s
        for w in self.history:  # expiry and moves above changed L: price it here, off the selects' path
            self.load_s(w, now, LOAD_PIECES_AHEAD)  # (a history is kept only where L is priced)
        self.advance_cold(now)
        if self.cfg.warm_eviction_needs:
            self.warm_eviction_orders(now)

    def warm_eviction_orders(self, now: float) -> None:
        """Simulate each worker's eviction order as far as the largest recent need, and price its victims, here,
        off the selects' path (`LruIndex.warm`).

        NOTE: why: on full caches of long prompts (video QA, 16 workers) the slowest 1% of selects priced M on
        ~12 workers, each extending its kept order and pricing terms afresh (~10 steps, ~4 terms); the hooks
        between two ticks keep most of an order and its terms (`EvictionOrder`'s rules), so the select is left a
        bisection and memo hits. The decisions are the same: an order's steps and a term do not depend on when
        they were computed (the replay test checks every M against the full scan). The tick pays a walk of every
        worker's order up to the need each time, memo hits where nothing changed, and at most
        `warm_eviction_budget` units of work in all, a step or a victim priced each (a fresh order over many small
        cold nodes can take thousands of steps: ~6 ms at 5,000; many small hot victims, as many lookups), so no
        tick stalls the loop on it (README "Decision cost").
        """
        needs = self.recent_needs
        if not needs:
            return
        need = max(needs)
        cfg = self.cfg
        budget = cfg.warm_eviction_budget
        ws = list(self.lru)
        start = self._warm_from % len(ws) if ws else 0
        for i in range(start, start + len(ws)):  # round robin from where the last tick's budget ran out
            w = ws[i % len(ws)]
            facts = self._facts.get(w)
            if facts is not None:
                budget -= self.lru[w].warm(w, need, now, cfg.node_window_s, facts.block_size, self.cost_model(w),
                                           cfg.eviction_cost, budget)
                if budget <= 0:
                    self._warm_from = i + 1  # (a worker cut short goes on from its kept order at its next turn)
                    return

    def cold_floor(self, w: WorkerId, now: float) -> float:
        """A time at or before every request through any node on w within the node window W: the earliest
        dispatch to w still kept (a hit on a node is a dispatch through it, and sets its last_access), else now.
        Never decreases: later hits are later dispatches."""
        times = self.hit_times.get(w)
        return times[0] if times and times[0] < now else now

    def advance_cold(self, now: float) -> None:
        """Move each LRU index's cold floor (`LruIndex.advance`), so M skips its simulation when the candidates
        keyed before the floor cover the need (`LruIndex.cold_blocks`). Only times before W are dropped, so the
        floor stays at or before every hit a later select prices (a stale floor only counts fewer blocks). A gone
        worker's times are kept until they expire (`on_worker_change`)."""
        cutoff = now - self.cfg.node_window_s
        gone = []
        for w, times in self.hit_times.items():
            while times and times[0] < cutoff:
                times.popleft()
            if not times and w not in self.lru:
                gone.append(w)
        for w in gone:
            del self.hit_times[w]
        for w, idx in self.lru.items():
            idx.advance(cold_bucket(self.cold_floor(w, now)))

    # ------------------------------------------------------------------------------------------ background
    def routable(self, model: str) -> list[WorkerView]:
        return list(self._fleet.routable(model)) if self._fleet is not None else []

    def gc(self, now: float, budget_blocks: int | None = None) -> int:
        """Drop tree nodes with no resident worker and no request within W (within `budget_blocks` of blocks freed
        plus candidates visited: `RadixTree.gc`), and their blocks from the evicted sets of the workers they were
        assigned to.

        NOTE: exact and O(removed blocks x their workers): a hash enters w's set only while its node is assigned
        to w, and a node loses an assignment only here or when the worker is unassigned (which drops the set),
        so the sets to prune are exactly those of the removed nodes' assigned workers.
        """
        removed = self.tree.gc(now, self.cfg.node_window_s, budget_blocks, evicted=self.evicted)
        self._tree_gen += 1
        return removed


_OWN_EVICT_S = PrebleE2._evict_s  # (`_LRU_PRICING`)
_OWN_PROTECTED = PrebleE2._protected


class PrebleE2Base(PrebleE2):
    """E2 alone (ablation step 1): no rebalancing, no replication, no P/D balancing."""

    name = "e2_base"

    def __init__(self, config: E2Config | None = None) -> None:
        super().__init__(
            config or E2Config(enable_rebalancing=False, enable_replication=False, enable_pd_balancing=False)
        )


class PrebleE2Rebal(PrebleE2):
    """E2 + rebalancing and replication (ablation step 2), no P/D balancing."""

    name = "e2_rebal"

    def __init__(self, config: E2Config | None = None) -> None:
        super().__init__(config or E2Config(enable_pd_balancing=False))


__all__ = ["E2Config", "PrebleE2", "PrebleE2Base", "PrebleE2Rebal"]
