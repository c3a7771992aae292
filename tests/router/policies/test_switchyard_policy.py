"""The default policy `switchyard` in virtual time: each cost term on a hand-built fleet, the ablations, and the
decisions the terms exist for. Workers come from `make_fleet` (perf_profile "" and no timing samples, so the
default profile llama3-8b-a100 prices everything); block size 16; the clock stays at `NOW`, so the anticipator's
iteration stays 0 and every record's remaining length is its prediction.

Reference costs of that profile (PerfProfile.iteration_time_s, seconds):
    PT(0, 0)        = 0.0082374   the bare step (R − PT(0, 0) is what a prefill adds to a decode iteration)
    PT(512, 0)      = 0.0311979   above the 400-token knee: 0.058 ms per extra token
    PT(64, 1984)    = 0.0246766   a short tail after a long cached prefix
    PT(2048, 0)     = 0.1243109
    marginal(c)     = 0.16575 ms + 0.14055 ms × c / 1000   one more decoding sequence at context c
"""

from __future__ import annotations

import dataclasses
import logging
import zlib
from typing import Any

import pytest
from factories import make_fleet, make_requests, make_worker_info

from switchyard.bench.sim import SimConfig, Simulator
from switchyard.bench.workloads import WorkloadSpec, make_workload
from switchyard.ext import e2_select_py
from switchyard.ext.e2_select import argmin_order, fill_level, head_terms, raw_bounds
from switchyard.router.fleet import Fleet, StatsSample, WorkerState
from switchyard.router.policies.base import Decision, FleetView, RoutingContext, WorkerId, WorkerView
from switchyard.router.policies.preble_cost import profile_cost
from switchyard.router.policies.registry import POLICIES, make_policy
from switchyard.router.policies.switchyard_policy import (
    ABLATIONS,
    ArrivalRate,
    Switchyard,
    SwitchyardConfig,
    Terms,
)
from switchyard.workers.engine.profiles import DEFAULT_PROFILE

COST = profile_cost(DEFAULT_PROFILE)
NOW = 0.0
W0, W1 = WorkerId("w0"), WorkerId("w1")


