"""Every registered policy keeps `Policy.select`'s contract under random hooks and fleet churn.

The contract (router/policies/base.py): `select` picks one of the model's routable workers that the request has
not failed on, and returns None only when there is none. The churn is what the registry does live: workers join,
leave, drain, sleep and lose health between requests, KV events and Stats arrive for them, and requests end (finish
or abort) on workers that have left since. Each policy keeps per-worker state, so a worker it still remembers after
it left, or one it never heard of, is where this contract breaks.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
from factories import make_requests, make_stats, make_worker_info
from hook_fuzz import chained

from switchyard.router.fleet import Fleet, WorkerState
from switchyard.router.policies.aibrix_prefix import AibrixPrefix
from switchyard.router.policies.base import Decision, Policy, RoutingContext, WorkerId
from switchyard.router.policies.dynamo_kv import DynamoKv
from switchyard.router.policies.llmd_scorer import LlmdScorer
from switchyard.router.policies.oracle_partition import OraclePartition
from switchyard.router.policies.registry import POLICIES
from switchyard.router.policies.smg_cache_aware import SmgCacheAware, SmgCacheAwareConfig
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch


def churn(name: str, seed: int, steps: int = 400) -> int:
    """Drive policy `name` through `steps` random operations, asserting the contract at every select; returns how
    many selects had a candidate (the caller checks the run was not vacuous)."""
    rng = random.Random(seed)
    policy = POLICIES[name]()
    if isinstance(policy, OraclePartition):
        policy.set_partition({})  # the simulator gives it the trace's table; empty = every key portion unseen
    fleet, now = Fleet(), 0.0
    kv_seq: dict[WorkerId, int] = {}  # the live workers, and the seq of each one's last KV batch
    gone: list[WorkerId] = []
    in_flight: dict[str, WorkerId] = {}
    joined = 0

    def join() -> None:
        nonlocal joined
        info = make_worker_info(joined, kv_capacity_blocks=rng.choice([50, 1000]), max_num_seqs=rng.choice([2, 8]))
        joined += 1
        fleet.add_worker(info)
        kv_seq[info.worker_id] = 0
        policy.on_worker_change(info.worker_id, now)

    for _ in range(rng.randint(1, 4)):
        join()
    # prompts of 0-10 blocks whose first 4 blocks come from 3 labels (shared prefixes)
    prompts = [chained([rng.randrange(3) if d < 4 else rng.randrange(30) for d in range(rng.randint(0, 10))])
               for _ in range(30)]
    base = make_requests(1)[0]
    served = 0
    for step in range(steps):
        now += rng.choice([0.0, rng.random() * 0.5, rng.random() * 5])
        fleet.set_time(now)
        live = list(kv_seq)
        op = rng.random()
        if op < 0.35:
            hashes = rng.choice(prompts)
            excluded = frozenset(w for w in live + gone if rng.random() < 0.15)
            rid = f"r{step % 50}" if rng.random() < 0.3 else f"r{step}"  # ids are reused once a request ends
            if rid in in_flight:
                continue
            ctx = dataclasses.replace(
                base, request_id=rid, block_hashes=hashes, arrival_s=now, excluded_workers=excluded,
                prompt_token_ids=tuple(rng.randrange(32000) for _ in range(16 * len(hashes) + rng.randint(1, 16))),
                attempt=int(bool(excluded)), max_tokens=rng.randint(1, 200),
                predicted_output_tokens=rng.choice([None, rng.randint(1, 300)]),
            )
            # the oracle is computed here, not with `base.candidates`, which the policies share
            allowed = {w.worker_id for w in fleet.workers("m") if w.is_routable and w.worker_id not in excluded}
            decision = policy.select(ctx, fleet, now)
            if not allowed:
                assert decision is None, f"step {step}: {decision} with no candidate"
                continue
            assert decision is not None and decision.worker_id in allowed, f"step {step}: {decision} not in {allowed}"
            served += 1
            fleet.note_dispatch(decision.worker_id)
            policy.on_dispatch(ctx, decision, now)
            in_flight[rid] = decision.worker_id
        elif op < 0.5 and in_flight:  # ends, possibly on a worker that has left since
            rid = rng.choice(list(in_flight))
            wid = in_flight.pop(rid)
            if rng.random() < 0.5:
                policy.on_first_token(rid, wid, now)
            fleet.note_done(wid)
            if rng.random() < 0.8:
                policy.on_finish(rid, wid, now, rng.randint(1, 200))
            else:
                policy.on_abort(rid, wid, now)
        elif op < 0.55 and in_flight:
            rid = rng.choice(list(in_flight))
            policy.on_first_token(rid, in_flight[rid], now)
        elif op < 0.75 and live and (hashes := rng.choice(prompts)):
            wid = rng.choice(live)
            r = rng.random()
            if r < 0.6:
                cut = rng.randrange(len(hashes))
                event: BlockStored | BlockRemoved | AllBlocksCleared = BlockStored(
                    hashes[cut : rng.randint(cut + 1, len(hashes))], hashes[cut - 1] if cut else None, (), 16)
            elif r < 0.95:
                event = BlockRemoved(hashes[-rng.randint(1, len(hashes)):])
            else:
                event = AllBlocksCleared()
            kv_seq[wid] += 1
            batch = KvEventBatch(kv_seq[wid], now, (event,))
            fleet.apply_kv_events(wid, batch)
            policy.on_kv_events(wid, batch)
        elif op < 0.82 and live:
            fleet.apply_stats(rng.choice(live), make_stats(
                num_running=rng.randint(0, 8), num_waiting=rng.randint(0, 3), kv_blocks_used=rng.randint(0, 1000)), now)
        elif op < 0.88:
            policy.on_tick(now)
        elif op < 0.91:
            join()
        elif op < 0.94 and live:
            wid = rng.choice(live)
            fleet.remove_worker(wid)
            del kv_seq[wid]
            gone.append(wid)
            policy.on_worker_change(wid, now)
        elif op < 0.97 and live:
            wid = rng.choice(live)
            rec = fleet.get(wid)
            assert rec is not None
            fleet.set_healthy(wid, not rec.healthy)
            if not rec.healthy:
                kv_seq[wid] = 0  # the registry resubscribes from 0 after a health loss
            policy.on_worker_change(wid, now)
        elif live:
            wid = rng.choice(live)
            fleet.set_state(wid, rng.choice([WorkerState.READY, WorkerState.DRAINING, WorkerState.SLEEPING]))
            policy.on_worker_change(wid, now)
    for rid, wid in in_flight.items():
        fleet.note_done(wid)
        policy.on_finish(rid, wid, now, 1)
    policy.on_tick(now + 1000.0)  # past every window: whatever the policy collects, it collects
    return served


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_select_picks_an_allowed_worker_through_churn(name: str) -> None:
    served = [churn(name, seed) for seed in range(8)]
    assert min(served) > 0  # every run routed requests, not only refusals


def test_the_peer_policies_report_what_they_hold() -> None:
    """`state_sizes` (the switchyard_policy_state gauge) follows each stateful peer policy: after random prompts
    (tokens from a small alphabet, so they share prefixes) it equals an independent count of what each holds, and
    it falls back as each one's own bound or eviction drops the state."""
    rng = random.Random(7)
    workers = [WorkerId("w0"), WorkerId("w1"), WorkerId("w2")]
    sent: list[tuple[RoutingContext, WorkerId]] = []
    for i in range(60):
        tokens = tuple(rng.randrange(4) for _ in range(rng.randint(1, 9)))
        # one "block" per token: the hash of the prefix ending there
        ctx = RoutingContext(request_id=f"r{i}", model="m", prompt_token_ids=tokens, max_tokens=4, arrival_s=0.0,
                             block_hashes=tuple(hash(tokens[: j + 1]) for j in range(len(tokens))))  # fmt: skip
        sent.append((ctx, rng.choice(workers)))
    prefixes = {w: {c.prompt_token_ids[: j + 1] for c, x in sent if x == w for j in range(len(c.prompt_token_ids))}
                for w in workers}  # fmt: skip
    blocks = {w: {h for c, x in sent if x == w for h in c.block_hashes} for w in workers}
    everything = set().union(*prefixes.values())
    # a radix tree's nodes: the prefixes where an inserted prompt ends or that branch
    branches: dict[tuple[int, ...], set[int]] = {}
    for p in everything:
        branches.setdefault(p[:-1], set()).add(p[-1])
    ends = {c.prompt_token_ids for c, _ in sent}
    nodes = {p for p in everything if p in ends or len(branches.get(p, ())) >= 2}

    def dispatch_all(policy: Policy) -> None:
        for ctx, w in sent:
            policy.on_dispatch(ctx, Decision(worker_id=w), 1.0)

    smg = SmgCacheAware(SmgCacheAwareConfig(max_tree_size=5, eviction_interval_s=1.0))
    assert smg.state_sizes() == {"tree_nodes": 0, "tree_tokens": 0, "worker_tokens": 0}
    dispatch_all(smg)
    sizes = smg.state_sizes()
    assert (sizes["tree_tokens"], sizes["tree_nodes"]) == (len(everything), len(nodes))
    assert sizes["worker_tokens"] == sum(map(len, prefixes.values()))
    smg.on_tick(2.0)
    smg.on_tick(3.5)  # past the eviction interval: each worker down to 5 tokens
    after = smg.state_sizes()
    assert after["tree_tokens"] <= after["worker_tokens"] <= 5 * len(workers) < sizes["worker_tokens"]
    assert 0 < after["tree_nodes"] < sizes["tree_nodes"]

    aibrix = AibrixPrefix()
    dispatch_all(aibrix)
    assert aibrix.state_sizes() == {"table_blocks": len(set().union(*blocks.values()))}
    aibrix.on_tick(1.0 + aibrix.config.eviction_duration_s + 1)  # every entry untouched past the duration
    assert aibrix.state_sizes() == {"table_blocks": 0}

    llmd = LlmdScorer()
    dispatch_all(llmd)
    assert llmd.state_sizes() == {"index_blocks": len(set().union(*blocks.values())),
                                  "index_entries": sum(map(len, blocks.values()))}  # fmt: skip

    dynamo = DynamoKv()
    dispatch_all(dynamo)
    assert dynamo.state_sizes() == {"in_flight_requests": len(sent), "active_blocks": sum(map(len, blocks.values()))}
    for ctx, w in sent:
        dynamo.on_finish(ctx.request_id, w, 2.0, 4)
    assert dynamo.state_sizes() == {"in_flight_requests": 0, "active_blocks": 0}
