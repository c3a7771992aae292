"""Other router replicas' requests, from the workers' request events, in this replica's policy (`PeerMirror`).

Each replica sees its own dispatches at once and another's only through the worker: these tests feed a policy the
events a worker would stream and check what it routes and counts, for E2 and the default policy, with the mirror
on (the default) and off.
"""

from __future__ import annotations

import dataclasses

import pytest

from switchyard.auth import KeyLimits, KeySpec
from switchyard.router.peer_keys import PeerKeyCharges
from switchyard.router.peer_mirror import PeerMirror, peer_key
from switchyard.router.policies.base import RoutingContext, WorkerId
from switchyard.router.policies.registry import make_policy
from switchyard.workers.engine.kv_events import RequestAdmitted, RequestEnded, RequestFirstToken
from tests.factories import make_fleet, make_requests

W = [WorkerId(f"w{i}") for i in range(3)]


def request(rid: str, prompt_len: int, shared: int) -> RoutingContext:
    """`shared` leading tokens common to every request of a test (equal leading block hashes), then unique ones."""
    base = make_requests(1, prompt_len=prompt_len, shared_prefix=shared)[0]
    tokens = tuple(range(shared)) + tuple(10**7 + hash(rid) % 10**6 * 4096 + k for k in range(prompt_len - shared))
    hashes, prev = [], 0
    for b in range(prompt_len // 16):
        prev = hash((prev, tokens[b * 16: (b + 1) * 16])) & (2**64 - 1)
        hashes.append(prev)
    return dataclasses.replace(base, request_id=rid, prompt_token_ids=tokens, block_hashes=tuple(hashes))


def admitted(ctx: RoutingContext, origin: str = "a") -> RequestAdmitted:
    """The event the worker streams when another replica's request reaches it."""
    return RequestAdmitted(ctx.request_id, origin, ctx.block_hashes, ctx.num_prompt_tokens, ctx.max_tokens)


def own_dispatch(policy, fleet, ctx: RoutingContext, now: float = 0.0) -> WorkerId:  # type: ignore[no-untyped-def]
    d = policy.select(ctx, fleet, now)
    fleet.note_dispatch(d.worker_id)
    policy.on_dispatch(ctx, d, now)
    return d.worker_id


def test_a_peer_replicas_in_flight_prefix_draws_its_follow_ups() -> None:
    """Replica B has sent one request of its own; replica A's request for a long prefix is being prefilled on a
    worker B would not pick blind (no KV event can say so before that prefill ends). With the mirror, E2 in B sends
    a follow-up sharing that prefix to the same worker (an exploit: more of it is assigned there than missed);
    without it, B prefills the prefix a second time elsewhere. (The default policy prices the wait behind that
    prefill, about what recomputing costs for one follow-up: its gain is the load, below.)"""
    prefix_req = request("a-1", 1024, 1024)
    follow_up = request("b-2", 1088, 1024)  # the 64 blocks + 4 of its own
    picks = {}
    for mirror in (False, True):
        policy = make_policy("e2", {"mirror_peers": mirror})
        fleet = make_fleet(3, kv_capacity_blocks=4000)
        own_dispatch(policy, fleet, request("b-1", 256, 0))  # B's own load
        blind = policy.select(follow_up, fleet, 0.1).worker_id
        holder = next(w for w in W if w != blind)
        PeerMirror("b", policy, fleet).apply(holder, "m", [admitted(prefix_req, "a")], 0.1)
        picks[mirror] = (holder, blind, policy.select(follow_up, fleet, 0.2).worker_id)
    holder, blind, pick = picks[True]
    assert pick == holder
    holder, blind, pick = picks[False]
    assert pick == blind != holder


@pytest.mark.parametrize("name", ["e2", "switchyard"])
def test_a_peer_replicas_load_steers_new_requests_away(name: str) -> None:
    """Replica A has queued long prefills on the worker replica B would pick for a new request: with the mirror, B
    prices them (they are ahead of it there) and picks another worker; without, it sees an idle worker."""
    fresh = request("b-1", 512, 0)
    picks = {}
    for mirror in (False, True):
        policy = make_policy(name, {"mirror_peers": mirror})
        fleet = make_fleet(3, kv_capacity_blocks=4000)
        blind = policy.select(fresh, fleet, 0.0).worker_id
        mirror_of = PeerMirror("b", policy, fleet)
        for i in range(3):
            mirror_of.apply(blind, "m", [admitted(request(f"a-{i}", 3072, 0), "a")], 0.1)
        picks[mirror] = (blind, policy.select(fresh, fleet, 0.2).worker_id)
    assert picks[False][1] == picks[False][0]
    assert picks[True][1] != picks[True][0]


def test_peer_requests_load_the_policy_until_they_end() -> None:
    """The default policy counts a peer's request as queued until its first token and drops it at its end; its own
    events, replays and events for requests it never saw change nothing; a lost worker's peer requests end."""
    policy = make_policy("switchyard")
    fleet = make_fleet(2)
    policy.select(request("warm", 64, 0), fleet, 0.0)  # the first select memoises the fleet
    mirror = PeerMirror("b", policy, fleet)
    ctx = request("r1", 512, 0)
    key = peer_key("a", "r1")
    mirror.apply(W[0], "m", [admitted(ctx), admitted(ctx)], 1.0)  # the second is a replay
    mirror.apply(W[0], "m", [admitted(request("mine", 512, 0), "b")], 1.0)  # B's own: the dispatcher told it
    assert (mirror.count(W[0]), len(policy.queued[W[0]]), set(policy.reqs)) == (1, 1, {key})
    assert policy.reqs[key].prompt_tokens == 512
    mirror.apply(W[0], "m", [RequestFirstToken("r1", "a"), RequestFirstToken("never-seen", "a")], 1.5)
    assert not policy.queued[W[0]] and key in policy.reqs  # past its first token: in the map, not queued
    mirror.apply(W[0], "m", [RequestEnded("r1", "a", 40, True), RequestEnded("never-seen", "a", 1, True)], 2.0)
    assert (mirror.count(W[0]), key in policy.reqs, key in policy.in_flight) == (0, False, False)
    mirror.apply(W[1], "m", [admitted(request("r2", 512, 0))], 3.0)
    mirror.forget_worker(W[1], 3.5)  # lost: aborted, as the router's own requests there
    assert (len(mirror), peer_key("a", "r2") in policy.reqs, len(policy.queued.get(W[1], {}))) == (0, False, 0)


def test_a_policy_that_does_not_mirror_sees_nothing() -> None:
    """Peers' baselines keep their own default: only their own dispatches (llm-d's approximate index, SMG's tree
    without its mesh)."""
    policy = make_policy("smg_cache_aware")
    assert not policy.mirrors_peers
    mirror = PeerMirror("b", policy, make_fleet(1))
    mirror.apply(W[0], "m", [admitted(request("r1", 512, 0))], 1.0)
    assert len(mirror) == 0
    assert make_policy("e2").mirrors_peers and make_policy("switchyard").mirrors_peers


def test_a_mirrored_context_carries_the_prompt_length_without_its_tokens() -> None:
    ctx = RoutingContext(request_id="x", model="m", prompt_token_ids=(), block_hashes=(1, 2), max_tokens=4,
                         arrival_s=0.0, prompt_len=40)
    assert ctx.num_prompt_tokens == 40
    assert dataclasses.replace(ctx, prompt_len=-1, prompt_token_ids=(5,) * 7).num_prompt_tokens == 7


def _stored(fleet, wid: str, hashes: tuple[int, ...]) -> None:  # type: ignore[no-untyped-def]
    """The worker's KV events say it holds `hashes` (a leading run of 16-token blocks)."""
    from switchyard.workers.engine.kv_events import BlockStored, KvEventBatch

    ev = BlockStored(hashes, None, tuple(range(16 * len(hashes))), 16)
    fleet.apply_kv_events(WorkerId(wid), KvEventBatch(seq=1, ts=0.0, events=(ev,)))


def test_dynamo_replica_sync_charges_a_peers_request_as_its_router_did() -> None:
    """`dynamo_kv_sync` (Dynamo's --router-replica-sync): a peer's request joins w's active sequences with the
    uncached prefill its sender charged (the overlap read from the same KV events), released at its first token;
    `dynamo_kv` (the default) ignores it."""
    ctx = request("r1", 512, 0)  # 32 blocks
    for name, want in (("dynamo_kv", None), ("dynamo_kv_sync", 512 - 8 * 16)):
        policy = make_policy(name)
        fleet = make_fleet(2)
        _stored(fleet, "w0", ctx.block_hashes[:8])  # 8 of its blocks already cached on w0
        mirror = PeerMirror("b", policy, fleet)
        mirror.apply(W[0], "m", [admitted(ctx)], 1.0)
        active = policy._active.get(W[0])  # type: ignore[attr-defined]
        assert (active.prefill_tokens if active else None) == want
        mirror.apply(W[0], "m", [RequestFirstToken("r1", "a")], 1.5)
        if want is not None:
            assert active.prefill_tokens == 0 and len(active.block_refs) == 32


def test_llmd_precise_reads_the_workers_kv_events_not_its_own_dispatches() -> None:
    """`llmd_precise` (llm-d's precise-prefix-cache-scorer): the prefix score follows the workers' KV events, so a
    replica that never routed a prefix still finds its holder; the default approximate scorer does not."""
    ctx = request("r1", 512, 0)
    for name, want in (("llmd_scorer", 0.0), ("llmd_precise", 1.0)):
        policy = make_policy(name)
        fleet = make_fleet(2)
        _stored(fleet, "w1", ctx.block_hashes)
        prefix = {w.worker_id: row[3] for w, row in zip(fleet.routable("m"), policy.scores(  # type: ignore[attr-defined]
            ctx, list(fleet.routable("m")), fleet), strict=True)}
        assert prefix == {W[0]: 0.0, W[1]: want}
        if name == "llmd_precise":
            assert policy.select(ctx, fleet, 0.0).worker_id == W[1]


def test_smg_mesh_follows_a_peer_replicas_prefix_into_its_tree() -> None:
    """`smg_mesh` (SMG's mesh: the replicas' tree inserts gossiped): a prefix another replica routed is in this
    replica's tree, so a follow-up goes where that prefix went; `smg_cache_aware` (the default, its own dispatches
    only) sends it to its smallest tree. The mesh tree is over full blocks: a match counts whole blocks."""
    prefix_req = request("a-1", 1024, 1024)
    follow_up = request("b-2", 1088, 1024)  # 64 shared blocks + 4 of its own
    for name in ("smg_cache_aware", "smg_mesh"):
        policy = make_policy(name)
        fleet = make_fleet(3)
        own = own_dispatch(policy, fleet, request("b-1", 256, 0))  # this replica's own, elsewhere
        holder = next(w for w in W if w != own and w != policy.select(follow_up, fleet, 0.1).worker_id)
        PeerMirror("b", policy, fleet).apply(holder, "m", [admitted(prefix_req, "a")], 0.1)
        d = policy.select(follow_up, fleet, 0.2)
        if name == "smg_mesh":
            assert d.worker_id == holder and d.reason == "match 1024/1088=0.941"
        else:
            assert d.worker_id != holder and d.reason.startswith("miss 0/1088")


def test_other_replicas_requests_are_charged_to_their_api_keys() -> None:
    """With API keys, the mirror charges each other replica's request to the key its admission names (`tenant`),
    whatever the policy: a replay or a snapshot's re-announcement is not charged twice, and the end gives back
    what the request did not use, as this replica settles its own."""
    clock = lambda: 0.0  # noqa: E731  (the buckets do not refill here)
    limits = KeyLimits(clock)
    team = KeySpec("team", max_in_flight=3, tokens_per_min=6000)
    policy = make_policy("round_robin")
    fleet = make_fleet(2)
    assert not PeerMirror("b", policy, fleet).active  # nothing to do with the events: the registry skips them
    mirror = PeerMirror("b", policy, fleet, PeerKeyCharges(limits, {"team": team}.get))
    assert mirror.active

    def adm(rid: str, origin: str = "a", tenant: str = "team") -> RequestAdmitted:
        return RequestAdmitted(rid, origin, (1, 2), 100, 400, tenant=tenant)

    mirror.apply(W[0], "m", [adm("r1"), adm("mine", origin="b"), adm("anon", tenant=""), adm("x", tenant="other")], 1.0)
    mirror.apply(W[0], "m", [adm("r1")], 1.0)  # a replayed batch
    assert (limits.peer_in_flight("team"), limits.tokens_left(team)) == (1, 5500)
    assert fleet.get(W[0]).peer_in_flight == 3  # every other replica's request counts toward the worker's load
    mirror.apply(W[0], "m", [RequestFirstToken("r1", "a"), RequestEnded("r1", "a", 50, True)], 2.0)
    assert (limits.peer_in_flight("team"), limits.tokens_left(team)) == (0, 5850)  # used 100 + 50 of 500
    mirror.apply(W[0], "m", [adm("r2"), RequestEnded("r2", "a", 0, False)], 3.0)  # failed before running
    assert limits.tokens_left(team) == 5850
    mirror.apply(W[1], "m", [adm("r3"), adm("r4")], 4.0)
    mirror.forget_worker(W[1], 4.5)  # its stream gapped: a snapshot follows
    assert (limits.peer_in_flight("team"), limits.tokens_left(team)) == (0, 4850)
    mirror.apply(W[1], "m", [adm("r3")], 5.0)  # the snapshot: r3 still open, r4 ended meanwhile
    assert (limits.peer_in_flight("team"), limits.tokens_left(team)) == (1, 4850)
    mirror.apply(W[1], "m", [RequestEnded("r3", "a", 0, False)], 6.0)
    assert (limits.peer_in_flight("team"), limits.tokens_left(team)) == (0, 5350)  # r4 keeps its reservation


@pytest.mark.parametrize("name", ["e2", "switchyard"])
def test_a_peers_request_heard_before_any_select_is_priced_with_its_workers_profile(name: str) -> None:
    """A replica started later hears of the others' requests before its own first select: it prices them with the
    worker's profile and block size all the same (not the defaults), as a replica that had selected before."""
    fleet = make_fleet(2, block_size=32)
    for i in range(2):
        fleet.get(W[i]).info = dataclasses.replace(fleet.get(W[i]).info, perf_profile="llama2-70b-h100-tp4")
    peer = request("a-1", 1024, 0)
    loads = []
    for select_first in (False, True):
        policy = make_policy(name)
        if select_first:
            policy.select(request("b-1", 64, 0), fleet, 0.0)
        PeerMirror("b", policy, fleet).apply(W[1], "m", [admitted(peer)], 0.5)
        loads.append((policy.load_s(W[1], 1.0), policy.queue_s(W[1])))
    assert loads[0] == loads[1] and loads[0][1] > 0
