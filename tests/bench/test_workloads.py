"""Synthetic workloads: arrival processes, length specs, shared-prefix groups."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.bench.traces import NS_GROUP, NS_UNIQUE, PromptFactory
from switchyard.bench.workloads import WorkloadSpec, inter_arrivals, make_workload, parse_length_dist


def test_length_specs():
    rng = np.random.default_rng(0)
    assert parse_length_dist("128")(rng, 3).tolist() == [128, 128, 128]
    u = parse_length_dist("uniform:10:12")(rng, 1000)
    assert u.min() == 10 and u.max() == 12
    assert parse_length_dist("normal:-50:1")(rng, 5).tolist() == [1] * 5  # clipped to >= 1
    with pytest.raises(ValueError):
        parse_length_dist("zipf:2")


@pytest.mark.parametrize(("arrival", "cv"), [("poisson", 1.0), ("gamma", 3.0), ("gamma", 0.5)])
def test_inter_arrival_mean_and_cv(arrival, cv):
    gaps = inter_arrivals(np.random.default_rng(1), arrival, rate=5.0, cv=cv, n=200_000)
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)  # 1 / 5 req/s
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_shared_prefix_groups():
    spec = WorkloadSpec(num_requests=50, prefix_groups=2, prefix_len=256, prompt_len="uniform:100:400")
    t = make_workload(spec, seed=7)
    assert t == make_workload(spec, seed=7)  # deterministic
    assert t.requests[0].arrival_s == 0.0
    for r in t.requests:
        (ns_g, g, n_g), (ns_u, i, n_u) = r.segments
        assert (ns_g, n_g, ns_u) == (NS_GROUP, 256, NS_UNIQUE)
        assert n_g + n_u == r.num_prompt_tokens >= 257  # at least one own token after the prefix
    pf = PromptFactory(16)
    by_group: dict[int, tuple[int, ...]] = {}
    for r in t.requests:
        prefix = pf.tokens(r)[:256]
        assert by_group.setdefault(r.segments[0][1], prefix) == prefix
    assert len(by_group) == 2 and by_group[0] != by_group[1]
