"""The router queue as plain data: bound, FCFS order, cancellation, and the hold condition as a pure function."""

from __future__ import annotations

import pytest
from factories import make_fleet, make_stats

from switchyard.router.policies.base import WorkerId
from switchyard.router.queue import QueueEntry, QueueFull, RequestQueue, is_saturated, should_hold


def entry(rid: str, arrival_s: float, model: str = "m") -> QueueEntry:
    return QueueEntry(request_id=rid, model=model, arrival_s=arrival_s)


def never_hold(_eligible) -> bool:  # type: ignore[no-untyped-def]
    return False


def always_hold(_eligible) -> bool:  # type: ignore[no-untyped-def]
    return True


def test_bounded_push_raises_queue_full_at_max_size() -> None:
    q = RequestQueue(max_size=2)
    q.push(entry("a", 0.0))
    q.push(entry("b", 0.1, model="other"))  # the bound is global, across models
    with pytest.raises(QueueFull, match="2 requests waiting"):
        q.push(entry("c", 0.2))
    assert len(q) == 2


def test_zero_size_queue_rejects_everything() -> None:
    with pytest.raises(QueueFull):
        RequestQueue(max_size=0).push(entry("a", 0.0))


def test_fcfs_by_arrival_then_push_order() -> None:
    q = RequestQueue(max_size=10)
    for rid, t in [("late", 3.0), ("first", 1.0), ("tie-a", 2.0), ("tie-b", 2.0)]:
        q.push(entry(rid, t))
    released = [q.release("m", [], never_hold).request_id for _ in range(4)]  # type: ignore[union-attr]
    assert released == ["first", "tie-a", "tie-b", "late"]
    assert q.release("m", [], never_hold) is None
    assert len(q) == 0 and q.models() == []


def test_models_are_independent_queues() -> None:
    q = RequestQueue(max_size=10)
    q.push(entry("a1", 0.0, "a"))
    q.push(entry("b1", 1.0, "b"))
    # model a is held; model b's request is released regardless (no head-of-line blocking across models)
    assert q.release("a", [], always_hold) is None
    assert q.release("b", [], never_hold).request_id == "b1"  # type: ignore[union-attr]
    assert q.models() == ["a"]


def test_cancellation_removes_from_the_middle_and_frees_capacity() -> None:
    q = RequestQueue(max_size=3)
    a, b, c = entry("a", 0.0), entry("b", 1.0), entry("c", 2.0)
    for e in (a, b, c):
        q.push(e)
    assert q.remove(b) is True
    assert q.remove(b) is False  # idempotent
    assert len(q) == 2 and q.size("m") == 2
    q.push(entry("d", 3.0))  # the freed slot is usable
    assert [q.pop("m").request_id for _ in range(3)] == ["a", "c", "d"]  # type: ignore[union-attr]
    assert q.remove(a) is False  # already released


def test_remove_of_never_pushed_entry_is_false() -> None:
    assert RequestQueue(max_size=1).remove(entry("x", 0.0)) is False


def test_release_holds_while_the_condition_is_true_and_releases_when_false() -> None:
    q = RequestQueue(max_size=4)
    q.push(entry("a", 0.0))
    held = [True]
    assert q.release("m", [], lambda _w: held[0]) is None
    assert len(q) == 1
    held[0] = False
    assert q.release("m", [], lambda _w: held[0]).request_id == "a"  # type: ignore[union-attr]


# ---------------------------------------------------------------------- hold condition (pure)
# Workers have max_num_seqs=8, kv capacity 1000 blocks; hold threshold 0.95.
@pytest.mark.parametrize(
    ("in_flight", "num_waiting", "kv_used", "saturated"),
    [
        (0, 0, 0, False),  # idle
        (7, 0, 900, False),  # 7 < 8 seqs, 0.90 < 0.95
        (8, 0, 0, True),  # in_flight 8 >= max_num_seqs 8: the next one would wait
        (0, 1, 0, True),  # the worker reports a waiting request
        (0, 0, 950, True),  # 950 / 1000 = 0.95 >= 0.95
        (0, 0, 949, False),  # 0.949 < 0.95
    ],
)
def test_is_saturated(in_flight: int, num_waiting: int, kv_used: int, saturated: bool) -> None:
    fleet = make_fleet(1)
    w = fleet.get(WorkerId("w0"))
    assert w is not None
    fleet.apply_stats(w.worker_id, make_stats(num_waiting=num_waiting, kv_blocks_used=kv_used), now=0.0)
    for _ in range(in_flight):
        fleet.note_dispatch(w.worker_id)
    assert is_saturated(w, 0.95) is saturated


def test_other_replicas_requests_fill_the_batch_too() -> None:
    """With router replicas side by side, the others' open requests (from the worker's request events) count
    toward max_num_seqs before the worker's next Stats shows them waiting."""
    from switchyard.router.peer_mirror import PeerMirror
    from switchyard.router.policies.registry import make_policy
    from switchyard.workers.engine.kv_events import RequestAdmitted, RequestEnded

    fleet = make_fleet(1)
    w = fleet.get(WorkerId("w0"))
    assert w is not None
    for _ in range(5):
        fleet.note_dispatch(w.worker_id)
    mirror = PeerMirror("b", make_policy("e2"), fleet)
    mirror.apply(w.worker_id, "m", [RequestAdmitted(f"r{i}", "a", (), 10, 4) for i in range(2)], 0.0)
    assert (w.peer_in_flight, is_saturated(w, 0.95)) == (2, False)  # 5 + 2 < 8
    mirror.apply(w.worker_id, "m", [RequestAdmitted("r2", "a", (), 10, 4)], 0.0)
    assert (w.peer_in_flight, is_saturated(w, 0.95)) == (3, True)
    mirror.apply(w.worker_id, "m", [RequestEnded("r0", "a", 4, True)], 1.0)
    assert (w.peer_in_flight, is_saturated(w, 0.95)) == (2, False)
    mirror.forget_worker(w.worker_id, 2.0)
    assert w.peer_in_flight == 0


def test_should_hold_only_when_every_eligible_worker_is_saturated() -> None:
    fleet = make_fleet(2)
    fleet.apply_stats(WorkerId("w0"), make_stats(num_waiting=3), now=0.0)
    assert should_hold(fleet.routable("m")) is False  # w1 still has room
    fleet.apply_stats(WorkerId("w1"), make_stats(kv_blocks_used=990), now=0.0)
    assert should_hold(fleet.routable("m")) is True  # w0 waiting, w1 at 0.99 KV
    fleet.apply_stats(WorkerId("w1"), make_stats(kv_blocks_used=10), now=0.1)
    assert should_hold(fleet.routable("m")) is False  # capacity freed on w1: release


def test_should_hold_ignores_ineligible_workers_and_never_holds_with_none() -> None:
    fleet = make_fleet(2)
    fleet.apply_stats(WorkerId("w0"), make_stats(num_waiting=1), now=0.0)
    fleet.set_healthy(WorkerId("w1"), False)  # the free worker is not eligible
    assert should_hold(fleet.routable("m")) is True
    fleet.set_healthy(WorkerId("w0"), False)
    assert should_hold(fleet.routable("m")) is False  # no eligible worker: release, fail fast with UNAVAILABLE
