"""oracle_partition (Preble's oracle baseline, specs/preble.md §7.4): the offline key-portion table, the even split
of key portions over the workers, the round-robin fallback, the simulator handing it the trace, and the daemon
refusing it."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from factories import make_fleet, make_requests

from switchyard.bench import preble_workloads as pw
from switchyard.bench import sim
from switchyard.bench.metrics import OK
from switchyard.bench.traces import NS_UNIQUE, Trace, TraceRequest
from switchyard.router.config import RouterConfig
from switchyard.router.fleet import WorkerState
from switchyard.router.policies.base import WorkerId
from switchyard.router.policies.oracle_partition import OraclePartition


def route(policy: OraclePartition, fleet, ctx) -> str:  # type: ignore[no-untyped-def]
    d = policy.select(ctx, fleet, 0.0)
    assert d is not None
    policy.on_dispatch(ctx, d, 0.0)
    return d.worker_id


def test_the_table_ranks_each_shared_key_portion_and_leaves_out_the_unshared() -> None:
    # a, b share K behind the system prompt S; c, d share K2; e's longest own node is its 100-token tail
    s, k, k2 = (pw.NS_SYSTEM, 0, 10), (pw.NS_TOOL, 0, 40), (pw.NS_TOOL, 1, 40)
    u = [(NS_UNIQUE, i, 5) for i in range(4)]
    reqs = (
        TraceRequest("a", 0.0, 55, 2, (s, k, u[0])),
        TraceRequest("b", 1.0, 55, 2, (s, k, u[1])),
        TraceRequest("c", 2.0, 55, 2, (s, k2, u[2])),
        TraceRequest("d", 3.0, 55, 2, (s, k2, u[3])),
        TraceRequest("e", 4.0, 110, 2, (s, (NS_UNIQUE, 9, 100))),
    )
    keys = pw.key_portions(Trace("hand", reqs))
    assert [kp.segments for kp in keys] == [(s, k), (s, k), (s, k2), (s, k2), (s, (NS_UNIQUE, 9, 100))]
    assert [kp.num_tokens for kp in keys] == [40, 40, 40, 40, 100]
    table = pw.oracle_partition_table(Trace("hand", reqs))
    assert set(table) == {"a", "b", "c", "d"}  # e's key portion is its own: it partitions nothing
    assert table["a"] == table["b"] != table["c"] == table["d"] and {table["a"], table["c"]} == {0, 1}


def test_videoqa_splits_its_videos_evenly_by_count_not_by_traffic() -> None:
    trace = pw.make_videoqa(pw.PrebleSpec(num_requests=600), 0)
    table = pw.oracle_partition_table(trace)
    video_of = {r.request_id: next(sg for sg in r.segments if sg[0] == pw.NS_VIDEO) for r in trace.requests}
    # one rank per video: the key portion is the video
    rank_of_video: dict[tuple[int, int, int], int] = {}
    for rid, rank in table.items():
        assert rank_of_video.setdefault(video_of[rid], rank) == rank
    assert sorted(rank_of_video.values()) == list(range(len(rank_of_video)))
    videos_per_worker = Counter(rank % 4 for rank in rank_of_video.values())
    assert max(videos_per_worker.values()) - min(videos_per_worker.values()) <= 1


def test_a_partitioned_request_goes_to_its_worker_and_the_rest_round_robin() -> None:
    fleet, pol = make_fleet(3), OraclePartition()
    r = make_requests(8)
    pol.set_partition({r[0].request_id: 0, r[1].request_id: 4, r[2].request_id: 5, r[3].request_id: 4})
    assert [route(pol, fleet, c) for c in r[:4]] == ["w0", "w1", "w2", "w1"]
    assert [route(pol, fleet, c) for c in r[4:8]] == ["w0", "w1", "w2", "w0"]  # no partition: rotation
    # the partition's worker is down or failed this request: the rotation takes it, and the split stays over K = 3
    fleet.set_state(WorkerId("w1"), WorkerState.DRAINING)
    assert route(pol, fleet, r[1]) in {"w0", "w2"}
    assert route(pol, fleet, r[2]) == "w2"
    fleet.set_state(WorkerId("w1"), WorkerState.READY)
    retry = dataclasses.replace(r[1], attempt=1, excluded_workers=frozenset({WorkerId("w1")}))
    assert route(pol, fleet, retry) != "w1"
    with pytest.raises(ValueError, match=">= 0"):
        pol.set_partition({"x": -1})


def test_the_simulator_hands_it_the_trace_and_each_video_stays_on_one_worker() -> None:
    trace = pw.make_videoqa(pw.PrebleSpec(num_requests=120, rate=4.0), 0)
    cfg = sim.SimConfig(policy="oracle_partition", num_workers=4, profile="llama3-8b-a100")
    res = sim.Simulator(trace, cfg).run()
    assert all(rec.status == OK for rec in res.records)
    table = pw.oracle_partition_table(trace)
    by_id = {rec.request_id: rec for rec in res.records}
    assert {rid: by_id[rid].worker_id for rid in table} == {rid: f"w{rank % 4}" for rid, rank in table.items()}


def test_the_daemon_refuses_it() -> None:
    with pytest.raises(ValueError, match="only in the simulator"):
        RouterConfig.model_validate({"routing": {"policy": "oracle_partition"}})