def req(rid: str, prompt_len: int = 512, shared: int = 0, predicted: int | None = 50) -> RoutingContext:
    """`shared` leading tokens common to every request of a test, then tokens unique to `rid`."""
    base = make_requests(1, prompt_len=prompt_len, shared_prefix=shared)[0]
    uniq = tuple(
        10_000_000 + zlib.crc32(rid.encode()) % 1_000_000 * 8192 + k for k in range(prompt_len - shared)
    )
    tokens = tuple(range(shared)) + uniq
    hashes, prev = [], 0
    for b in range(len(tokens) // 16):
        prev = hash((prev, tokens[b * 16 : (b + 1) * 16])) & (2**64 - 1)
        hashes.append(prev)
    return dataclasses.replace(
        base,
        request_id=rid,
        prompt_token_ids=tokens,
        block_hashes=tuple(hashes),
        predicted_output_tokens=predicted,
    )


def dispatch(
    p: Switchyard,
    fleet: Fleet,
    ctx: RoutingContext,
    worker: WorkerId,
    running: bool = False,
    now: float = NOW,
) -> None:
    """Send `ctx` to `worker` (as if chosen), optionally past its prefill (then it is in the anticipator)."""
    p.select(ctx, fleet, now)  # memoises the fleet and worker facts, as the daemon's first select would
    fleet.note_dispatch(worker)
    d = ctx.predicted_output_tokens or p.predicted_tokens(ctx)
    p.on_dispatch(ctx, Decision(worker_id=worker, predicted_output_tokens=d), now)
    if running:
        p.on_first_token(ctx.request_id, worker, now)


def holder(p: Switchyard, fleet: Fleet, ctx: RoutingContext, worker: WorkerId) -> None:
    """`worker` served `ctx` to completion one second ago: it holds the prompt's blocks (least recently used
    first) and carries no load (the anticipator's map is empty, so its clock does not move until NOW)."""
    dispatch(p, fleet, ctx, worker, running=True, now=NOW - 1.0)
    fleet.note_done(worker)
    p.on_finish(ctx.request_id, worker, NOW - 1.0, 10)


def terms(p: Switchyard, fleet: Fleet, ctx: RoutingContext) -> dict[str, Terms]:
    m = p.tree.match(ctx.block_hashes)
    d = p.predicted_tokens(ctx)
    pool = fleet.routable(ctx.model)
    per_worker = p.arrival_rate("m").rate(NOW) / len(pool)  # B's arrival rate and ρ_w, as select passes them
    return {
        w.worker_id: p.terms(w, ctx, p._cached_blocks(w.worker_id, m, ctx.block_hashes), m.path, d, NOW,
                             arrivals_per_s=per_worker,
                             **busy_load(p, w.worker_id))
        for w in pool
    }


def busy_load(p: Switchyard, w: WorkerId) -> dict[str, float | None]:
    """B's ρ_w and the span it was measured over, as select passes them."""
    b = p.busy.get(w) if p.sy.busy_period else None
    rho, span = b.load(NOW) if b is not None else (0.0, None)
    return {"prefill_load": rho, "load_span_s": span}


def policy(n: int = 2, kv_capacity_blocks: int = 1000, **cfg: object) -> tuple[Switchyard, Fleet]:
    return Switchyard(SwitchyardConfig(**cfg)), make_fleet(n, kv_capacity_blocks=kv_capacity_blocks)


# ---------------------------------------------------------------------------------------------- each term
def test_idle_fleet_costs_are_prefill_plus_own_decode() -> None:
    p, fleet = policy()
    t = terms(p, fleet, req("r", 512, predicted=50))[W0]
    assert t.queue_s == t.evict_s == t.decode_co_s == t.interference_s == t.overflow_s == t.kv_wait_s == 0.0
    assert t.prefill_s == pytest.approx(0.0311979, abs=1e-7)  # PT(512, 0)
    # 50 decode iterations alone at mean context 512 + 49/2: 50 × 8.478 ms
    assert t.decode_self_s == pytest.approx(COST.decode_s(50, 536.5)) == pytest.approx(0.42392, abs=1e-5)
    assert t.total_s == pytest.approx(t.prefill_s + t.decode_self_s)


def test_queue_term_is_the_prefill_queued_ahead() -> None:
    p, fleet = policy(joint_prefill=False)
    dispatch(p, fleet, req("a", 512), W0)  # no first token yet: its 512 missed tokens are queued on w0
    t = terms(p, fleet, req("r", 512))
    # one batch (512 <= 8192 tokens): PT(512, 0) = 31.20 ms; then a decodes in the k + 1.5 = 2.5 iterations until
    # r's first token: 2.5 × marginal(512) = 2.5 × 0.2377 ms
    assert t[W0].queue_s == pytest.approx(0.0311979 + 2.5 * COST.decode_marginal_s(1, 512))
    assert t[W0].queue_s == pytest.approx(0.0317922, abs=1e-7)
    assert t[W1].queue_s == 0.0
    # E2's pricing (Σ single-request PT) agrees for one queued request
    p2, fleet2 = policy(queue_pricing="sum")
    dispatch(p2, fleet2, req("a", 512), W0)
    assert terms(p2, fleet2, req("r", 512))[W0].queue_s == pytest.approx(0.0311979, abs=1e-7)
    assert p.select(req("r", 512), fleet, NOW).worker_id == W1


def test_joint_prefill_queue_is_the_joint_iteration_beyond_r_own_prefill() -> None:
    p, fleet = policy()
    dispatch(p, fleet, req("a", 512), W0)  # 512 missed tokens queued on w0
    t = terms(p, fleet, req("r", 512))
    # r's 512 join a's 512 in one 1024-token iteration (<= B = 8192): r waits PT(1024, 0) − PT(512, 0) beyond its
    # own prefill, and its first token is 1.5 iterations of a's drag away (the one in flight, then the joint one)
    joint = COST.prefill_s(1024, 0) - COST.prefill_s(512, 0)
    assert t[W0].queue_s == pytest.approx(joint + 1.5 * COST.decode_marginal_s(1, 512))
    assert joint < COST.prefill_s(512, 0)  # cheaper than waiting for a's prefill iteration, then r's own
    assert t[W1].queue_s == 0.0
    # past one iteration (8000 + 512 > B = 8192) r waits for the queued prompt's iteration, then runs its own
    p2, fleet2 = policy()
    dispatch(p2, fleet2, req("a", 8000), W0)
    q = terms(p2, fleet2, req("r", 512))[W0].queue_s
    assert q == pytest.approx(COST.prefill_s(8000, 0) + 2.5 * COST.decode_marginal_s(1, 8000))


def test_joint_prefill_interference_charges_no_second_iteration_overhead() -> None:
    """A worker that will run a prefill iteration anyway: r's prefill grows that iteration instead of adding one,
    so its decoders lose PT(T + m) − PT(T), not PT(m) − PT(0): llama3-8b-a100's fixed 16.2 ms prefill overhead
    (and its first 400 tokens, under the knee) are paid once."""
    p, fleet = policy()
    dispatch(p, fleet, req("x", 128, predicted=100), W0, running=True)  # a decoder on each worker
    dispatch(p, fleet, req("y", 128, predicted=100), W1, running=True)
    dispatch(p, fleet, req("a", 128), W0)  # and a prompt queued on w0
    t = terms(p, fleet, req("r", 128))
    alone = COST.prefill_s(128, 0) - COST.prefill_s(0, 0)
    grown = COST.prefill_s(256, 0) - COST.prefill_s(128, 0)
    assert alone > 0.016 > 0.001 > grown
    assert t[W1].interference_s == pytest.approx(1 * alone)
    assert t[W0].interference_s == pytest.approx(2 * grown)  # x and the queued a both ride in it
    # past the knee a joint prompt can cost more than one alone: the marginal is priced, not assumed cheaper
    assert COST.prefill_s(1024, 0) - COST.prefill_s(512, 0) > COST.prefill_s(512, 0) - COST.prefill_s(0, 0)
    off, fleet_off = policy(joint_prefill=False)
    dispatch(off, fleet_off, req("x", 128, predicted=100), W0, running=True)
    dispatch(off, fleet_off, req("a", 128), W0)
    assert terms(off, fleet_off, req("r", 128))[W0].interference_s == pytest.approx(2 * alone)


def test_batched_queue_shares_the_iteration_overhead() -> None:
    p, fleet = policy(n=1, joint_prefill=False)
    for i in range(4):
        dispatch(p, fleet, req(f"a{i}", 128), W0)
    # 4 × 128 = 512 queued tokens run as one 512-token batch: PT(512, 0), not 4 × PT(128, 0) = 4 × 24.4 ms;
    # plus the 4 decoders' drag on the 2.5 iterations until r's first token
    q = terms(p, fleet, req("r", 128))[W0].queue_s
    assert q == pytest.approx(COST.prefill_s(512, 0) + 2.5 * COST.decode_marginal_s(4, 128))
    assert COST.prefill_s(512, 0) < 4 * COST.prefill_s(128, 0)


def test_prefix_term_prices_only_the_missed_tokens() -> None:
    p, fleet = policy()
    holder(p, fleet, req("a", 2048, shared=1984), W0)
    t = terms(p, fleet, req("r", 2048, shared=1984))
    assert t[W0].prefill_s == pytest.approx(0.0246766, abs=1e-7)  # PT(64, 1984): 124 blocks cached on w0
    assert t[W1].prefill_s == pytest.approx(0.1243109, abs=1e-7)  # PT(2048, 0)


def test_eviction_term_prices_the_blocks_lru_would_evict() -> None:
    # w0: 40 blocks (640 tokens); a 512-token request left 32 resident blocks, used by 1 request within W
    p, fleet = policy(kv_capacity_blocks=40)
    a = req("a", 512)
    holder(p, fleet, a, W0)
    n = len(a.block_hashes)
    p.on_kv_events(W0, _stored(a))
    assert p.resident_count[W0] == n == 32
    t = terms(p, fleet, req("r", 512))
    # r misses 32 blocks, 8 are free: LRU evicts a's last 24 blocks (384 tokens after 128 kept) × N_j = 1
    assert t[W0].evict_s == pytest.approx(COST.prefill_s(384, 128)) == pytest.approx(0.0246652, abs=1e-7)
    assert t[W1].evict_s == 0.0  # nothing resident on w1


def test_co_residency_prices_both_directions_of_the_shared_iterations() -> None:
    p, fleet = policy()
    dispatch(p, fleet, req("x", 512, predicted=100), W0, running=True)  # in the map: 100 tokens remaining
    t = terms(p, fleet, req("r", 512, predicted=50))
    # m = min(50, 100) = 50 shared iterations; x's context 512 + j, r's 512 + j, mean over j < 50: 536.5
    one_side = COST.decode_marginal_s(50, 536.5)  # 50 × (0.16575 + 0.14055 × 0.5365) ms = 12.05 ms
    assert one_side == pytest.approx(0.0120542, abs=1e-6)
    assert t[W0].decode_in_s == t[W0].decode_out_s == pytest.approx(one_side)  # r slowed by x, x slowed by r
    assert t[W1].decode_co_s == 0.0
    # interference: r's prefill stalls 1 decoder by PT(512, 0) − PT(0, 0) = 22.96 ms
    assert t[W0].interference_s == pytest.approx(0.0311979 - 0.0082374, abs=1e-7)
    assert t[W1].interference_s == 0.0


def test_queued_requests_count_as_co_runners_with_their_prediction() -> None:
    p, fleet = policy()
    dispatch(p, fleet, req("x", 512, predicted=20), W0)  # queued, not in the map: 20 iterations, context 512
    t = terms(p, fleet, req("r", 512, predicted=50))
    # m = 20: x's context 512 + 9.5, r's 512 + 9.5
    assert t[W0].decode_co_s == pytest.approx(2 * COST.decode_marginal_s(20, 521.5))


@pytest.mark.parametrize("overflow_wait", [True, False])
def test_overflow_term_prices_the_tokens_above_t_mem(overflow_wait: bool) -> None:
    # 100 blocks = 1600 tokens; T_mem × capacity = 1280 (PreServe's T_mem; the default is 0.9)
    p, fleet = policy(kv_capacity_blocks=100, overflow_wait=overflow_wait, t_mem=0.8)
    dispatch(p, fleet, req("x", 1024, predicted=200), W0, running=True)
    t = terms(p, fleet, req("r", 256, predicted=50))
    # peak over j < 100 of (1024 + j) + (256 + j)[j < 50]: j = 49 → 1073 + 305 = 1378 → U_k = 0.86125
    assert t[W0].peak_frac == pytest.approx(1378 / 1600)
    # (1378 − 1280) = 98 tokens over, priced as 98 / 1024 requests of the mean context 1024 re-prefilled
    reprefill = 98 / 1024 * COST.prefill_s(1024, 0)
    # and their wait for KV: U' − 1280 = 2j for 0 < j < 50 (x alone stays under 1280 after r's 50), an area of
    # 2 × (1 + ... + 49) = 2450 token-iterations = 2450 / 1024 request-iterations of x's 1-request batch
    wait = 2450 / 1024 * COST.decode_s(1, 1024) if overflow_wait else 0.0
    assert t[W0].overflow_s == pytest.approx(reprefill + wait)
    assert t[W1].overflow_s == 0.0 and t[W1].peak_frac == pytest.approx(305 / 1600)


def test_kv_wait_term_counts_iterations_until_the_prompt_fits() -> None:
    p, fleet = policy(kv_capacity_blocks=100)
    dispatch(p, fleet, req("x", 1500, predicted=30), W0, running=True)
    t = terms(p, fleet, req("r", 256, predicted=50))
    # 1500 + j + 256 > 1600 while x runs (j < 30); x is done at j = 30: 30 iterations of x's batch
    assert t[W0].kv_wait_s == pytest.approx(30 * COST.decode_s(1, 1500))
    assert t[W1].kv_wait_s == 0.0


def test_occupancy_adds_each_queued_request_over_its_own_offsets() -> None:
    """U'[j] = the map + Σ over queued x with j < D_x of (P_x + j): the segment updates match the sum offset by
    offset (ties of D, D beyond the horizon, zero prompts)."""
    import random

    from switchyard.ext.anticipator import Anticipator

    rng = random.Random(5)
    for _ in range(300):
        ant = Anticipator(10**6, max_len=rng.choice([8, 64, 4096]))
        for i in range(rng.randint(0, 4)):
            ant.add(f"x{i}", rng.randint(0, 3000), rng.randint(1, 200))
        ant.advance_to(rng.randint(0, 30))
        queued = [(rng.choice([0, rng.randint(1, 3000)]), rng.choice([1, 2, 50, 150])) for _ in range(rng.randint(0, 6))]
        h = rng.choice([1, 10, 100, 200])
        want = ant.load_tokens(h)
        for px, dx in queued:
            for j in range(min(dx, len(want))):
                want[j] += px + j
        assert Switchyard.occupancy(ant, queued, h) == want


def test_memory_terms_without_queued_requests_match_the_walk_over_the_occupancy() -> None:
    """`memory_s` with nothing queued reads the map's virtual peak and skips U' when O and W are 0 (NOTE in it):
    the same (O, W, U_k) floats as the general path, forced here by a queued (P=0, D=1) that adds 0 to U'."""
    import random

    from switchyard.ext.anticipator import Anticipator

    rng = random.Random(9)
    for _ in range(2000):
        p = Switchyard(SwitchyardConfig(t_mem=rng.choice([0.1, 0.5, 0.8, 1.0]), horizon=rng.choice([1, 50, 100])))
        cap = rng.choice([97, 1000, 1600, 16_000])
        ant = Anticipator(cap, max_len=rng.choice([64, 4096]))
        for i in range(rng.randint(0, 3)):
            ant.add(f"x{i}", rng.randint(0, cap // 2), rng.randint(1, 120))
        ant.advance_to(rng.randint(0, 20))
        prompt = rng.choice([0, 1, rng.randint(0, cap), int(p.sy.t_mem * cap) - rng.randint(0, 3)])
        d = rng.randint(1, 150)
        fast = p.memory_s(ant, [], max(0, prompt), d, COST)
        assert fast == p.memory_s(ant, [(0, 1)], max(0, prompt), d, COST)


def test_terms_against_a_beat_are_dropped_only_when_the_total_loses() -> None:
    """With `beat`, a worker is dropped (None) before M, or before M, O and W, only when its whole cost exceeds the
    beat; otherwise its terms are the ones priced without a beat."""
    p, fleet = policy(kv_capacity_blocks=100)
    ctx = _loaded(p, fleet)
    m = p.tree.match(ctx.block_hashes)
    d = p.predicted_tokens(ctx)
    for w in fleet.routable(ctx.model):
        cb = p._cached_blocks(w.worker_id, m, ctx.block_hashes)
        full = p.terms(w, ctx, cb, m.path, d, NOW)
        assert full is not None
        for beat in (0.0, full.total_s / 2, full.total_s - full.evict_s, full.total_s - 1e-9, full.total_s, 2 * full.total_s):
            got = p.terms(w, ctx, cb, m.path, d, NOW, beat)
            assert got == full if got is not None else full.total_s > beat


def test_shared_prefix_is_not_counted_twice_in_the_map() -> None:
    # two 1024-token prompts sharing 992 tokens on a 1600-token worker: without the discount the map would hold
    # 2 × 1024 > capacity; with it, r's private KV is 1024 − 992 = 32 tokens
    p, fleet = policy(kv_capacity_blocks=100)
    dispatch(p, fleet, req("x", 1024, shared=992, predicted=200), W0, running=True)
    t = terms(p, fleet, req("r", 1024, shared=992, predicted=50))
    assert t[W0].peak_frac == pytest.approx((1024 + 49 + 32 + 49) / 1600)
    p2, fleet2 = policy(kv_capacity_blocks=100, discount_shared_prefix=False)
    dispatch(p2, fleet2, req("x", 1024, shared=992, predicted=200), W0, running=True)
    t2 = terms(p2, fleet2, req("r", 1024, shared=992, predicted=50))
    assert t2[W0].peak_frac == pytest.approx((1024 + 49 + 1024 + 49) / 1600)
    assert t2[W0].kv_wait_s > 0.0 == t[W0].kv_wait_s
    # a request dispatched where its prefix is held queues only its private prompt for the map
    dispatch(p, fleet, req("y", 1024, shared=992, predicted=50), W0)
    dispatch(p2, fleet2, req("y", 1024, shared=992, predicted=50), W0)
    assert (p.tracker.queued_prefill_tokens(W0), p2.tracker.queued_prefill_tokens(W0)) == (32, 1024)


# ---------------------------------------------------------------------------------------------- ablations
LAM = SwitchyardConfig().externality_weight  # λ: others' seconds are worth λ of r's own
DROPPED = {
    "switchyard-no_queue": lambda t: t.queue_s,
    "switchyard-no_prefix": lambda t: t.prefill_s + LAM * t.evict_s,
    "switchyard-no_evict": lambda t: LAM * t.evict_s,
    "switchyard-no_decode": lambda t: t.decode_self_s + t.decode_in_s + LAM * t.decode_out_s,
    "switchyard-no_interference": lambda t: LAM * t.interference_s,
    "switchyard-no_behind": lambda t: LAM * t.behind_s,
    "switchyard-no_overflow": lambda t: t.overflow_s,
    "switchyard-no_kv_wait": lambda t: t.kv_wait_s,
}


def _loaded(p: Switchyard, fleet: Fleet) -> RoutingContext:
    """A 100-block fleet where every term is live on w0: a's 32 blocks cached (LRU's first victims), x running
    with 62 blocks resident (94 of 100 used: r's 32 missed blocks evict 26), q queued, r's prompt does not fit
    beside x (1000 + 512 > 1600 - 96 ... x frees its KV after 40 iterations)."""
    a, x = req("a", 512), req("x", 1000, predicted=40)
    holder(p, fleet, a, W0)
    p.on_kv_events(W0, _stored(a))
    dispatch(p, fleet, x, W0, running=True)
    p.on_kv_events(W0, _stored(x, 2))
    dispatch(p, fleet, req("q", 256, predicted=40), W0)
    return req("r", 512, predicted=50)


@pytest.mark.parametrize("name", sorted(DROPPED))
def test_each_ablation_drops_exactly_its_term(name: str) -> None:
    base, fleet = policy(kv_capacity_blocks=100)
    ctx = _loaded(base, fleet)
    full = terms(base, fleet, ctx)[W0]
    assert (
        min(
            full.queue_s,
            full.prefill_s,
            full.evict_s,
            full.decode_co_s,
            full.interference_s,
            full.behind_s,
            full.overflow_s,
            full.kv_wait_s,
        )
        > 0
    )  # every term is live in this fleet
    variant = POLICIES[name]()
    assert isinstance(variant, Switchyard) and variant.name == name
    fleet_v = make_fleet(2, kv_capacity_blocks=100)
    _loaded(variant, fleet_v)
    cut = terms(variant, fleet_v, ctx)[W0]
    assert cut._replace(total_s=0.0) == full._replace(total_s=0.0)  # same terms
    assert cut.total_s == pytest.approx(full.total_s - DROPPED[name](full))


def test_total_is_own_latency_plus_weighted_externalities() -> None:
    p, fleet = policy(kv_capacity_blocks=100)
    t = terms(p, fleet, _loaded(p, fleet))[W0]
    own = t.queue_s + t.prefill_s + t.decode_self_s + t.decode_in_s + t.kv_wait_s
    others = LAM * (t.evict_s + t.decode_out_s + t.interference_s + t.behind_s) + t.overflow_s  # M: others' too
    assert t.evict_s > 0 and t.total_s == pytest.approx(own + others)
    assert LAM == 0.1


@pytest.mark.parametrize("placement", ["argmin", "e2"])
def test_e2_skew_passes_and_l_run_only_where_they_steer(placement: str) -> None:
    """Under "argmin" nothing reads E2's redirects, replicas or history L (load_signal "outstanding"), so no
    replication sample is kept and L is never priced; under "e2" the exploit set reads them. (The passes and
    the pricing were ~60% of the default policy's tick time; `bench sim` results are unchanged without them.)"""
    p, fleet = policy(placement=placement)
    for i in range(3):
        dispatch(p, fleet, req(f"r{i}", shared=256), WorkerId("w0"), running=True, now=float(i))
        p.on_finish(f"r{i}", WorkerId("w0"), i + 0.5, 10)
        p.on_tick(i + 0.6)
    steer = placement == "e2"
    assert bool(p._load_memo) == bool(p.history) == steer  # L priced by the hooks and ticks, and its window H
    assert not p.hit_ratio  # DECODERATIO's window: P/D balancing is off (the interference term I prices it)
    assert bool(p.key_of(req("r0", shared=256).block_hashes).stats.ttft) == steer  # replication's detector
    assert p.counters() == ({"rebalance_redirects": 0, "replications": 0} if steer else {}) | {"prefix_spills": 0}


def test_ablation_registry() -> None:
    assert set(ABLATIONS) == set(DROPPED) | {"switchyard-e2_split", "switchyard-no_mirror", "switchyard-no_fill"}
    assert all(POLICIES[k] is v for k, v in ABLATIONS.items())
    assert make_policy("switchyard").name == "switchyard"
    split = make_policy("switchyard-e2_split")
    assert isinstance(split, Switchyard) and split.sy.placement == "e2"
    # E2's redirects and replicas are reported only where they steer requests
    assert make_policy("switchyard").counters() == {"prefix_spills": 0}
    assert split.counters() == {"rebalance_redirects": 0, "replications": 0, "prefix_spills": 0}


# ---------------------------------------------------------------------------------------------- decisions
@pytest.mark.parametrize("placement", ["argmin", "e2"])
def test_cache_holder_wins_when_load_is_equal(placement: str) -> None:
    p, fleet = policy(placement=placement)
    holder(p, fleet, req("a", 512, shared=448), W1)
    d = p.select(req("r", 512, shared=448), fleet, NOW)
    assert d is not None and d.worker_id == W1  # R: PT(64, 448) vs PT(512, 0) on w0


def test_large_anticipated_decode_load_loses_a_long_request() -> None:
    # w0 holds 1984 of r's 2048 tokens but has 4 long decodes ahead; w1 is idle and holds nothing
    p, fleet = policy(interference_weight=0.0)
    holder(p, fleet, req("a", 2048, shared=1984), W0)
    for i in range(4):
        dispatch(p, fleet, req(f"x{i}", 512, predicted=2000), W0, running=True)
    long_req = req("r", 2048, shared=1984, predicted=1000)
    t = terms(p, fleet, long_req)
    # w1 pays 0.124 − 0.025 = 0.1 s more prefill; w0's co-residency: 4 × 1000 shared iterations both ways
    assert t[W1].prefill_s - t[W0].prefill_s == pytest.approx(0.1243109 - 0.0246766, abs=1e-6)
    assert t[W0].decode_co_s > 1.0 > t[W1].decode_co_s == 0.0
    assert p.select(long_req, fleet, NOW).worker_id == W1
    # without the decode term the prefix wins
    p2, fleet2 = policy(interference_weight=0.0, decode_weight=0.0)
    holder(p2, fleet2, req("a", 2048, shared=1984), W0)
    for i in range(4):
        dispatch(p2, fleet2, req(f"x{i}", 512, predicted=2000), W0, running=True)
    assert p2.select(long_req, fleet2, NOW).worker_id == W0


def test_overflow_makes_a_worker_over_t_mem_lose() -> None:
    # both workers run one request; w0's is large (peak 0.86 > T_mem = 0.8 with r), w1's small; w0 holds 320 of
    # r's 400 tokens, so without the overflow term w0 is cheaper (PT(80, 320) < PT(400, 0), both below the knee)
    def setup(**cfg: object) -> tuple[Switchyard, Fleet]:
        p, fleet = policy(
            kv_capacity_blocks=100, queue_weight=0.0, decode_weight=0.0, interference_weight=0.0, t_mem=0.8, **cfg
        )
        holder(p, fleet, req("a", 400, shared=320), W0)
        dispatch(p, fleet, req("x", 1200, predicted=200), W0, running=True)
        dispatch(p, fleet, req("y", 64, predicted=200), W1, running=True)
        return p, fleet

    ctx = req("r", 400, shared=320, predicted=50)
    p, fleet = setup(overflow_wait=False)  # the re-prefill alone already decides it
    t = terms(p, fleet, ctx)
    # w0: (1200 + 49) + (80 private + 49) = 1378 tokens at j = 49 → 98 over 1280; w1: 64 + 49 + 400 + 49 = 562
    assert (t[W0].peak_frac, t[W1].peak_frac) == (pytest.approx(1378 / 1600), pytest.approx(562 / 1600))
    assert t[W0].overflow_s == pytest.approx(98 / 1200 * COST.prefill_s(1200, 0))
    assert t[W0].overflow_s > t[W1].prefill_s - t[W0].prefill_s > 0  # the penalty outweighs the cached prefix
    assert p.select(ctx, fleet, NOW).worker_id == W1
    pw, fleetw = setup()  # with the victims' wait (default) O only grows
    assert terms(pw, fleetw, ctx)[W0].overflow_s > t[W0].overflow_s
    assert pw.select(ctx, fleetw, NOW).worker_id == W1
    p0, fleet0 = setup(overflow_weight=0.0)
    assert p0.select(ctx, fleet0, NOW).worker_id == W0


def test_decision_reason_carries_the_figures_only_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    p, fleet = policy()
    assert p.select(req("a"), fleet, NOW).reason == "argmin"  # type: ignore[union-attr]
    caplog.set_level(logging.DEBUG, logger="switchyard.router.policies.switchyard_policy")
    d = p.select(req("b"), fleet, NOW)
    assert d is not None and d.reason.startswith("argmin cost=") and " R=" in d.reason and " peak=" in d.reason


def test_select_does_not_mutate_state() -> None:
    p, fleet = policy(kv_capacity_blocks=100)
    ctx = _loaded(p, fleet)
    probe = req("probe", 300, predicted=80)
    before = (
        terms(p, fleet, probe),
        {w: p.tracker.anticipator(w).load_tokens(100) for w in (W0, W1)},
        p.outstanding[W0].queued_s,
        len(p.reqs),
        p.tree.match(ctx.block_hashes).matched_blocks,
        p._turn,
    )
    d1 = p.select(ctx, fleet, NOW)
    d2 = p.select(ctx, fleet, NOW)
    after = (
        terms(p, fleet, probe),
        {w: p.tracker.anticipator(w).load_tokens(100) for w in (W0, W1)},
        p.outstanding[W0].queued_s,
        len(p.reqs),
        p.tree.match(ctx.block_hashes).matched_blocks,
        p._turn,
    )
    assert d1 == d2
    assert before == after


def test_unknown_length_uses_the_fallback_and_returns_it() -> None:
    p, fleet = policy()
    d = p.select(req("r0", 512, predicted=None), fleet, NOW)
    assert d is not None and d.predicted_output_tokens == 256  # LengthFallback's prior
    p.on_dispatch(req("r0", 512, predicted=None), d, NOW)
    p.on_first_token("r0", d.worker_id, NOW)
    p.on_finish("r0", d.worker_id, NOW, 40)
    # one observation in r0's bucket (weight 1 of 3): round(1/3 × 40 + 2/3 × 256) = 184
    assert p.select(req("r1", 512, predicted=None), fleet, NOW).predicted_output_tokens == 184
    assert p.select(req("r2", 512, predicted=77), fleet, NOW).predicted_output_tokens == 77


def test_finish_and_abort_release_the_anticipated_load() -> None:
    p, fleet = policy()
    dispatch(p, fleet, req("x", 512, predicted=100), W0, running=True)
    dispatch(p, fleet, req("y", 512, predicted=100), W0)
    assert terms(p, fleet, req("r"))[W0].decode_co_s > 0
    p.on_finish("x", W0, NOW, 100)
    p.on_abort("y", W0, NOW)
    t = terms(p, fleet, req("r"))[W0]
    assert t.decode_co_s == t.queue_s == t.interference_s == 0.0
    assert not p.reqs and p.tracker.remaining_decode_tokens(W0) == 0


def _own_view(p: Switchyard, w: WorkerId, ant: Any) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """w's batch as the policy's own records of its requests describe it (`reqs`): the ones past their first
    token (not in `queued[w]`) with decode left in the map, each with its whole prompt as context; the rest
    queued, in `queued[w]`'s order."""
    running, queued = [], []
    waiting = p.queued.get(w, {})
    mine = {rid: rq for rid, rq in p.reqs.items() if rq.worker == w}
    assert all(mine.get(rid) is rq for rid, rq in waiting.items())  # queued[w] holds only w's requests
    for rid, rq in mine.items():
        if rid not in waiting:
            _, start, _, end = ant.record(rid)  # KeyError: a running request missing from the map
            if end > ant.iteration:
                running.append((end - ant.iteration, rq.prompt_tokens + ant.iteration - start))
    queued = [(rq.prompt_tokens, rq.kv_prompt_tokens, rq.predicted_tokens) for rq in waiting.values()]
    assert len(ant) == len(mine) - len(waiting)  # no record of another request
    return sorted(running), queued


def test_batch_is_the_policys_requests_through_every_hook() -> None:
    """The batch `terms` prices and the fill level reads (the map's records and `queued`) is the one the policy's
    own records of its requests describe, after each hook: dispatch, first token (twice), a retry on another
    worker, a finish from the stale attempt, an abort, and finishes; and the fill level's D_in is its D_in."""
    p, fleet = policy()
    seen = []

    def check() -> None:
        for w in (W0, W1):
            ant = p.tracker.sync(fleet.get(w), NOW)
            running, queued = p.batch(w, ant)
            assert (sorted(running), queued) == _own_view(p, w, ant)
            got = ant.decode_in(p.queued.get(w, {}), 80, COST)
            assert got == e2_select_py.decode_in(running, queued, 0, 80, COST)
            seen.append(got)

    dispatch(p, fleet, req("a", 700, shared=512, predicted=120), W0)
    dispatch(p, fleet, req("b", 300, predicted=40), W0)
    check()
    p.on_first_token("a", W0, NOW)
    p.on_first_token("a", W0, NOW)  # a duplicate: no change
    check()
    retry = dataclasses.replace(req("b", 300, predicted=40), attempt=1)
    dispatch(p, fleet, retry, W1, running=True)
    p.on_finish("b", W0, NOW, 40)  # the stale attempt's finish: ignored
    check()
    dispatch(p, fleet, req("c", 900, predicted=60), W1)
    p.on_abort("c", W1, NOW)
    check()
    p.on_finish("a", W0, NOW, 120)
    p.on_finish("b", W1, NOW, 40)
    check()
    # w0 queued, then running a; w1 nothing, then the retry running; both empty at the end
    assert [x > 0 for x in seen] == [True, False, True, False, True, True, True, True, False, False]
    assert not p.queued.get(W0) and not p.queued.get(W1)


def test_runs_in_the_simulator() -> None:
    trace = make_workload(
        WorkloadSpec(
            arrival="poisson",
            rate=20.0,
            num_requests=60,
            prompt_len="400",
            output_len="8",
            prefix_groups=3,
            prefix_len=320,
        ),
        seed=1,
    )
    res = Simulator(trace, SimConfig(policy="switchyard", num_workers=2, predictor="oracle")).run()
    assert all(r.status == "ok" and r.finish_s > 0 for r in res.records)
    hits = sum(s.prefix_cache_hits for s in res.engine_stats)
    queries = sum(s.prefix_cache_queries for s in res.engine_stats)
    assert hits / queries > 0.6  # 320 of 400 tokens shared by 3 groups: the holders keep their groups


def _stored(ctx: RoutingContext, seq: int = 1):  # noqa: ANN202 - KvEventBatch
    from switchyard.workers.engine.kv_events import BlockStored, KvEventBatch

    n = len(ctx.block_hashes)
    return KvEventBatch(seq, NOW, (BlockStored(ctx.block_hashes, None, ctx.prompt_token_ids[: n * 16], 16),))


MIXED_70B = "llama2-70b-h100-tp4:3,llama2-70b-a100-tp4:3"


@pytest.mark.parametrize(
    ("prefix_groups", "predictor", "rate", "kv_blocks", "profile"),
    [(4, "oracle", 60.0, None, None), (0, "oracle", 60.0, None, None), (4, "fallback", 60.0, None, None),
     (8, "oracle", 10.0, None, None), (8, "oracle", 10.0, 600, None), (4, "oracle", 30.0, None, MIXED_70B)],
    ids=["prefix", "no_prefix", "fallback", "tool_calls", "tool_calls_small_kv", "mixed_fleet"],
)
def test_pruned_select_picks_what_pricing_every_worker_picks(
    prefix_groups: int, predictor: str, rate: float, kv_blocks: int | None, profile: str | None
) -> None:
    """Branch and bound is exact: a 6-worker run routes every request as the unpruned reference does (with
    small KV caches, M is priced, and skipped where the rest of the cost already loses; on a mixed fleet, where
    the bounds are lifted by the least D_in the fill level gives any worker)."""
    tools = rate < 20  # toolbench-like: long shared prompts, short answers
    trace = make_workload(
        WorkloadSpec(
            arrival="poisson",
            rate=rate,
            num_requests=300,
            prompt_len="lognormal:2000:0.3" if tools else "lognormal:600:0.6",
            output_len="lognormal:30:0.5" if tools else "lognormal:120:0.8",
            prefix_groups=prefix_groups,
            prefix_len=(1600 if tools else 400) if prefix_groups else 0,
        ),
        seed=3,
    )
    picks = {}
    priced = {}
    evictions = {}
    for prune in (True, False):
        pol = Switchyard(SwitchyardConfig(prune=prune))
        calls = 0
        terms_fn = pol.terms
        evict_s = pol._evict_s
        m_priced = m_skipped = 0

        def counting(*a, _f=terms_fn, **k):  # noqa: ANN002, ANN003, ANN202
            nonlocal calls, m_skipped
            calls += 1
            t = _f(*a, **k)
            m_skipped += t is None
            return t

        def counting_m(*a, _f=evict_s, **k):  # noqa: ANN002, ANN003, ANN202
            nonlocal m_priced
            m_priced += 1
            return _f(*a, **k)

        pol.terms = counting  # type: ignore[method-assign]
        pol._evict_s = counting_m  # type: ignore[method-assign]
        overrides = {"num_kv_blocks": kv_blocks} if kv_blocks else {}
        cfg = SimConfig(policy="switchyard", num_workers=6, predictor=predictor, engine_overrides=overrides,
                        **({"profile": profile} if profile else {}))
        res = Simulator(trace, cfg, policy=pol).run()
        picks[prune] = [(r.request_id, r.worker_id) for r in res.records]
        priced[prune] = calls
        evictions[prune] = (m_priced, m_skipped)
    assert picks[True] == picks[False]
    if kv_blocks:  # M was priced, and skipped where the rest of the cost already lost
        assert evictions[True][0] > 0 and evictions[True][1] > 0 and evictions[False][1] == 0
    assert priced[False] == 6 * len(trace.requests)
    assert priced[True] < priced[False]
    if tools:  # the point of it: where misses are dear, the bounds (R above all) cut most of the pricing
        assert priced[True] < priced[False] / 2


def test_lower_bounds_price_cached_tokens_not_blocks() -> None:
    """Two workers of one profile holding the same number of blocks of different sizes cache different token
    counts: each bound prices its own R (a memo keyed on blocks alone gave both the first one's)."""
    fleet = Fleet()
    for i, bs in enumerate((16, 32)):
        fleet.add_worker(make_worker_info(i, "m", 4096, bs, 1000, 8), state=WorkerState.READY, healthy=True)
    pol = Switchyard()
    ctx = req("mixed", prompt_len=512)
    pool = fleet.routable(ctx.model)
    pol.select(ctx, fleet, NOW)
    bounds = pol.lower_bounds(pool, ctx, {W0: 8, W1: 8}, 50)
    d_self = COST.decode_s(50, 512 + 49 / 2)
    assert bounds[0] == pytest.approx(COST.prefill_s(512 - 128, 128) + d_self)
    assert bounds[1] == pytest.approx(COST.prefill_s(512 - 256, 256) + d_self)


def _bound_from_terms(pol: Switchyard, w: WorkerView, ctx: RoutingContext, cached_blocks: int, d: int) -> float:
    """A worker's lower bound composed from the default policy's terms, as the reference defines them (what the
    bound pass must equal)."""
    cfg = pol.sy
    wid = w.worker_id
    p = ctx.num_prompt_tokens
    cost = pol.cost_model(wid)
    missed = Switchyard.missed_tokens(w, cached_blocks, p)
    r = cost.prefill_s(missed, p - missed)
    d_self = cost.decode_s(d, p + (d - 1) / 2)
    o = pol.outstanding.get(wid)
    t = max(0, o.queued_tokens) if o is not None else 0
    q = (pol.queue_s(wid) if cfg.queue_pricing == "sum"
         else e2_select_py.queued_prefill(pol._argmin_env, w, cost, t, missed)[0] if t else 0.0)
    nq = len(pol.queued.get(wid, {}))
    interference = nq * e2_select_py.step_gain(pol._argmin_env, w, cost, o, r, missed) if nq else 0.0
    return (cfg.queue_weight * q + cfg.prefix_weight * r + cfg.decode_weight * d_self
            + cfg.interference_weight * cfg.externality_weight * interference)


def _head_from_terms(
    pol: Switchyard, w: WorkerView, ctx: RoutingContext, cached_blocks: int, batch: tuple[list, list],  # type: ignore[type-arg]
    d: int, bounds: tuple[float, float, float], arrivals: float, rho: float, span: float | None,
) -> tuple[float | int, ...]:
    """A worker's terms before M, O and W and their weighted sums, composed from the reference's parts with the
    policy's configuration (what `head_terms` must equal)."""
    cfg = pol.sy
    env = pol._argmin_env
    lam = cfg.externality_weight
    p = ctx.num_prompt_tokens
    wid = w.worker_id
    cost = pol.cost_model(wid)
    running, queued = batch
    load, r, q = bounds
    missed = Switchyard.missed_tokens(w, cached_blocks, p)
    o = pol.outstanding.get(wid)
    queue = q
    if cfg.queue_pricing != "sum":
        t = max(0, o.queued_tokens) if o is not None else 0
        queue, k = e2_select_py.queued_prefill(env, w, cost, t, missed) if t else (0.0, 0)
        if running or queued:  # every iteration until r's first token carries w's decoders; r waits 1.5 of them
            n = len(running) + len(queued)
            ctx_tokens = sum(c for _, c in running) + sum(px for px, _, _ in queued)
            queue += (k + 1.5) * cost.decode_marginal_s(n, ctx_tokens / n)
    d_self = cost.decode_s(d, p + (d - 1) / 2)
    in_run, out_run = e2_select_py.co_residency(running, p, d, cost)
    in_q, out_q = e2_select_py.co_residency([(dx, px) for px, _, dx in queued], p, d, cost)
    d_in, d_out = in_run + in_q, out_run + out_q
    gain = e2_select_py.step_gain(env, w, cost, o, r, missed)
    interference = (len(running) + len(queued)) * gain
    behind = arrivals * e2_select_py.busy_period(queue + r, rho, span, cfg.arrival_window_s) * gain
    return (queue, d_self, d_in, d_out, interference, behind, missed,
            load + cfg.queue_weight * queue + cfg.prefix_weight * r,
            cfg.decode_weight * (d_self + d_in + lam * d_out),
            lam * (cfg.interference_weight * interference + cfg.behind_weight * behind))


@pytest.mark.parametrize("overrides", [{}, {"joint_prefill": False}, {"queue_pricing": "sum"}],
                         ids=["default", "no_joint", "sum"])
def test_bound_pass_equals_the_terms_it_bounds(overrides: dict) -> None:  # type: ignore[type-arg]
    """The bound pass (`ext/e2_select.argmin_bounds`, in Cython) gives, float for float, the sum of the policy's own
    term methods (R, D_self, Q's prefill part, I over the queued requests) on the states of a loaded run, every
    bound is at most the worker's full cost, the select's order is the bounds sorted with E2's rotation, and the
    per-worker terms' kernel (`ext/e2_select.head_terms`, in Cython, and its reference) gives, float for float,
    what the term methods it inlines compose to (Q, D_self, D_co, I, B and their weighted sums), whose D_in is the
    fill level's (`Anticipator.decode_in` over the map and the queued requests: the hooks keep them in lockstep)."""
    seen = {"queued_tokens": 0, "queued_requests": 0, "selects": 0, "batch": 0, "busy": 0}

    class Checked(Switchyard):
        def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
            pool = self.pool(ctx, fleet)
            if pool:
                self._remember(fleet, pool, ctx.model)
                cached, _, path = self.prefix(ctx, pool)
                d = self.predicted_tokens(ctx)
                got = self.lower_bounds(pool, ctx, cached, d)
                assert got == [_bound_from_terms(self, w, ctx, cached[w.worker_id], d) for w in pool]
                assert got == e2_select_py.argmin_bounds(self._argmin_env, pool, cached, ctx.num_prompt_tokens, d)
                ants = self.tracker.sync_all(pool, now)
                arrivals = self.arrival_rate(ctx.model).rate(now) / len(pool)
                for w, ant, bound in zip(pool, ants, got, strict=True):
                    t = self.terms(w, ctx, cached[w.worker_id], path, d, now, None, ant)
                    assert t is not None and bound <= t.total_s + 1e-9 * max(1.0, t.total_s)
                    # the per-worker terms' kernel gives the floats of the term methods it inlines
                    wid, cb = w.worker_id, cached[w.worker_id]
                    batch = self.batch(wid, ant)
                    load, r, q, _ = raw_bounds(self._bounds_env, (w,), {wid: cb}, ctx.num_prompt_tokens, now)[0]
                    wb = self.busy.get(wid)
                    rho, span = wb.load(now) if wb is not None else (0.0, None)
                    args = (ctx.num_prompt_tokens, d, cb, load, r, q, arrivals, rho, span)
                    head = head_terms(self._argmin_env, w, self.cost_model(wid), *batch, *args)
                    assert head == _head_from_terms(self, w, ctx, cb, batch, d, (load, r, q), arrivals, rho, span)
                    assert head == e2_select_py.head_terms(self._argmin_env, w, self.cost_model(wid), *batch, *args)
                    # the fill level's D_in (the map's records and the queued requests) is the D_in priced here,
                    # and that batch is the one the policy's own records of its requests describe
                    assert ant.decode_in(self.queued.get(wid, {}), d, self.cost_model(wid)) == head[2]
                    assert (sorted(batch[0]), batch[1]) == _own_view(self, wid, ant)
                    seen["batch"] += bool(batch[0]) and bool(batch[1])
                    seen["busy"] += rho > 0.0 and arrivals > 0.0
                n, turn = len(pool), self._turn
                assert argmin_order(self._argmin_env, pool, cached, ctx.num_prompt_tokens, d, turn) == sorted(
                    zip(got, [(i - turn) % n for i in range(n)], range(n), strict=True))
                seen["selects"] += 1
                seen["queued_tokens"] += sum(1 for w in pool if (o := self.outstanding.get(w.worker_id)) is not None
                                             and o.queued_tokens > 0)
                seen["queued_requests"] += sum(1 for w in pool if bool(self.queued.get(w.worker_id)))
            return super().select(ctx, fleet, now)

    trace = make_workload(
        WorkloadSpec(arrival="poisson", rate=40.0, num_requests=200, prompt_len="lognormal:1500:0.5",
                     output_len="lognormal:60:0.6", prefix_groups=4, prefix_len=800),
        seed=5,
    )
    pol = Checked(SwitchyardConfig(**overrides))
    res = Simulator(trace, SimConfig(policy="switchyard", num_workers=4, predictor="oracle"), policy=pol).run()
    assert len(res.records) == 200
    assert all(seen.values()), seen


# ---------------------------------------------------------------------------------------------- arrivals behind
def _step(p: Switchyard, w: WorkerView, r: float, missed: int) -> float:
    """r's step gain on w (`e2_select_py.step_gain`, with the policy's configuration and w's queue)."""
    return e2_select_py.step_gain(p._argmin_env, w, p.cost_model(w.worker_id), p.outstanding.get(w.worker_id), r,
                                  missed)


def test_arrivals_behind_is_the_step_of_every_request_expected_before_rs_first_token() -> None:
    p, fleet = policy(kv_capacity_blocks=100, busy_period=False)
    t = terms(p, fleet, _loaded(p, fleet))[W0]
    rate = p.arrival_rate("m").rate(NOW)
    assert rate == 3.0  # a, x and q over the 1 s since the first of them
    w0 = fleet.get(W0)
    step = _step(p, w0, t.prefill_s, 512)  # r: 512 missed
    assert t.queue_s > 0 and step > 0
    # an even share of the arrivals (2 workers) reaches w0 before r's first token, each delayed one step
    assert t.behind_s == pytest.approx(rate / 2 * (t.queue_s + t.prefill_s) * step)


def test_arrivals_behind_under_prefill_load_count_the_busy_period() -> None:
    """w0's prefill queue was busy half of the 2 s the router has known it (ρ_w0 = 0.5): the requests behind r
    keep arriving until its backlog drains, so B counts the arrivals over the busy period (Q + R) / (1 − ρ), twice
    those before r's first token."""
    p, fleet = policy()
    dispatch(p, fleet, req("a", 2048), W0, now=NOW - 2.0)
    p.on_first_token("a", W0, NOW - 1.0)
    dispatch(p, fleet, req("b", 512), W0)
    assert p.prefill_load(W0, NOW) == 0.5 and p.prefill_load(W1, NOW) == 0.0
    t = terms(p, fleet, req("r", 512))
    w0 = fleet.get(W0)
    step = _step(p, w0, t[W0].prefill_s, 512)
    rate = p.arrival_rate("m").rate(NOW)
    backlog = t[W0].queue_s + t[W0].prefill_s
    assert 0 < backlog / 0.5 < 2.0  # within the 2 s ρ_w0 was measured over
    assert t[W0].behind_s == pytest.approx(rate / 2 * backlog / 0.5 * step)
    w1 = fleet.get(W1)  # idle (ρ = 0): the arrivals before r's first token only
    step1 = _step(p, w1, t[W1].prefill_s, 512)
    assert t[W1].behind_s == pytest.approx(rate / 2 * (t[W1].queue_s + t[W1].prefill_s) * step1)


def test_busy_period_is_the_backlog_over_one_minus_the_load_within_the_window() -> None:
    p, _ = policy()  # arrival_window_s = 10

    def busy_s(backlog_s: float, rho: float, span_s: float | None = None) -> float:
        return e2_select_py.busy_period(backlog_s, rho, span_s, p.sy.arrival_window_s)

    assert busy_s(2.0, 0.0) == 2.0  # idle: the arrivals before r's first token only
    assert busy_s(2.0, 0.5) == pytest.approx(4.0)  # M/G/1: backlog / (1 − ρ)
    assert busy_s(2.0, 0.9) == 10.0  # at most the window the rates are measured over
    assert busy_s(2.0, 1.5) == 10.0  # overloaded: a backlog that does not drain within it
    assert busy_s(12.0, 0.5) == 12.0  # never less than the backlog itself
    # ... and at most the span ρ was measured over, while the window is not full yet: 3 s of a busy queue say
    # nothing of the next 10
    assert busy_s(2.0, 0.9, 3.0) == 3.0 and busy_s(2.0, 0.5, 3.0) == 3.0 and busy_s(1.0, 0.5, 3.0) == 2.0
    assert busy_s(4.0, 0.9, 3.0) == 4.0


def test_a_new_workers_busy_period_reaches_no_further_than_its_measured_span() -> None:
    """w0 was first dispatched to 0.5 s ago and has been busy since (ρ_w0 = 1): B counts the arrivals over those
    0.5 s (or the backlog, if longer), not over the whole 10-s window: the cold start of every cache."""
    p, fleet = policy()
    dispatch(p, fleet, req("a", 2048), W0, now=NOW - 0.5)
    assert p.busy[W0].load(NOW) == (1.0, 0.5)
    t = terms(p, fleet, req("r", 512))[W0]
    w0 = fleet.get(W0)
    step = _step(p, w0, t.prefill_s, 512)
    rate = p.arrival_rate("m").rate(NOW)
    assert t.behind_s == pytest.approx(rate / 2 * max(0.5, t.queue_s + t.prefill_s) * step)


def test_prefill_load_is_the_fraction_of_the_window_a_request_waited_for_its_first_token() -> None:
    """ρ_w: the time w had this router's requests without a first token (its prefill queue busy), over the last
    window (or the time since the router first dispatched there); a finish, abort or retry elsewhere before the
    first token ends the busy time too, and a lost worker starts afresh."""
    p, fleet = policy()
    dispatch(p, fleet, req("a", 512), W0, now=0.0)
    p.on_first_token("a", W0, 1.0)  # busy [0, 1]
    dispatch(p, fleet, req("b", 512), W0, now=3.0)
    p.on_abort("b", W0, 4.0)  # busy [3, 4]
    assert p.prefill_load(W0, 5.0) == pytest.approx(2 / 5)
    assert p.prefill_load(W1, 5.0) == 0.0  # never dispatched to
    assert p.prefill_load(W0, 12.5) == pytest.approx(1 / 10)  # [0, 1] left the 10-s window
    c = req("c", 512)
    dispatch(p, fleet, c, W0, now=12.0)
    dispatch(p, fleet, dataclasses.replace(c, attempt=1), W1, now=12.5)  # its retry: w0 is idle again
    assert p.prefill_load(W0, 13.0) == pytest.approx(1.5 / 10)  # [3, 4] and [12, 12.5]
    assert p.prefill_load(W1, 13.0) == 1.0  # busy since the router first dispatched there
    fleet.remove_worker(W1)
    p.on_worker_change(W1, 13.0)
    assert p.prefill_load(W1, 13.0) == 0.0


@pytest.mark.parametrize(("busy_period", "expected"), [(False, W1), (True, W0)])
def test_a_busy_fleet_keeps_a_follow_up_on_its_prefix_holder(busy_period: bool, expected: WorkerId) -> None:
    """The follow-up test above at a third of the arrivals (4 req/s): counting only those before r's first token,
    B is too small to hold r on w0 and it recomputes the prefix on w1. But w1's prefill queue has been busy 9.5 of
    the last 10 s, so its backlog drains slowly and every request reaching it meanwhile waits for r's recompute:
    with the busy period r stays on w0."""
    p, fleet = policy(busy_period=busy_period)
    rate = p.arrival_rate("m")
    for i in range(34):  # with the 6 dispatches below, 40 arrivals over the last 10 s
        rate.add(NOW - 10.0 + i * 10.0 / 34)
    dispatch(p, fleet, req("e0", 64), W0, running=True, now=NOW - 10.0)  # both known for 10 s
    dispatch(p, fleet, req("e1", 64), W1, running=True, now=NOW - 10.0)
    dispatch(p, fleet, req("o", 2048), W1, now=NOW - 9.5)  # w1's queue busy from here on
    dispatch(p, fleet, req("c1", 2048, shared=2048), W0)
    dispatch(p, fleet, req("h", 2048), W0)
    dispatch(p, fleet, req("h2", 1024), W0)
    assert rate.rate(NOW) == pytest.approx(4.0)
    assert p.prefill_load(W1, NOW) == pytest.approx(0.95) and p.prefill_load(W0, NOW) == 0.0
    follow_up = req("r", 2048 + 64, shared=2048)
    t = terms(p, fleet, follow_up)
    assert t[W1].prefill_s > 4 * t[W0].prefill_s and t[W1].queue_s < t[W0].queue_s
    assert p.counters()["prefix_spills"] == 0
    assert p.select(follow_up, fleet, NOW).worker_id == expected
    # leaving w0, which caches 2,048 of the 2,112 tokens, is a prefix spill (`switchyard_policy_actions_total`)
    assert p.counters()["prefix_spills"] == (1 if expected == W1 else 0)


@pytest.mark.parametrize(("decode_fill", "expected"), [(False, W1), (True, W0)])
def test_arrivals_filling_the_idle_worker_keep_a_follow_up_on_its_holder(
    decode_fill: bool, expected: WorkerId
) -> None:
    """w0 holds 1,984 of r's 2,048 tokens and decodes 6 requests with 400 tokens left; w1 is idle. On the batches
    as they are now, r's 100 tokens are slower on w0 (D_in ~0.15 s) than the 0.1 s of prefix it would recompute on
    w1, so it spills. But 10 requests a second arrive, and while r decodes the router sends them to the lighter
    worker: w1 fills past w0's batch (the fill level L > w0's D_in), so r meets the same co-runners either way,
    and it stays with its prefix."""
    p, fleet = policy(decode_fill=decode_fill)
    rate = p.arrival_rate("m")
    for i in range(93):  # with the 7 dispatches below, 100 arrivals over the last 10 s
        rate.add(NOW - 10.0 + i * 9.0 / 93)
    holder(p, fleet, req("a", 2048, shared=1984), W0)
    for i in range(6):
        dispatch(p, fleet, req(f"x{i}", 512, predicted=400), W0, running=True)
    assert rate.rate(NOW) == pytest.approx(10.0)
    r = req("r", 2048, shared=1984, predicted=100)
    t = terms(p, fleet, r)  # the terms as the batches are now (no level)
    assert t[W0].decode_in_s > t[W1].prefill_s - t[W0].prefill_s > 0.0 == t[W1].decode_in_s
    pool = fleet.routable("m")
    level, floor = fill_level(p._argmin_env, pool, p.tracker.sync_all(pool, NOW), 2048, 100, rate.rate(NOW))
    assert floor > t[W0].decode_in_s
    assert floor == pytest.approx(level - t[W0].decode_self_s)  # one profile: the floor is L less r's D_self
    assert p.select(r, fleet, NOW).worker_id == expected
    assert p.counters()["prefix_spills"] == (1 if expected == W1 else 0)


@pytest.mark.parametrize(("decode_fill", "expected"), [(False, W0), (True, W1)])
def test_on_a_mixed_fleet_the_arrivals_fill_the_faster_worker(decode_fill: bool, expected: WorkerId) -> None:
    """w0 is an H100 (llama2-70b-h100-tp4) decoding 16 requests, w1 an idle A100 (llama2-70b-a100-tp4), 30
    requests a second. As the batches are now, r's 100 tokens decode faster on the H100 even beside its 16
    (D_self + D_in 3.43 s against the A100's 4.37 s alone), so without the fill level r goes there. But the
    arrivals go where their decode is fastest too: the level is of D_self + D_in, poured on the H100 first,
    and at 30 req/s it passes the A100's D_self, so both meet the same decode time, and r's externalities on
    the H100's batch send it to the A100. (A level of D_in alone would have filled the idle A100 first, as if
    it were as fast: the slower workers raised, the fleet's fast ones loaded, the slow ones idle.)"""
    fleet = Fleet()
    fleet.set_time(NOW)
    for i, profile in enumerate(("llama2-70b-h100-tp4", "llama2-70b-a100-tp4")):
        fleet.add_worker(make_worker_info(i, "m", 4096, 16, 20000, 256, profile), state=WorkerState.READY,
                         healthy=True)
    p = Switchyard(SwitchyardConfig(decode_fill=decode_fill))
    rate = p.arrival_rate("m")
    for i in range(284):  # with the 16 dispatches below, 300 arrivals over the last 10 s
        rate.add(NOW - 10.0 + i * 9.0 / 284)
    for i in range(16):
        dispatch(p, fleet, req(f"x{i}", 512, predicted=400), W0, running=True)
    assert rate.rate(NOW) == pytest.approx(30.0)
    r = req("r", 512, predicted=100)
    now = terms(p, fleet, r)  # the terms as the batches are now (no level)
    assert now[W0].decode_self_s + now[W0].decode_in_s < now[W1].decode_self_s and now[W1].decode_in_s == 0.0
    pool = fleet.routable("m")
    level, floor = fill_level(p._argmin_env, pool, p.tracker.sync_all(pool, NOW), 512, 100, rate.rate(NOW))
    assert level > now[W1].decode_self_s and floor == level - now[W1].decode_self_s  # the A100 is the slower
    m = p.tree.match(r.block_hashes)
    filled = {w.worker_id: p.terms(w, r, 0, m.path, 100, NOW, level=level) for w in pool}
    for w in (W0, W1):  # both raised to the level: r meets the same decode time on either
        assert filled[w].decode_self_s + filled[w].decode_in_s == pytest.approx(level)
    assert p.select(r, fleet, NOW).worker_id == expected


def test_arrival_rate_counts_first_attempts_over_its_window() -> None:
    p, fleet = policy()
    assert p.arrival_rate("m").rate(NOW) == 0.0
    a = req("a", 64)
    dispatch(p, fleet, a, W0, now=0.0)
    dispatch(p, fleet, dataclasses.replace(a, attempt=1), W1, now=0.0)  # its retry is not an arrival
    for i in range(3):
        dispatch(p, fleet, req(f"b{i}", 64), W0, now=4.0)
    assert p.arrival_rate("m").rate(4.0) == 4 / 4.0  # the window is not full yet: over the time since the first
    assert p.arrival_rate("m").rate(0.05) == 4 / 0.1  # ... never under MIN_SPAN_S
    assert p.arrival_rate("m").rate(12.0) == 3 / 10.0  # the first one left the 10-s window; reading drops nothing
    assert len(p.arrival_rate("m").own.events) == 4


@pytest.mark.parametrize(("behind_weight", "expected"), [(0.0, W1), (1.0, W0)])
def test_arrivals_behind_keep_a_follow_up_on_the_worker_prefilling_its_prefix(
    behind_weight: float, expected: WorkerId
) -> None:
    """w0 is still prefilling c1 (2,048 tokens) with one more prompt queued; w1 has one queued prompt. c1's
    follow-up waits less on w1 even recomputing the prefix, so without B it spills; but its 2,048-token
    recompute there delays every request that reaches w1 meanwhile (13 arrivals/s over 2 workers), so with B it
    waits for the prefix on w0 and the fleet prefills it once."""
    p, fleet = policy(behind_weight=behind_weight, decode_fill=False)  # B alone (the fill level holds r too)
    dispatch(p, fleet, req("c1", 2048, shared=2048), W0)
    dispatch(p, fleet, req("h", 2048), W0)
    dispatch(p, fleet, req("o", 2048), W1)
    for _ in range(10):
        p.arrival_rate("m").add(NOW - 0.5)
    follow_up = req("r", 2048 + 64, shared=2048)
    t = terms(p, fleet, follow_up)
    assert t[W1].prefill_s > 4 * t[W0].prefill_s and t[W1].queue_s < t[W0].queue_s
    assert p.select(follow_up, fleet, NOW).worker_id == expected


def test_workers_counts_give_the_arrival_rate_from_their_first_sighting() -> None:
    """A worker's first Stats counter is its baseline (requests before this router saw it are not in the window);
    a counter that fell (the worker restarted) counts from 0; a forgotten worker starts a new baseline."""
    fleet = make_fleet(2)
    rate = ArrivalRate(10.0)
    received = {W0: 50, W1: 7}

    def report(t: float) -> None:
        for w, c in received.items():
            fleet.apply_stats(w, StatsSample(num_requests_received=c), t)
        rate.observe(fleet.workers("m"), t)

    report(0.0)
    assert rate.rate(0.0) == 0.0  # baselines only
    received[W0] += 6
    received[W1] += 4
    report(2.0)
    assert rate.rate(2.0) == 10 / 2.0  # the window opened at the first observation
    received[W0] = 3  # w0 restarted and has accepted 3 since
    report(4.0)
    assert rate.rate(4.0) == 13 / 4.0
    rate.forget(W1)
    received[W1] += 100
    report(5.0)  # w1 seen afresh: its counter is a baseline again
    assert rate.rate(5.0) == 13 / 5.0
    assert rate.rate(13.0) == 3 / 10.0  # the 2-s report left the window
    rate.add(12.0)  # this router's own dispatches read alone when they are more
    for _ in range(9):
        rate.add(12.5)
    assert rate.rate(13.0) == 10 / 1.0


@pytest.mark.parametrize(("workers_report", "expected"), [(False, W1), (True, W0)])
def test_arrivals_behind_count_every_replicas_requests_from_the_workers_stats(
    workers_report: bool, expected: WorkerId
) -> None:
    """Two router replicas have split 12 req/s over the same two workers for 10 s: this one dispatched half.
    Then c1's follow-up arrives as in the test above. Read from the workers' Stats counters (every replica's
    requests), the rate is the fleet's, and this replica keeps the follow-up on w0 as one router seeing every
    arrival would; from its own dispatches alone it reads 6 req/s, prices B at half, and spills to w1."""
    p, fleet = policy(decode_fill=False)  # B alone (the fill level holds r on w0 at either rate)
    start = NOW - 10.0
    p.select(req("first", 64), fleet, start)  # the replica's first select: it learns the model's workers
    p.on_tick(start)  # the workers' counters (0) are the baselines
    for i in range(60):
        p.arrival_rate("m").add(start + i / 6)  # this replica's half
    if workers_report:  # the workers accepted both replicas' requests: 60 each
        for w in (W0, W1):
            fleet.apply_stats(w, StatsSample(num_requests_received=60), NOW - 0.1)
    p.on_tick(NOW - 0.1)
    dispatch(p, fleet, req("c1", 2048, shared=2048), W0)
    dispatch(p, fleet, req("h", 2048), W0)
    dispatch(p, fleet, req("o", 2048), W1)
    assert p.arrival_rate("m").rate(NOW) == pytest.approx(12.0 if workers_report else 6.3)
    assert p.select(req("r", 2048 + 64, shared=2048), fleet, NOW).worker_id == expected
