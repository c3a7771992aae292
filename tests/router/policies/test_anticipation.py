"""AnticipationTracker: pending prefills -> the map at first token -> out at finish/abort, and the iteration clock
(Stats anchor, extrapolation over the profile's iteration time or the observed rate, never backwards)."""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_fleet, make_requests, make_stats, make_worker_info

from switchyard.router.fleet import Fleet, StatsSample, WorkerRecord, WorkerState
from switchyard.router.policies.anticipation import AnticipationTracker
from switchyard.router.policies.base import WorkerId
from switchyard.workers.engine.profiles import get_profile

W0 = WorkerId("w0")
PROFILE = "llama3-8b-a100"


def one_worker(perf_profile: str = "") -> tuple[Fleet, WorkerRecord]:
    """One worker with 1000 blocks of 16 = 16,000 KV tokens."""
    fleet = Fleet()
    info = make_worker_info(0, kv_capacity_blocks=1000, block_size=16, perf_profile=perf_profile)
    return fleet, fleet.add_worker(info, state=WorkerState.READY, healthy=True)


def stats(iterations: int) -> StatsSample:
    return dataclasses.replace(make_stats(), num_iterations=iterations)


def test_pending_then_map_then_finish() -> None:
    _, w = one_worker()
    tr = AnticipationTracker()
    ant = tr.sync(w, 0.0)
    assert ant.capacity_tokens == 16_000  # 1000 blocks x 16
    ctx = make_requests(1, prompt_len=32)[0]
    tr.on_dispatch(ctx, W0, 10, 0.0)
    # dispatched: the prompt is queued, the map is still empty (the paper adds after prefill)
    assert tr.queued_prefill_tokens(W0) == 32
    assert tr.pending_decode_tokens(W0) == 10 and tr.num_pending(W0) == 1
    assert tr.remaining_decode_tokens(W0) == 0 and len(ant) == 0
    assert tr.predicted_tokens("r0") == 10
    tr.on_first_token("r0", W0, 0.0)
    # prefill done: in the map from offset 0, holding 32 + j tokens at offset j < 10
    assert tr.queued_prefill_tokens(W0) == 0 and tr.num_pending(W0) == 0
    assert "r0" in ant and tr.remaining_decode_tokens(W0) == 10
    assert ant.load_tokens(12) == [32 + j for j in range(10)] + [0, 0]
    tr.on_first_token("r0", W0, 0.0)  # a repeated first token changes nothing
    assert ant.load_tokens(12) == [32 + j for j in range(10)] + [0, 0]
    tr.on_finish("r0", W0, 0.0)
    assert len(ant) == 0 and ant.load_tokens(12) == [0] * 12
    assert tr.remaining_decode_tokens(W0) == 0 and tr.predicted_tokens("r0") is None


def test_abort_pending_and_running_and_stale_worker() -> None:
    _, w = one_worker()
    tr = AnticipationTracker()
    ant = tr.sync(w, 0.0)
    a, b = make_requests(2, prompt_len=48)
    tr.on_dispatch(a, W0, 20, 0.0)
    tr.on_dispatch(b, W0, 30, 0.0)
    tr.on_first_token("r1", W0, 0.0)
    assert tr.queued_prefill_tokens(W0) == 48 and tr.remaining_decode_tokens(W0) == 30
    tr.on_abort("r0", WorkerId("w9"), 0.0)  # an attempt on another worker: not this one's
    assert tr.queued_prefill_tokens(W0) == 48
    tr.on_abort("r0", W0, 0.0)  # pending: leaves the queue only
    assert tr.queued_prefill_tokens(W0) == 0 and tr.pending_decode_tokens(W0) == 0 and len(ant) == 1
    tr.on_abort("r1", W0, 0.0)  # running: its whole future leaves the map
    assert len(ant) == 0 and ant.peak(100) == 0.0 and tr.remaining_decode_tokens(W0) == 0
    assert tr.predicted_tokens("r0") is None and tr.predicted_tokens("r1") is None


def test_retry_moves_the_request() -> None:
    fleet = make_fleet(2)
    tr = AnticipationTracker()
    for w in fleet.routable("m"):
        tr.sync(w, 0.0)
    ctx = make_requests(1, prompt_len=64)[0]
    tr.on_dispatch(ctx, W0, 5, 0.0)
    tr.on_dispatch(dataclasses.replace(ctx, attempt=1), WorkerId("w1"), 5, 0.0)  # W0's attempt never closed
    assert tr.queued_prefill_tokens(W0) == 0 and tr.queued_prefill_tokens(WorkerId("w1")) == 64


