"""The fleet's worker records: what policies read of a worker, derived from its Info and Stats."""

from __future__ import annotations

import dataclasses
import inspect
import types

from factories import make_fleet, make_stats

from switchyard.router.fleet import WorkerRecord
from switchyard.router.policies.base import WorkerId

W0 = WorkerId("w0")


def test_kv_usage_frac_follows_every_stats_sample_and_info_change() -> None:
    """`kv_usage_frac` is a slot set with `stats` and `info` (policies read it per worker per select): after each
    Stats sample and each Info change it is the blocks used over the sample's total, else over the worker's
    capacity, and 0 with neither."""
    fleet = make_fleet(1, kv_capacity_blocks=1000)
    rec = fleet.get(W0)
    assert rec is not None and rec.kv_usage_frac == 0.0
    t = 0.0
    for used, total, capacity in [(250, 500, 1000), (250, 0, 1000), (250, 0, 2000), (0, 0, 0), (3, 7, 0), (5, 0, 0)]:
        rec.info = dataclasses.replace(rec.info, kv_capacity_blocks=capacity)
        t += 1.0
        fleet.apply_stats(W0, make_stats(kv_blocks_used=used, kv_blocks_total=total), t)
        assert rec.kv_usage_frac == (used / (total or capacity) if total or capacity else 0.0)
    fleet.apply_stats(W0, make_stats(kv_blocks_used=300, kv_blocks_total=0), t + 1.0)
    assert rec.kv_usage_frac == 0.0  # no total, no capacity
    rec.info = dataclasses.replace(rec.info, kv_capacity_blocks=600)  # the capacity reported after the sample
    assert rec.kv_usage_frac == 0.5
    rec.stats = make_stats(kv_blocks_used=100, kv_blocks_total=400)  # set directly, as `apply_stats` does
    assert (rec.kv_usage_frac, rec.stats.kv_blocks_used, rec.worker_id) == (0.25, 100, W0)


def test_block_size_and_capacity_follow_every_info_change() -> None:
    """`block_size` and `kv_capacity_blocks` are slots set with `info` (E2 reads the block size once per select and
    once per M it prices): each Info change, direct or through `dataclasses.replace`, shows at once."""
    for name in ("block_size", "kv_capacity_blocks", "worker_id", "kv_usage_frac"):  # a slot's read calls nothing
        assert type(inspect.getattr_static(WorkerRecord, name)) is types.MemberDescriptorType, name
    fleet = make_fleet(1, kv_capacity_blocks=1000)
    rec = fleet.get(W0)
    assert rec is not None and (rec.block_size, rec.kv_capacity_blocks) == (rec.info.block_size, 1000)
    for bs, cap in [(32, 500), (16, 2000), (64, 0)]:
        rec.info = dataclasses.replace(rec.info, block_size=bs, kv_capacity_blocks=cap)
        assert (rec.block_size, rec.kv_capacity_blocks, rec.worker_id) == (bs, cap, W0)
    rec.stats = make_stats(kv_blocks_used=10, kv_blocks_total=20)  # a Stats sample leaves them as they were
    assert (rec.block_size, rec.kv_capacity_blocks) == (64, 0)
