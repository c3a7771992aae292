"""Smoke test of `bench snapshot` at a toy cache size (~1 s)."""

from __future__ import annotations

import json
from pathlib import Path

from switchyard.bench.micro import snapshot
from switchyard.workers.sim_worker import SNAPSHOT_BATCH_BLOCKS


def test_snapshot_bench_compares_chains_with_one_event_per_block(tmp_path: Path) -> None:
    blocks = SNAPSHOT_BATCH_BLOCKS + 1000  # past one batch
    rc = snapshot.main(["--blocks", str(blocks), "--policies", "e2", "round_robin", "--out", str(tmp_path),
                        "--no-plot"])
    assert rc == 0
    rows = {(r["format"], r["policy"]): r for r in json.loads((tmp_path / "snapshot.json").read_text())["rows"]}
    chains, one_each = rows["chains", "e2"], rows["one event per block", "e2"]
    # the same cache reaches the fleet's view either way: every usable block (the null block is never cached)
    assert {r["blocks_in_view"] for r in rows.values()} == {blocks - 1}
    assert one_each["events"] == blocks  # AllBlocksCleared + one per block, in one message
    assert one_each["batches"] == 1 and chains["batches"] == 2
    # a sequence (or branch) is one event and one tree node, not one per block
    assert chains["events"] < blocks // 50 and chains["tree_nodes"] < blocks // 50 < one_each["tree_nodes"]
    assert rows["chains", "round_robin"]["tree_nodes"] is None
    assert "| chains | e2 | 2 |" in (tmp_path / "snapshot.md").read_text()