def test_first_token_before_first_sync_is_deferred() -> None:
    _, w = one_worker()
    tr = AnticipationTracker()
    tr.on_dispatch(make_requests(1, prompt_len=16)[0], W0, 4, 0.0)
    tr.on_first_token("r0", W0, 0.0)
    assert tr.anticipator(W0) is None and tr.remaining_decode_tokens(W0) == 4
    ant = tr.sync(w, 0.0)
    assert ant.load_tokens(5) == [16, 17, 18, 19, 0]


def test_predictions_are_clamped_to_max_len() -> None:
    _, w = one_worker()
    tr = AnticipationTracker(max_len=64)
    tr.sync(w, 0.0)
    tr.on_dispatch(make_requests(1)[0], W0, 10_000, 0.0)
    tr.on_dispatch(make_requests(2)[1], W0, 0, 0.0)
    assert tr.predicted_tokens("r0") == 64 and tr.predicted_tokens("r1") == 1


def test_clock_extrapolates_over_the_profile_iteration_time() -> None:
    fleet, w = one_worker(PROFILE)
    tr = AnticipationTracker()
    fleet.set_time(1.0)
    fleet.apply_stats(W0, stats(500), now=1.0)
    ant = tr.sync(w, 1.0)
    assert ant.iteration == 500  # the sample
    tr.on_dispatch(make_requests(1, prompt_len=1000)[0], W0, 400, 1.0)
    tr.on_first_token("r0", W0, 1.0)
    # one decoding request with 1000 resident tokens: t = step + per_decode + ctx term
    t_iter = get_profile(PROFILE).iteration_time_s(0, 0, 1, 1000)
    assert 0.008 < t_iter < 0.009
    fleet.set_time(1.0 + 10.5 * t_iter)
    assert tr.sync(w, 1.0 + 10.5 * t_iter).iteration == 510  # floor(10.5) iterations since the sample
    assert tr.remaining_decode_tokens(W0) == 390  # 400 - 10 decoded as the map assumes
    # a new sample behind the extrapolation holds the clock (never backwards) ...
    fleet.apply_stats(W0, stats(505), now=1.0 + 10.5 * t_iter)
    assert tr.sync(w, 1.0 + 10.5 * t_iter).iteration == 510
    # ... and one ahead moves it forward to the sample
    fleet.set_time(2.0)
    fleet.apply_stats(W0, stats(700), now=2.0)
    assert tr.sync(w, 2.0).iteration == 700


def test_clock_does_not_extrapolate_an_empty_map() -> None:
    fleet, w = one_worker(PROFILE)
    tr = AnticipationTracker()
    fleet.apply_stats(W0, stats(42), now=0.0)
    tr.sync(w, 0.0)
    tr.on_dispatch(make_requests(1)[0], W0, 10, 0.0)  # pending only: nothing in the map to age
    fleet.set_time(5.0)
    assert tr.sync(w, 5.0).iteration == 42


def test_clock_without_profile_uses_the_observed_rate() -> None:
    fleet, w = one_worker("")  # real vLLM: no profile
    tr = AnticipationTracker()
    fleet.apply_stats(W0, stats(0), now=0.0)
    tr.sync(w, 0.0)
    fleet.set_time(1.0)
    fleet.apply_stats(W0, stats(100), now=1.0)  # 100 iterations/s
    tr.sync(w, 1.0)
    tr.on_dispatch(make_requests(1)[0], W0, 500, 1.0)
    tr.on_first_token("r0", W0, 1.0)
    fleet.set_time(1.5)
    assert tr.sync(w, 1.5).iteration == 150  # 100 + 0.5 s x 100/s


def test_clock_survives_a_worker_restart() -> None:
    fleet, w = one_worker(PROFILE)
    tr = AnticipationTracker()
    fleet.apply_stats(W0, stats(1000), now=0.0)
    assert tr.sync(w, 0.0).iteration == 1000
    fleet.apply_stats(W0, stats(5), now=0.0)  # the counter restarted
    assert tr.sync(w, 0.0).iteration == 1000
    fleet.apply_stats(W0, stats(15), now=0.0)  # 10 iterations later: the clock moves by 10
    assert tr.sync(w, 0.0).iteration == 1010


