"""E2's per-select loops (Preble §5.1-5.2, `router/policies/preble_e2.py`): the exploit set, the per-worker
lower bounds (LOADCOST without M) and the branch and bound over them.

Reference build (obviously correct); `_e2_select_c.pyx` is the Cython build, `e2_select.py` the selector.

- `Outstanding`: the work the policy has dispatched to one worker and not seen done, kept by its hooks; the
  selects read `queued_s`, `queued_tokens` and `num_decoding`.
- `exploit_set`: the workers holding a prompt's key portion, with a rebalancing redirect and replicas applied.
- `raw_bounds`: each candidate's L (its history load), R (the request's own uncached prefill on it), Q (prefill
  queued ahead of it) and how many blocks the request would evict there. The policy's state is read through a
  `BoundsEnv` that holds its dicts by reference, never written here except through `load_s` on a memo miss.
- `cheapest`: the branch and bound of every explore and every exploit with several holders over those bounds,
  asking the caller for M only where it can still change the answer and `m_is_zero` cannot tell it is 0.
- `select_e2`: E2's whole select (`PrebleE2.select_steps`, whose steps call the functions above) as one call; a
  `SelectEnv` holds the policy. Here it is those steps themselves; the Cython build runs them in C, calling back
  into the policy only off the default path (excluded workers, a new pool, exploit overflow, hit-ratio
  DECODERATIO, the DEBUG line) and for M.
- `argmin_bounds` / `argmin_order`: the default policy's (`switchyard`, placement "argmin") lower bound of each
  pool worker's cost, and the order its branch and bound prices them in (an `ArgminEnv` holds what they read);
  `head_terms`, the terms it prices per worker before M, O and W; `co_residency`, `decode`, `decode_marginal` and
  `prefill`, the formulas inside them; `decode_in`, head_terms' D_in alone (the definition the anticipator's
  `decode_in` sums in C); `fill_level`, the level the default policy raises every D_in to before pricing
  (every pool worker's `decode_in`, then `water_level`).

Duck-typed (nothing here imports from `router/`): a worker view has `worker_id`, `kv_usage_frac`, `block_size`
and `kv_capacity_blocks`; a cost model `prefill_s(missed, cached)` (the Cython build computes it in C from
`terms` where a model has them: `ProfileCost`); facts `block_size` and `kv_capacity_blocks`; an outstanding record
`queued_s`, `queued_tokens` and `num_decoding` (`Outstanding` here; the Cython build reads its own build's in C,
any other through its attributes); an LRU index `heap`, `floor_b`, `below`, `cand` and `cold_blocks` (`LruIndex`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

Bound = tuple[float, float, float, int]  # (L, R, Q, blocks R_k would evict)
Priced = tuple[int, float, float, float, float]  # (index, L, M, R, Q)


def exploit_set(
    cached: dict[Any, int], key_end: int, by_id: dict[Any, Any], redirect: dict[Any, tuple[Any, float]] | None,
    replicas: dict[Any, float] | None, now: float,
) -> list[Any]:
    """The views (`by_id[w]`; every key of `cached` is in it) of the workers w with `cached[w] >= key_end`, in
    `cached`'s order, each replaced by its live redirect target (`redirect[w] = (target, until)`, live while
    until >= now, a target in `by_id`), then the live replicas in `by_id` (`replicas[w] = until`) added; each
    worker once, at its first place."""
    ks = [wid for wid, c in cached.items() if c >= key_end]
    if not (redirect or replicas):
        return [by_id[wid] for wid in ks]
    if not ks:
        return []  # replicas only widen an existing holder set
    if redirect:
        for i, wid in enumerate(ks):
            got = redirect.get(wid)
            if got is not None and got[1] >= now and got[0] in by_id:
                ks[i] = got[0]
    if replicas:
        ks += [r for r, until in replicas.items() if until >= now and r in by_id]
    return [by_id[w] for w in dict.fromkeys(ks)]


class Outstanding:
    """The work this router has dispatched to one worker and not yet seen done (from its own hooks, no lag).

    queued: requests dispatched without a first token yet -> (uncached prompt tokens, PT_r s). Their prefill is
            still ahead of (or running with) any request dispatched now, so Σ PT_r over them is the prefill a new
            request waits behind on an engine that admits in arrival order [inferred].
    decoding: requests past their first token -> context tokens (prompt + predicted output / 2). Every engine
            iteration carries one decode token for each of them; `decode_tokens` / (decode tokens + queued
            prefill tokens) is the decode-token fraction of the work ahead (errata E9, the [inferred] option).
    num_decoding: len(decoding), kept beside it so that E2's P/D pass, which reads every worker's fraction at each
            explore, reads two ints of this record and not the dict too (a cache miss a worker).
    O(1) per hook (`PrebleE2` keeps one per worker); the selects only read. The Cython build keeps `queued_s` and
    the counts as C numbers, which its selects read in C.
    """

    __slots__ = ("queued", "decoding", "queued_s", "queued_tokens", "decoding_ctx", "num_decoding")

    def __init__(self) -> None:
        self.queued: dict[str, tuple[int, float]] = {}
        self.decoding: dict[str, int] = {}
        self.queued_s = 0.0
        self.queued_tokens = 0
        self.decoding_ctx = 0
        self.num_decoding = 0

    def add(self, request_id: str, missed_tokens: int, prefill_s: float) -> None:
        self.drop(request_id)
        self.queued[request_id] = (missed_tokens, prefill_s)
        self.queued_s += prefill_s
        self.queued_tokens += missed_tokens

    def first_token(self, request_id: str, context_tokens: int) -> None:
        q = self.queued.pop(request_id, None)
        if q is None:
            return
        self._unqueue(q)
        self.decoding[request_id] = context_tokens  # (not there: `add` dropped it)
        self.decoding_ctx += context_tokens
        self.num_decoding += 1

    def drop(self, request_id: str) -> None:
        q = self.queued.pop(request_id, None)
        if q is not None:
            self._unqueue(q)
        c = self.decoding.pop(request_id, None)
        if c is not None:
            self.decoding_ctx -= c
            self.num_decoding -= 1

    def _unqueue(self, q: tuple[int, float]) -> None:
        if not self.queued:  # NOTE: exact reset, so float drift never outlives an empty queue
            self.queued_s, self.queued_tokens = 0.0, 0
        else:
            self.queued_tokens -= q[0]
            self.queued_s -= q[1]

    def decode_fraction(self) -> float:
        """Decode tokens / all tokens in the work ahead (1 token per decoding request, the queued prefill);
        0 when idle."""
        d = self.num_decoding
        total = d + self.queued_tokens
        return d / total if total > 0 else 0.0


class BoundsEnv:
    """What the bounds read of the policy: its dicts (by reference, so they stay current), its two fallbacks
    and its configuration.

    - `load_memo[w] = (valid_from, t_0, L_0, t_1, L_1, ...)`: from valid_from on, L_j holds for the first j
      with now - window_s <= t_j (`PrebleE2.load_s`'s rule); otherwise `load_s(w, now)` computes (and
      re-memoises) it.
    - `cost_memo[w]`, else `cost_model(w)`: w's cost model.
    - `facts[w]`: w's static block size and KV capacity (else read from the view).
    """

    __slots__ = ("cost_memo", "cost_model", "facts", "lru", "resident_count", "outstanding", "load_memo",
                 "load_s", "window_s", "evict_on", "assume_full", "with_l", "with_q")

    def __init__(
        self, *, cost_memo: dict[Any, Any], cost_model: Callable[[Any], Any], facts: dict[Any, Any],
        lru: dict[Any, Any], resident_count: dict[Any, int], outstanding: dict[Any, Any],
        load_memo: dict[Any, tuple[float, float, float]], load_s: Callable[[Any, float], float], window_s: float,
        evict_on: bool, assume_full: bool, with_l: bool, with_q: bool,
    ) -> None:
        self.cost_memo, self.cost_model, self.facts = cost_memo, cost_model, facts
        self.lru, self.resident_count, self.outstanding = lru, resident_count, outstanding
        self.load_memo, self.load_s, self.window_s = load_memo, load_s, window_s
        self.evict_on, self.assume_full, self.with_l, self.with_q = evict_on, assume_full, with_l, with_q


def raw_bounds(env: BoundsEnv, ws: Sequence[Any], cached: dict[Any, int], n: int, now: float) -> list[Bound]:
    """(L, R, Q, blocks R_k would evict) of each worker of `ws`, in order, for a prompt of `n` tokens of which
    worker w holds the leading `cached[w]` blocks. R is priced once per (cached blocks, block size, cost model):
    most candidates hold the same prefix (often none)."""
    load_memo, cutoff = env.load_memo, now - env.window_s
    r_memo: dict[tuple[int, int, int], tuple[int, float]] = {}
    out: list[Bound] = []
    for w in ws:
        wid = w.worker_id
        cost = env.cost_memo.get(wid) or env.cost_model(wid)
        f = env.facts.get(wid)
        bs, cap = (w.block_size, w.kv_capacity_blocks) if f is None else (f.block_size, f.kv_capacity_blocks)
        cb = cached[wid]
        rk = (cb, bs, id(cost))  # the cost objects outlive the call (the memo holds them): ids are stable
        got = r_memo.get(rk)
        if got is None:
            tok = min(cb * bs, max(n - 1, 0))  # the last token is always computed
            got = r_memo[rk] = (n - tok, cost.prefill_s(n - tok, tok))
        missed, r = got
        evict = 0
        if env.evict_on and wid in env.lru:
            used = max(env.resident_count.get(wid, 0), int(w.kv_usage_frac * cap))
            need = -(-missed // bs)
            evict = need if env.assume_full else need - max(cap - used, 0)
        load = 0.0
        if env.with_l:
            memo = load_memo.get(wid)
            load = None
            if memo is not None and memo[0] <= now:
                load = next((memo[j + 1] for j in range(1, len(memo), 2) if cutoff <= memo[j]), None)
            if load is None:
                load = env.load_s(wid, now)
        q = 0.0
        if env.with_q:
            o = env.outstanding.get(wid)
            if o is not None and o.queued_s > 0:
                q = o.queued_s
        out.append((load, r, q, evict))
    return out


def m_is_zero(lru: Any, path: Sequence[Any], need: int) -> bool:
    """Whether `LruIndex.eviction_cost` answers 0 for `need` blocks before simulating the eviction order (its
    early exits): no eviction candidates, or the cold candidates (`cold_blocks`, the nodes of `path` protected)
    cover the need. The Cython build reads the same state (`floor_b`, `below`, `cand`) in C."""
    return not lru.heap or lru.cold_blocks({id(x) for x in path}) >= need


def cheapest(
    env: BoundsEnv, ws: Sequence[Any], cached: dict[Any, int], n: int, now: float, turn: int,
    price_m: Callable[[int, int], float], path: Sequence[Any],
) -> tuple[int, list[Priced]]:
    """E2's branch and bound: (the index in `ws` of the worker with the lowest (LOADCOST, rotated index), every
    worker priced on the way as (index, L, M, R, Q), in pricing order).

    The workers are taken in order of (bound L + R + Q, (index − turn) mod len(ws)); the rotated index is unique,
    so no two keys tie. M = `price_m(index, blocks to evict)` (an LRU simulation, the expensive part) is asked
    only of a worker that would evict, whose bound can still win and whose LRU index (`env.lru`) cannot tell
    that M is 0 (`m_is_zero`, `path` = the prompt's matched nodes, never victims: `price_m` must protect them too); LOADCOST = L + M + R + Q, summed in that order
    (`Cost.total_s`'s), so with M = 0 it is the bound itself. Float addition is monotone: once a bound exceeds the
    best LOADCOST so far, so does every later worker's LOADCOST, and the walk stops.
    """
    if not ws:
        raise ValueError("cheapest: no worker to price")
    m = len(ws)
    order = sorted((load + r + q, (i - turn) % m, i, load, r, q, evict)
                   for i, (load, r, q, evict) in enumerate(raw_bounds(env, ws, cached, n, now)))
    best, best_key = -1, (0.0, 0)
    priced: list[Priced] = []
    for lb, rot, i, load, r, q, evict in order:
        if best >= 0 and (lb, rot) > best_key:
            break  # this bound and every later one exceed the best total
        mm = 0.0
        if evict > 0 and not m_is_zero(env.lru[ws[i].worker_id], path, evict):
            mm = price_m(i, evict)
        priced.append((i, load, mm, r, q))
        key = (load + mm + r + q, rot)
        if best < 0 or key < best_key:
            best, best_key = i, key
    return best, priced


class SelectEnv:
    """What `select_e2` reads: the policy (its tables, configuration and step methods); for the Cython build also
    the `Decision` and `NodeStats` classes, how many `Decision`s the policy's memo of them per (worker, reason)
    holds before it starts over, the policy's logger, whose DEBUG line the policy's `_decide` writes, and
    `m_pricing` = (`PrebleE2._evict_s`, `LruPricing.eviction_cost` and `.order` as the policy's module defined
    them, the cost class whose victim terms an eviction order keeps, the victim term of the configured mode,
    `PrebleE2._protected`): the build reads M from a worker's eviction order in C, and the ids M protects, while
    the policy and its indexes have those very methods (nothing here imports from `router/`). This reference reads
    only the policy."""

    __slots__ = ("policy", "decision", "node_stats", "decisions_cap", "logger", "m_pricing")

    def __init__(
        self, policy: Any, *, decision: type, node_stats: type, decisions_cap: int, logger: Any,
        m_pricing: tuple[Any, ...],
    ) -> None:
        self.policy, self.decision, self.node_stats, self.decisions_cap = policy, decision, node_stats, decisions_cap
        self.logger, self.m_pricing = logger, m_pricing


def select_e2(env: SelectEnv, ctx: Any, fleet: Any, now: float) -> Any:
    """E2's decision for `ctx` over `fleet` at `now` (a `Decision`, or None without a routable worker): the
    policy's `select_steps`."""
    return env.policy.select_steps(ctx, fleet, now)


_NO_QUEUED: dict[Any, Any] = {}  # a worker with no queued requests (read only)


class ArgminEnv:
    """What the default policy's bounds (`argmin_order`) read of it: its dicts by reference, its fallbacks and its
    weights (`router/policies/switchyard_policy.py`, `Switchyard.lower_bounds` has the terms).

    - `cost_memo[w]`, else `cost_model(w)`: w's cost model.
    - `outstanding[w]`: `queued_s` (E2's Σ PT of queued prefills) and `queued_tokens` (their missed tokens).
    - `queued[w]`: w's requests without a first token yet ({rid: request}; only their number and, for the fill
      level, their `prompt_tokens`, `kv_prompt_tokens` and `predicted_tokens` are read).
    - `batched_tokens(view)`: w's max_num_batched_tokens B (read only when tokens are queued on w).
    - The weights: the bound's `interference_weight` is i·λ; `head_terms` weighs I and B as λ·(i·I + b·B), with
      `externality_weight` λ, `interference_term_weight` i and `behind_weight` b, and `window_s` is the span the
      arrival rates are measured over (B's busy period at most).
    """

    __slots__ = ("cost_memo", "cost_model", "outstanding", "queued", "batched_tokens", "queue_weight",
                 "prefix_weight", "decode_weight", "interference_weight", "queue_by_sum", "joint_prefill",
                 "externality_weight", "interference_term_weight", "behind_weight", "window_s")

    def __init__(
        self, *, cost_memo: dict[Any, Any], cost_model: Callable[[Any], Any], outstanding: dict[Any, Any],
        queued: dict[Any, dict[Any, Any]], batched_tokens: Callable[[Any], int], queue_weight: float,
        prefix_weight: float, decode_weight: float, interference_weight: float, queue_by_sum: bool,
        joint_prefill: bool, externality_weight: float, interference_term_weight: float, behind_weight: float,
        window_s: float,
    ) -> None:
        self.cost_memo, self.cost_model, self.outstanding = cost_memo, cost_model, outstanding
        self.queued, self.batched_tokens = queued, batched_tokens
        self.queue_weight, self.prefix_weight, self.decode_weight = queue_weight, prefix_weight, decode_weight
        self.interference_weight, self.queue_by_sum, self.joint_prefill = (interference_weight, queue_by_sum,
                                                                          joint_prefill)
        self.externality_weight, self.interference_term_weight = externality_weight, interference_term_weight
        self.behind_weight, self.window_s = behind_weight, window_s


def queued_prefill(env: ArgminEnv, w: Any, cost: Any, t: int, missed: int) -> tuple[float, int]:
    """(Q's prefill part, k iterations ahead of the request's own) for t > 0 missed tokens queued on w ahead of a
    request that misses `missed`: they run in k = ceil(t / B) chunked iterations of B = max_num_batched_tokens,
    k × PREFILLTIME(ceil(t / k), 0). With `joint_prefill`, when the request's tokens fit beside them in one
    iteration (t + missed <= B), they run together: it waits max(0, PREFILLTIME(t + missed, 0) −
    PREFILLTIME(missed, 0)) beyond its own prefill, and k = 0."""
    b = env.batched_tokens(w)
    if env.joint_prefill and t + missed <= b:
        q = cost.prefill_s(t + missed, 0) - cost.prefill_s(missed, 0)
        return (q if q > 0.0 else 0.0), 0
    k = -(-t // b)
    return k * cost.prefill_s(-(-t // k), 0), k


def step_gain(env: ArgminEnv, w: Any, cost: Any, o: Any, r: float, missed: int) -> float:
    """What a request's prefill adds to each iteration it rides in (I's and B's step), at least 0: R −
    PREFILLTIME(0, 0) alone; with `joint_prefill`, when the T missed tokens already queued on w (`o`, w's
    outstanding record) and the request's `missed` fit one iteration (0 < T, T + missed <= B), the growth of that
    iteration, PREFILLTIME(T + missed, 0) − PREFILLTIME(T, 0), so a per-iteration prefill overhead the queued
    prompts pay anyway is not charged twice; its attention over its cached prefix, R − PREFILLTIME(missed, 0),
    either way."""
    t = o.queued_tokens if o is not None and env.joint_prefill else 0
    if t > 0 and t + missed <= env.batched_tokens(w):
        gain = cost.prefill_s(t + missed, 0) - cost.prefill_s(t, 0) + r - cost.prefill_s(missed, 0)
    else:
        gain = r - cost.prefill_s(0, 0)
    return gain if gain > 0.0 else 0.0


def busy_period(backlog_s: float, rho: float, span_s: float | None, window_s: float) -> float:
    """How long a worker stays busy with `backlog_s` of prefill queued (the request's included) while work keeps
    arriving at utilisation ρ: the M/G/1 busy period backlog / (1 − ρ), at most the span ρ was measured over
    (`span_s`, else `window_s`, the arrival window once it is full; ρ >= 1: a backlog that does not drain within
    it), never less than the backlog itself. ρ <= 0: the backlog."""
    if rho <= 0.0:
        return backlog_s
    horizon = window_s if span_s is None else span_s
    if rho < 1.0 and backlog_s < horizon * (1.0 - rho):
        horizon = backlog_s / (1.0 - rho)
    return backlog_s if backlog_s > horizon else horizon


def argmin_bounds(env: ArgminEnv, pool: Sequence[Any], cached: dict[Any, int], p: int, d: int) -> list[float]:
    """Per pool worker, in pool order, the default policy's lower bound of its cost for a request of p prompt
    tokens (worker w holds the leading `cached[w]` blocks) and d predicted output tokens:
    qw·Q + pw·R + dw·D_self + iw·I, with Q without its decode part and I over the queued requests alone.

    - R = PREFILLTIME(p − tok, tok), tok = min(cached blocks × block size, p − 1) (the last token is computed);
    - D_self = DECODETIME(d, p + (d − 1)/2);
    - Q: "sum" pricing, max(0, queued_s); else 0 without queued missed tokens, otherwise their T tokens in
      k = ceil(T / B) chunks, k × PREFILLTIME(ceil(T / k), 0), or with `joint_prefill` and T + m <= B (m = r's
      missed tokens) PREFILLTIME(T + m, 0) − PREFILLTIME(m, 0), at least 0;
    - I = n_queued × gain, gain = R − PREFILLTIME(0, 0), or with `joint_prefill` and 0 < T, T + m <= B,
      PREFILLTIME(T + m, 0) − PREFILLTIME(T, 0) + R − PREFILLTIME(m, 0); at least 0.
    """
    qw, pw, dw, iw = env.queue_weight, env.prefix_weight, env.decode_weight, env.interference_weight
    last = p - 1 if p > 1 else 0
    out: list[float] = []
    for w in pool:
        wid = w.worker_id
        cost = env.cost_memo.get(wid) or env.cost_model(wid)
        tok = cached[wid] * w.block_size
        if tok > last:
            tok = last
        missed = p - tok
        r = cost.prefill_s(missed, tok)
        d_self = cost.decode_s(d, p + (d - 1) / 2)
        o = env.outstanding.get(wid)
        q = 0.0
        if env.queue_by_sum:
            if o is not None:
                q = max(0.0, o.queued_s)
        elif o is not None and o.queued_tokens > 0:
            q = queued_prefill(env, w, cost, o.queued_tokens, missed)[0]
        nq = len(env.queued.get(wid, _NO_QUEUED))
        interference = 0.0
        if nq:
            interference = nq * step_gain(env, w, cost, o, r, missed)
        out.append(qw * q + pw * r + dw * d_self + iw * interference)
    return out


def argmin_order(
    env: ArgminEnv, pool: Sequence[Any], cached: dict[Any, int], p: int, d: int, turn: int
) -> list[tuple[float, int, int]]:
    """(bound, rotated index (i − turn) mod n, i) of each pool worker i, ascending: the order in which the default
    policy's branch and bound prices them (`argmin_bounds`; the rotation is a permutation, so no two keys tie)."""
    n = len(pool)
    return sorted(zip(argmin_bounds(env, pool, cached, p, d), [(i - turn) % n for i in range(n)], range(n),
                      strict=True))


HeadTerms = tuple[float, float, float, float, float, float, int, float, float, float]


def head_terms(
    env: ArgminEnv, w: Any, cost: Any, running: Sequence[tuple[int, int]], queued: Sequence[tuple[int, int, int]],
    p: int, d: int, cached_blocks: int, load: float, r: float, q: float, arrivals_per_s: float,
    prefill_load: float, load_span_s: float | None,
) -> HeadTerms:
    """The default policy's terms of w's cost other than M, O and W, and their weighted parts (`Switchyard.terms`,
    the terms it prices before M, O and W: one call, the same floats in the same order as its sum):
    (Q, D_self, D_in, D_out, I, B, missed tokens, head, dec, inter), where head = L + qw·Q + pw·R,
    dec = dw·(D_self + D_in + λ·D_out) and inter = λ·(i·I + b·B).

    `running` [(remaining, context)] and `queued` [(prompt, private prompt, D)] are w's anticipated batch; L, R
    and E2's Q come from E2's bound kernel (`raw_bounds`); B's ρ and span from w's busy fraction.
    - missed = p − min(cached blocks × block size, p − 1) (`Switchyard.missed_tokens`: the last token is
      always computed);
    - Q, the request's wait for its first token beyond its own prefill, as the engine batches it: "sum" pricing,
      E2's Q; else `queued_prefill` of the T >= 0 missed tokens queued on w (0 and k = 0 without any), plus,
      since every iteration until its first token also carries w's n decoders (running + queued, total context
      c) and it waits half an iteration on average for the one in flight, (k + 1.5) × decode_marginal_s(n, c/n);
    - D_self = DECODETIME(d, p + (d − 1)/2); D_in, D_out: `co_residency` of the running, plus of the queued as
      (D, prompt);
    - I = n × `step_gain`: each co-runner is delayed by the request's step;
    - B = arrivals_per_s × `busy_period`(Q + R, ρ, span) × step gain: the requests that arrive before its
      prefill is done wait behind it, each by its step.
    """
    wid = w.worker_id
    shared = cached_blocks * w.block_size
    last = p - 1 if p > 1 else 0
    missed = p - (shared if shared <= last else last)
    o = env.outstanding.get(wid)
    n = len(running) + len(queued)
    if env.queue_by_sum:
        queue = q
    else:
        t = max(0, o.queued_tokens) if o is not None else 0
        queue, k = queued_prefill(env, w, cost, t, missed) if t else (0.0, 0)
        if n:
            ctx = sum(c for _, c in running) + sum(px for px, _, _ in queued)
            queue += (k + 1.5) * cost.decode_marginal_s(n, ctx / n)
    d_self = cost.decode_s(d, p + (d - 1) / 2)
    in_run, out_run = co_residency(running, p, d, cost)
    in_q, out_q = co_residency([(dx, px) for px, _, dx in queued], p, d, cost)
    d_in, d_out = in_run + in_q, out_run + out_q
    gain = step_gain(env, w, cost, o, r, missed)
    interference = n * gain
    behind = arrivals_per_s * busy_period(queue + r, prefill_load, load_span_s, env.window_s) * gain
    lam = env.externality_weight
    head = load + env.queue_weight * queue + env.prefix_weight * r
    dec = env.decode_weight * (d_self + d_in + lam * d_out)
    inter = lam * (env.interference_term_weight * interference + env.behind_weight * behind)
    return queue, d_self, d_in, d_out, interference, behind, missed, head, dec, inter


def prefill(cost: Any, missed: int, cached: int) -> float:
    """`cost.prefill_s(missed, cached)` (the Cython build prices `ProfileCost`'s in C)."""
    return cost.prefill_s(missed, cached)  # type: ignore[no-any-return]


def decode(cost: Any, num_tokens: int, context_tokens: float) -> float:
    """`cost.decode_s(num_tokens, context_tokens)` (the Cython build prices `ProfileCost`'s in C)."""
    return cost.decode_s(num_tokens, context_tokens)  # type: ignore[no-any-return]


def decode_marginal(cost: Any, num_tokens: float, context_tokens: float) -> float:
    """`cost.decode_marginal_s(num_tokens, context_tokens)` (the Cython build prices `ProfileCost`'s in C)."""
    return cost.decode_marginal_s(num_tokens, context_tokens)  # type: ignore[no-any-return]


def decode_in(
    running: Sequence[tuple[int, int]], queued: Sequence[tuple[int, int, int]], prompt_tokens: int, d: int, cost: Any
) -> float:
    """D_in alone, the float `head_terms` prices for the same batch (its running [(remaining, context)] and queued
    [(prompt, private prompt, D)]): the definition `Anticipator.decode_in` sums from its records."""
    return (co_residency(running, prompt_tokens, d, cost)[0]
            + co_residency([(dx, px) for px, _, dx in queued], prompt_tokens, d, cost)[0])


def fill_level(
    env: ArgminEnv, pool: Sequence[Any], ants: Sequence[Any], p: int, d: int, rate: float
) -> tuple[float, float]:
    """The default policy's fill level for a request of p prompt tokens and d predicted tokens, `rate` arrivals a
    second: (L, floor). L is the level of D_self + D_in, the decode time r meets on a pool worker, once the next
    arrivals have filled the workers where it is least; floor = min over the pool of L − D_self_w, at least 0,
    the D_in every worker is raised to at least (the pruning's lift).

    Each worker's D_self is `cost.decode_s(d, p + (d − 1)/2)` (as `head_terms`) and its D_in its anticipator's
    `decode_in` (`ants`, in pool order: its records and `env.queued[w]`, the requests dispatched to it without a
    first token), with its cost model; F = rate × D_self × the marginal of sharing half of r's iterations, ⌊d/2⌋
    tokens at context p + ⌊d/2⌋, on the worker the arrivals fill first (the least D_self + D_in, the first such
    in pool order: so the level does not depend on the order the workers joined in); L = `water_level` of the
    D_self + D_in values and F. On a pool of one profile D_self is the same everywhere, so L − D_self is the level
    of the D_in values alone; on a mixed fleet a slower worker's larger D_self keeps the arrivals off it, as the
    policy does. (0.0, 0.0) for an empty pool."""
    if not pool:
        return 0.0, 0.0
    totals = []
    slowest = 0.0
    ctx = p + (d - 1) / 2
    quickest = None  # (D_self + D_in, D_self, cost) of the worker the arrivals fill first
    for w, ant in zip(pool, ants, strict=True):
        wid = w.worker_id
        cost = env.cost_memo.get(wid) or env.cost_model(wid)
        d_self = cost.decode_s(d, ctx)
        slowest = max(slowest, d_self)
        total = d_self + ant.decode_in(env.queued.get(wid, _NO_QUEUED), d, cost)
        totals.append(total)
        if quickest is None or total < quickest[0]:
            quickest = (total, d_self, cost)
    assert quickest is not None
    _, d_self, cost = quickest
    # arrivals while r decodes alone (D_self), each sharing half of r's iterations at r's context
    fill = rate * d_self * cost.decode_marginal_s(max(1, d // 2), p + d // 2)
    level = water_level(totals, fill)
    return level, max(0.0, level - slowest)


def water_level(values: Sequence[float], fill: float) -> float:
    """The level L that `fill` poured over `values` reaches, the lowest filled first: Σ max(0, L − v) = fill.
    fill = 0: min(values); no values: 0.0."""
    s = sorted(values)
    acc = 0.0
    for k, v in enumerate(s):
        acc += v
        level = (fill + acc) / (k + 1)
        if k + 1 == len(s) or level <= s[k + 1]:
            return level
    return 0.0


def co_residency(batch: Sequence[tuple[int, int]], prompt_tokens: int, d: int, cost: Any) -> tuple[float, float]:
    """The default policy's D_co over (remaining, context) co-runners of a request of
    `prompt_tokens` and d predicted tokens: m_x = min(d, remaining_x) shared iterations, in each of which the
    request pays x's marginal sequence cost and x pays the request's; the marginal is linear in context, so each
    side is one `decode_marginal_s` at the m-weighted mean context. (0.0, 0.0) without co-runners."""
    m_sum = 0
    own_ctx = pair_ctx = 0.0
    for rem, c in batch:
        m = rem if rem < d else d
        half = (m - 1) / 2
        m_sum += m
        own_ctx += m * (c + half)
        pair_ctx += m * (prompt_tokens + half)
    if not m_sum:
        return 0.0, 0.0
    return cost.decode_marginal_s(m_sum, own_ctx / m_sum), cost.decode_marginal_s(m_sum, pair_ctx / m_sum)
