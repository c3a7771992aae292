"""Fast-forward equivalence: step(now, horizon) must give the same tokens, finishes, KV events, timings and final
state as stepping one iteration at a time (seeded random workloads with shared prefixes, block pressure,
preemptions and blocked admissions)."""

from __future__ import annotations

import math
import random

import pytest
from engine_testlib import make_engine, make_request


def _workload(rng: random.Random) -> list[tuple[float, object]]:
    prefixes = [[rng.randrange(3, 500) for _ in range(rng.randrange(0, 40))] for _ in range(3)]
    reqs = []
    t = 0.0
    for i in range(rng.randrange(4, 14)):
        t += rng.expovariate(1 / 0.05)
        prompt = rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randrange(1, 30))]
        kw = {"ignore_eos": rng.random() < 0.5, "priority": rng.randrange(3)}
        if rng.random() < 0.3:
            kw["target_output_tokens"] = rng.randrange(1, 40)
        reqs.append((t, make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 60), arrival_s=t, **kw)))
    return reqs


def _config(rng: random.Random, schedulings: list[str]) -> dict:
    """A small engine: block pressure, preemptions and blocked admissions (the draws' order is the seeds')."""
    cfg = {
        "block_size": rng.choice([1, 2, 4, 16]),
        "max_num_seqs": rng.choice([2, 4, 256]),
        "max_num_batched_tokens": rng.choice([16, 64, 8192]),
        "scheduling": rng.choice(schedulings),
        "lpm_max_queue": rng.choice([1, 128]),  # lpm: sorted admissions, or the queue's order past the limit
        "enable_chunked_prefill": rng.random() < 0.8,
        "max_model_len": 128,
    }
    cfg["num_kv_blocks"] = 1 + max(-(-128 // cfg["block_size"]), rng.choice([8, 20, 60]) * 16 // cfg["block_size"])
    if not cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = 128
    return cfg


def _run(cfg: dict, reqs, fast: bool):
    eng = make_engine(**cfg)
    pending = list(reqs)
    t = 0.0
    tokens: dict[str, list[int]] = {}
    finish: dict[str, object] = {}
    events = []
    boundaries = []
    iters = 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= t:
            eng.add_request(pending.pop(0)[1])
        horizon = pending[0][0] if pending else math.inf
        r = eng.step(t, horizon_s=horizon if fast else None)
        if r is None:
            # None means idle until an arrival (the drivers wait for one): never with requests left and none due
            assert pending, f"the engine stalled with unfinished requests at t={t}"
            t = pending[0][0]
            continue
        iters += r.num_iterations
        for o in r.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finish[o.request_id] = (o.finish_reason, o.num_output_tokens, o.num_cached_tokens)
        events.extend(eng.take_kv_events())
        t = t + r.duration_s
        boundaries.append(t)
    pool = eng.kv_cache_manager.block_pool
    state = (
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        sorted((b.block_id, b.event_hash) for b in pool.iter_cached_blocks()),
        eng.stats(),
    )
    return tokens, finish, events, t, iters, state, boundaries


# 128, 274, 372: priority scheduling where the running request that cannot grow is its own victim, ahead of
# running requests that can (the engine returned None there, and they hung until the next arrival)
@pytest.mark.parametrize("seed", [*range(40), 128, 274, 372])
def test_fast_forward_matches_single_steps(seed: int) -> None:
    rng = random.Random(seed)
    cfg = _config(rng, ["fcfs", "priority", "lpm"])
    reqs = _workload(rng)
    slow = _run(cfg, reqs, fast=False)
    fast = _run(cfg, reqs, fast=True)
    assert fast[0] == slow[0]  # tokens per request
    assert fast[1] == slow[1]  # finishes
    assert fast[2] == slow[2]  # KV events, in order
    assert fast[4] == slow[4]  # iterations
    assert fast[5] == slow[5]  # free queue order, cache contents, stats
    assert fast[3] == pytest.approx(slow[3], rel=0, abs=1e-9)
    # every fast step boundary is one of the single-step boundaries, and there are fewer of them
    assert all(min(abs(b - s) for s in slow[6]) < 1e-9 for b in fast[6])
    assert len(fast[6]) <= len(slow[6])


@pytest.mark.parametrize("seed", range(60))
def test_every_request_ends_once_and_frees_its_blocks(seed: int) -> None:
    """The same seeded workloads under every scheduling, some requests aborted at random times, stepped one
    iteration at a time or fast-forwarded: the engine never idles with work left, every request ends exactly
    once (finished or aborted), and at the end no block is in use."""
    rng = random.Random(seed)
    cfg = _config(rng, ["fcfs", "priority", "lpm", "preble_groups"])
    reqs = _workload(rng)
    aborts = sorted((rng.uniform(0.0, 1.0), r.request_id) for _, r in reqs if rng.random() < 0.3)
    fast = rng.random() < 0.5
    eng = make_engine(**cfg)
    pending = list(reqs)
    ended: dict[str, object] = {}
    t = 0.0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= t:
            eng.add_request(pending.pop(0)[1])
        while aborts and aborts[0][0] <= t:
            rid = aborts.pop(0)[1]
            if eng.abort_request(rid):
                assert rid not in ended
                ended[rid] = "abort"
        r = eng.step(t, horizon_s=(pending[0][0] if pending else math.inf) if fast else None)
        if r is None:  # idle until an arrival; or done, when the aborts just ended the last request
            assert pending or not eng.has_unfinished(), f"the engine stalled with unfinished requests at t={t}"
            if not pending:
                break
            t = pending[0][0]
            continue
        for o in r.outputs:
            if o.finish_reason is not None:
                assert o.request_id not in ended, o.request_id
                ended[o.request_id] = o.finish_reason
        t += r.duration_s
    assert set(ended) == {r.request_id for _, r in reqs}
    assert eng.stats().kv_blocks_used == 0
    assert eng.kv_cache_manager.block_pool.get_num_free_blocks() == cfg["num_kv_blocks"] - 1