@pytest.mark.parametrize("rate_source", [PROFILE, ""])
def test_clock_is_monotonic_under_random_samples(rate_source: str) -> None:
    import random

    rng = random.Random(7)
    fleet, w = one_worker(rate_source)
    tr = AnticipationTracker()
    now, last, n = 0.0, -1, 0
    for i in range(300):
        now += rng.uniform(0.0, 0.05)
        fleet.set_time(now)
        if rng.random() < 0.2:
            n += rng.randint(-5, 20)  # samples lag behind the extrapolation; a drop is a restart
            fleet.apply_stats(W0, stats(max(0, n)), now=now)
        if rng.random() < 0.1 and len(tr.anticipator(W0) or ()):
            tr.on_finish(f"q{rng.randrange(i)}", W0, now)
        if rng.random() < 0.3:
            ctx = dataclasses.replace(make_requests(1, prompt_len=20)[0], request_id=f"q{i}")
            tr.on_dispatch(ctx, W0, rng.randint(1, 50), now)
            tr.on_first_token(f"q{i}", W0, now)
        it = tr.sync(w, now).iteration
        assert it >= last
        last = it


@pytest.mark.parametrize("rate_source", [PROFILE, ""])
def test_sync_all_moves_every_clock_as_sync_does(rate_source: str) -> None:
    """`sync_all` (a select's loop over its pool, `sync`'s common case written out) leaves every worker's map and
    clock where `sync`, one worker at a time, does: through new samples, restarts, dispatches and finishes."""
    import random

    rng = random.Random(11)
    fleet = Fleet()
    ws = [
        fleet.add_worker(
            make_worker_info(i, kv_capacity_blocks=1000, block_size=16, perf_profile=rate_source),
            state=WorkerState.READY,
            healthy=True,
        )
        for i in range(3)
    ]
    one, many = AnticipationTracker(), AnticipationTracker()
    now, counts = 0.0, [0, 0, 0]
    for i in range(400):
        now += rng.uniform(0.0, 0.03)
        fleet.set_time(now)
        for k, w in enumerate(ws):
            if rng.random() < 0.1:
                counts[k] = max(0, counts[k] + rng.randint(-5, 20))  # a drop is a restart
                fleet.apply_stats(w.worker_id, stats(counts[k]), now=now)
        if rng.random() < 0.4:
            w, rid = rng.choice(ws), f"q{i}"
            ctx = dataclasses.replace(make_requests(1, prompt_len=rng.randint(1, 300))[0], request_id=rid)
            d = rng.randint(1, 60)
            for tr in (one, many):
                tr.on_dispatch(ctx, w.worker_id, d, now)
                tr.on_first_token(rid, w.worker_id, now)
        if rng.random() < 0.1 and i:
            rid = f"q{rng.randrange(i)}"
            for tr in (one, many):
                for w in ws:
                    tr.on_finish(rid, w.worker_id, now)
        got = many.sync_all(ws, now)
        want = [one.sync(w, now) for w in ws]
        assert [(a.iteration, a.load_tokens(64)) for a in got] == [(a.iteration, a.load_tokens(64)) for a in want]
        clock = [(s.clock.since_sample, s.clock.last_t, s.clock.base, s.clock.sample_at) for s in many._workers.values()]
        assert clock == [(s.clock.since_sample, s.clock.last_t, s.clock.base, s.clock.sample_at)
                         for s in one._workers.values()]


def test_profile_rate_is_the_profile_iteration_time_bit_for_bit() -> None:
    """The clock's rate prices an iteration with `ProfileCost.decode_iteration_s`: the same float as the profile's
    `iteration_time_s(0, 0, D, C)` (which it writes out), so the clock is the one the profile defines."""
    from switchyard.router.policies.preble_cost import profile_cost
    from switchyard.workers.engine.profiles import PROFILES

    for name in PROFILES:
        cost = profile_cost(name)
        for n in (1, 2, 3, 17, 256, 1000, 5000):
            for c in (0, 1, 999, 16_000, 123_457, 2_000_000):
                assert cost.decode_iteration_s(n, c) == cost.profile.iteration_time_s(0, 0, n, c)
