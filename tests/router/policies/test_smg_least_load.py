"""smg_least_load: SMG's expected-wait score, worked examples (smg least_load.rs), in virtual time."""

from __future__ import annotations

import pytest
from factories import make_fleet, make_requests

from switchyard.router.fleet import StatsSample
from switchyard.router.policies.base import Decision, WorkerId
from switchyard.router.policies.smg_least_load import SmgLeastLoad, SmgLeastLoadConfig


def stats(uncached: int = 0, waiting: int = 0, kv_used: int = 0, tput: float = 0.0) -> StatsSample:
    return StatsSample(num_waiting=waiting, num_waiting_uncached_tokens=uncached, kv_blocks_used=kv_used,
                       kv_blocks_total=1000, generation_tokens_per_s=tput)


# (case, per-worker Stats, per-worker prompt lengths dispatched after the Stats, expected scores, expected pick)
CASES = [
    # w0: 2000 tok / 1000 tok/s = 2.0 s; w1: 1000 / 2000 = 0.5 s
    ("queued tokens over throughput", [stats(2000, tput=1000), stats(1000, tput=2000)], [[], []], [2.0, 0.5], "w1"),
    # w0: 0 + 0.15 * 0.5/(1-0.5) = 0.15 s; w1: 400 / 2000 (default tput) = 0.2 s
    ("kv barrier", [stats(kv_used=500), stats(400)], [[], []], [0.15, 0.2], "w0"),
    # w0: no token count -> 1 waiting x 1024 / 2000 = 0.512 s; w1: 1000 / 2000 = 0.5 s
    ("waiting requests x mean prefill", [stats(waiting=1), stats(1000)], [[], []], [0.512, 0.5], "w1"),
    # w0 got a 600-token request after its Stats: 600 / 2000 = 0.3 s; w1 idle: 0 s
    ("since-poll in-flight credit", [stats(), stats()], [[600], []], [0.3, 0.0], "w1"),
    # both: 200 queued + (300 + 500) since-poll = 1000 tok / 2000 = 0.5 s vs 1000 / 4000 = 0.25 s
    ("throughput differs", [stats(200), stats(200, tput=4000)], [[300, 500], [300, 500]], [0.5, 0.25], "w1"),
]


@pytest.mark.parametrize(("case", "samples", "sent", "want_scores", "want"), CASES, ids=[c[0] for c in CASES])
def test_worked_examples(case: str, samples: list, sent: list, want_scores: list, want: str) -> None:
    fleet, policy = make_fleet(len(samples)), SmgLeastLoad()
    for i, s in enumerate(samples):
        fleet.apply_stats(WorkerId(f"w{i}"), s, now=0.0)
    for i, lengths in enumerate(sent):
        for n in lengths:
            ctx = make_requests(1, prompt_len=n)[0]
            fleet.note_dispatch(WorkerId(f"w{i}"))
            policy.on_dispatch(ctx, Decision(worker_id=WorkerId(f"w{i}")), 0.0)
    pool = list(fleet.routable("m"))
    assert policy.scores(pool) == pytest.approx(want_scores)
    d = policy.select(make_requests(1)[0], fleet, 0.0)
    assert d is not None and d.worker_id == want


def test_new_stats_sample_resets_in_flight_credit() -> None:
    fleet, policy = make_fleet(2), SmgLeastLoad()
    for i in range(2):
        fleet.apply_stats(WorkerId(f"w{i}"), stats(), now=0.0)
    fleet.note_dispatch(WorkerId("w0"))
    policy.on_dispatch(make_requests(1, prompt_len=1000)[0], Decision(worker_id=WorkerId("w0")), 0.0)
    assert policy.scores(list(fleet.routable("m"))) == pytest.approx([0.5, 0.0])  # 1000 / 2000
    fleet.apply_stats(WorkerId("w0"), stats(), now=0.2)  # the poll now accounts for it
    assert policy.scores(list(fleet.routable("m"))) == pytest.approx([0.0, 0.0])


def test_missing_stats_dark_fleet_and_partial() -> None:
    fleet, policy = make_fleet(3), SmgLeastLoad()
    fleet.note_dispatch(WorkerId("w0"))
    fleet.note_dispatch(WorkerId("w0"))
    fleet.note_dispatch(WorkerId("w1"))
    # dark fleet: join-shortest-queue on in_flight 2, 1, 0
    assert policy.scores(list(fleet.routable("m"))) == [2.0, 1.0, 0.0]
    assert policy.select(make_requests(1)[0], fleet, 0.0).worker_id == "w2"  # type: ignore[union-attr]
    # w0 reports 1000 tok at 2000 tok/s = 0.5 s; unreported w1 = 0.5 + 1 x 1024 / 2000 = 1.012; w2 = 0.5 + 0
    fleet.apply_stats(WorkerId("w0"), stats(1000, tput=2000), now=0.0)
    assert policy.scores(list(fleet.routable("m"))) == pytest.approx([0.5, 1.012, 0.5])


def test_ties_are_spread_by_request_id_and_deterministic() -> None:
    fleet = make_fleet(4)
    picks = [SmgLeastLoad().select(c, fleet, 0.0).worker_id for c in make_requests(40)]  # type: ignore[union-attr]
    again = [SmgLeastLoad().select(c, fleet, 0.0).worker_id for c in make_requests(40)]  # type: ignore[union-attr]
    assert picks == again
    assert set(picks) == {"w0", "w1", "w2", "w3"}


def test_waiting_queue_veto() -> None:
    fleet, policy = make_fleet(2), SmgLeastLoad(SmgLeastLoadConfig(max_waiting_requests=2))
    fleet.apply_stats(WorkerId("w0"), stats(waiting=1), now=0.0)  # 1 waiting + 1 since-poll = 2 >= cap
    fleet.apply_stats(WorkerId("w1"), stats(400_000), now=0.0)  # 200 s of work, but under the cap
    fleet.note_dispatch(WorkerId("w0"))
    assert policy.select(make_requests(1)[0], fleet, 0.0).worker_id == "w1"  # type: ignore[union-attr]
    fleet.apply_stats(WorkerId("w1"), stats(waiting=2), now=0.0)
    assert policy.select(make_requests(1)[0], fleet, 0.0) is None
