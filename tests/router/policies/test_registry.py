"""`make_policy(name, params)`: a policy's knobs set by name, on top of what its registry entry fixes."""

from __future__ import annotations

import pytest

from switchyard.router.policies.registry import POLICIES, config_of, make_policy, policy_params


def test_params_override_defaults_and_keep_the_entrys_own_settings() -> None:
    p = make_policy("switchyard-no_queue", {"externality_weight": "0.5"})
    assert (p.name, p.sy.queue_weight, p.sy.externality_weight) == ("switchyard-no_queue", 0.0, 0.5)
    base = make_policy("e2_base", {"history_window_s": 60})
    assert (base.name, base.cfg.enable_rebalancing, base.cfg.history_window_s) == ("e2_base", False, 60.0)
    pre = make_policy("preserve", {"t_mem": "0.9", "horizon": "50"})  # strings, as from a command line
    assert (pre.config.t_mem, pre.config.horizon, pre.config.beta) == (0.9, 50, 1.0)
    assert pre.tracker.horizon == 50  # built from the configured values, not patched afterwards


def test_every_configurable_policy_round_trips_its_own_knobs() -> None:
    for name, ctor in POLICIES.items():
        p = ctor()
        knobs = policy_params(p)
        if config_of(p) is None:
            assert knobs == {}
            continue
        again = make_policy(name, knobs)
        assert policy_params(again) == knobs and again.name == p.name


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("switchyard", {"nope": 1}, r"nope: Extra inputs are not permitted; its keys: .*externality_weight"),
        ("preserve", {"zzz": 1}, r"unknown parameters zzz; its keys: t_mem, beta"),
        ("preserve", {"horizon": 2.5}, r"horizon expects int"),
        ("smg_cache_aware", {"balance_abs_threshold": True}, r"expects int"),
        ("round_robin", {"seed": 1}, r"has no parameters"),
        ("smg_cache_aware", {"cache_threshold": "nan"}, r"cache_threshold expects float, got 'nan'"),
        ("switchyard", {"queue_weight": "nan"}, r"queue_weight: Input should be greater than or equal to 0"),
        ("no_such_policy", {}, r"unknown policy"),
    ],
)
def test_bad_params_name_the_policy_and_its_keys(name: str, params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(name, params)
