"""`bench soak` end to end over real processes (a few seconds), and its steady/growing verdict."""

from __future__ import annotations

import json
from pathlib import Path

from switchyard.bench import soak
from switchyard.bench.soak import Point, verdict


def _point(t: float, sent: int, rss: float) -> Point:
    return Point(t, sent, sent, 0, 0, rss, [50.0], 0.0)


def test_verdict_reads_the_second_half_against_the_half_way_size() -> None:
    flat = [_point(0, 0, 80.0), _point(10, 1000, 150.0), _point(20, 2000, 200.0), _point(30, 3000, 204.0),
            _point(40, 4000, 205.0)]
    v = verdict(flat, 0.05)  # warming up in the first half is fine: 200 → 205 MB is 2.5%
    assert v["steady"] is True and v["second_half_growth_mb"] == 5.0
    assert v["kb_per_1k_requests"] == 5.0 * 1024 / 2000 * 1000
    growing = [*flat[:3], _point(30, 3000, 230.0), _point(40, 4000, 260.0)]
    assert verdict(growing, 0.05)["steady"] is False
    assert verdict(flat[:2], 0.05)["steady"] is None


def test_soak_serves_every_request_and_samples_memory(tmp_path: Path) -> None:
    out = tmp_path / "soak"
    assert soak.main(["--duration", "4", "--rate", "25", "--workers", "2", "--sample-every", "1",
                      "--group-life", "2", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    points = result["points"]
    last = points[-1]
    assert len(points) >= 4 and last["sent"] > 50
    assert last["ok"] == last["sent"] and last["failed"] == 0 and last["in_flight"] == 0
    assert all(p["router_rss_mb"] > 10 and len(p["worker_rss_mb"]) == 2 for p in points)
    assert result["verdict"]["steady"] in (True, False)
    assert (out / "results.md").read_text().startswith("# bench soak") and (out / "rss.png").stat().st_size > 0
