"""dynamo_kv: cost = overlap_score_weight x prefill_blocks + decode_blocks, worked examples (block size 16)."""

from __future__ import annotations

import dataclasses

import pytest
from factories import make_fleet, make_requests

from switchyard.router.fleet import Fleet
from switchyard.router.policies.base import RoutingContext, WorkerId
from switchyard.router.policies.dynamo_kv import DynamoKv, DynamoKvConfig
from switchyard.workers.engine.kv_events import BlockStored, KvEventBatch

# r0..r3: 64 tokens = 4 blocks each; the first 48 tokens (3 blocks) are shared
R = make_requests(4, prompt_len=64, shared_prefix=48)


def cache(fleet: Fleet, wid: str, hashes: tuple[int, ...], seq: int = 1) -> None:
    """The worker's KV events say it holds `hashes` (a leading run)."""
    ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=tuple(range(16 * len(hashes))),
                     block_size=16)
    fleet.apply_kv_events(WorkerId(wid), KvEventBatch(seq=seq, ts=0.0, events=(ev,)))


def route(policy: DynamoKv, fleet: Fleet, ctx: RoutingContext, to: str | None = None) -> str:
    d = policy.select(ctx, fleet, 0.0)
    assert d is not None
    if to is not None:  # force the placement (setting up load), as a pinned request would
        d = type(d)(worker_id=WorkerId(to))
    fleet.note_dispatch(d.worker_id)
    policy.on_dispatch(ctx, d, 0.0)
    return d.worker_id


def costs(policy: DynamoKv, fleet: Fleet, ctx: RoutingContext) -> list[float]:
    return [r[0] for r in policy.costs(ctx, fleet, list(fleet.routable("m")))]


def test_max_overlap_wins_when_idle() -> None:
    fleet, policy = make_fleet(2), DynamoKv()
    cache(fleet, "w0", R[1].block_hashes[:3])
    # w0: 1.0 x (64 - 3x16)/16 + (0 active + 4 new) = 1 + 4 = 5; w1: 64/16 + 4 = 8
    assert costs(policy, fleet, R[1]) == [5.0, 8.0]
    assert route(policy, fleet, R[1]) == "w0"


# (case, overlap_score_weight, expected costs [w0, w1], expected pick)
DECODE_CASES = [
    # w0 holds 3 cached blocks but has r0 decoding (4 active blocks, prefill done):
    # w0: 1 x 1 + (4 active + 1 new: r1 shares r0's 3 prefix blocks) = 6; w1: 4 + 4 = 8 -> w0 (shared blocks)
    ("shared active prefix counts once", 1.0, "r0", [6.0, 8.0], "w0"),
    # r3's unrelated twin on w0 instead: 4 unique active blocks -> w0: 1 + (4 + 4) = 9 > w1: 4 + 4 = 8 -> w1
    ("decode load outweighs overlap", 1.0, "unique", [9.0, 8.0], "w1"),
    # same state, weight 2: w0: 2 x 1 + 8 = 10 < w1: 2 x 4 + 4 = 12 -> w0
    ("higher overlap weight restores affinity", 2.0, "unique", [10.0, 12.0], "w0"),
]


@pytest.mark.parametrize(("case", "weight", "load", "want_costs", "want"), DECODE_CASES,
                         ids=[c[0] for c in DECODE_CASES])
def test_decode_load_against_overlap(case: str, weight: float, load: str, want_costs: list[float],
                                     want: str) -> None:
    fleet, policy = make_fleet(2), DynamoKv(DynamoKvConfig(overlap_score_weight=weight))
    cache(fleet, "w0", R[1].block_hashes[:3])
    busy = R[0] if load == "r0" else make_requests(1, prompt_len=64)[0]  # 4 blocks unrelated to R
    busy = dataclasses.replace(busy, request_id="busy")
    route(policy, fleet, busy, to="w0")
    policy.on_first_token("busy", WorkerId("w0"), 0.0)  # prefill done: only its blocks remain
    assert costs(policy, fleet, R[1]) == want_costs
    assert route(policy, fleet, R[1]) == want


def test_active_prefill_tokens_and_release() -> None:
    fleet, policy = make_fleet(2), DynamoKv()
    route(policy, fleet, R[0], to="w1")  # 64 uncached tokens still to prefill on w1, 4 active blocks
    # r2 on w1: (64 + 64)/16 + (4 active + 1 new) = 8 + 5 = 13; w0: 4 + 4 = 8
    assert costs(policy, fleet, R[2]) == [8.0, 13.0]
    policy.on_first_token("r0", WorkerId("w1"), 0.0)  # prefill done: 64/16 + 5 = 9
    assert costs(policy, fleet, R[2]) == [8.0, 9.0]
    policy.on_finish("r0", WorkerId("w1"), 0.0, 16)  # blocks freed: back to 4 + 4
    assert costs(policy, fleet, R[2]) == [8.0, 8.0]
    assert not policy._active[WorkerId("w1")].block_refs


def test_partial_block_and_overlap_charged_at_dispatch() -> None:
    fleet, policy = make_fleet(1), DynamoKv()
    ctx = make_requests(1, prompt_len=40)[0]  # 2 full blocks + 8 tokens
    cache(fleet, "w0", ctx.block_hashes[:1])
    # 1 x (40 - 16)/16 + (0 + 2 new full + 1 partial) = 1.5 + 3 = 4.5
    assert costs(policy, fleet, ctx) == [4.5]
    route(policy, fleet, ctx)
    act = policy._active[WorkerId("w0")]
    assert (len(act.block_refs), act.num_partial_blocks, act.prefill_tokens) == (2, 1, 24)  # 40 - 16 cached
    policy.on_abort(ctx.request_id, WorkerId("w0"), 0.0)
    assert (len(act.block_refs), act.num_partial_blocks, act.prefill_tokens) == (0, 0, 0)


def test_equal_costs_tie_break_is_deterministic_and_spread() -> None:
    fleet = make_fleet(4)
    picks = [DynamoKv().select(c, fleet, 0.0).worker_id for c in make_requests(40)]  # type: ignore[union-attr]
    assert picks == [DynamoKv().select(c, fleet, 0.0).worker_id for c in make_requests(40)]  # type: ignore[union-attr]
    assert set(picks) == {"w0", "w1", "w2", "w3"}


def test_temperature_samples_softmax_of_rescaled_costs() -> None:
    fleet = make_fleet(2)
    cache(fleet, "w0", R[1].block_hashes[:3])  # costs 5 vs 8
    ctxs = [dataclasses.replace(R[1], request_id=f"q{i}") for i in range(400)]
    cold = [DynamoKv(DynamoKvConfig(router_temperature=1.0)).select(c, fleet, 0.0).worker_id for c in ctxs]  # type: ignore[union-attr]
    # rescaled to [0, 1]: p(w0) = 1 / (1 + e^-1) = 0.731
    assert 0.66 < cold.count("w0") / 400 < 0.80
    hot = [DynamoKv(DynamoKvConfig(router_temperature=0.05)).select(c, fleet, 0.0).worker_id for c in ctxs]  # type: ignore[union-attr]
    assert hot.count("w0") == 400  # p(w1) = e^-20 / (1 + e^-20)
