"""Policy name -> constructor. A policy's registry key matches its file name.

`make_policy(name, params)` also sets a policy's own knobs (the fields of the config it is built with: E2Config,
SwitchyardConfig, PreserveConfig, ...) from a mapping, e.g. the daemon's `[routing.params]`: an unknown key or a
value of the wrong kind is a ValueError that names the policy and its keys.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from switchyard.router.policies.aibrix_prefix import AibrixPrefix
from switchyard.router.policies.base import Policy
from switchyard.router.policies.dynamo_kv import DynamoKv, DynamoKvConfig
from switchyard.router.policies.least_request import LeastRequest
from switchyard.router.policies.llmd_scorer import LlmdScorer, LlmdScorerConfig
from switchyard.router.policies.oracle_partition import OraclePartition
from switchyard.router.policies.power_of_two import PowerOfTwo
from switchyard.router.policies.preble_e2 import PrebleE2, PrebleE2Base, PrebleE2Rebal
from switchyard.router.policies.preserve import MinUsage, Preserve
from switchyard.router.policies.round_robin import RoundRobin
from switchyard.router.policies.smg_cache_aware import SmgCacheAware, SmgCacheAwareConfig
from switchyard.router.policies.smg_least_load import SmgLeastLoad
from switchyard.router.policies.switchyard_policy import ABLATIONS as SWITCHYARD_ABLATIONS
from switchyard.router.policies.switchyard_policy import Switchyard


def _peer_mode(cls: Callable[[Any], Policy], config: Any, key: str) -> Callable[[], Policy]:
    """A peer baseline in one of its documented non-default modes, as a registry entry of its own (so one sweep can
    run it beside the default)."""

    def make() -> Policy:
        p = cls(config)
        p.name = key
        return p

    return make


POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_request": LeastRequest,
    "power_of_two": PowerOfTwo,
    # peer baselines (specs/peers.md), each file citing the peer source it reproduces
    "smg_cache_aware": SmgCacheAware,
    "smg_least_load": SmgLeastLoad,
    "dynamo_kv": DynamoKv,
    "llmd_scorer": LlmdScorer,
    "aibrix_prefix": AibrixPrefix,
    # their modes for router replicas side by side (README, "Router replicas side by side"): SMG's mesh, Dynamo's
    # --router-replica-sync, llm-d's precise (KV-event) prefix scorer
    "smg_mesh": _peer_mode(SmgCacheAware, SmgCacheAwareConfig(mesh=True), "smg_mesh"),
    "dynamo_kv_sync": _peer_mode(DynamoKv, DynamoKvConfig(replica_sync=True), "dynamo_kv_sync"),
    "llmd_precise": _peer_mode(LlmdScorer, LlmdScorerConfig(prefix_scorer="precise"), "llmd_precise"),
    # Preble's oracle-partition baseline (specs/preble.md §7.4): needs the workload offline, so simulator only
    "oracle_partition": OraclePartition,
    # Preble E2 (specs/preble.md), ablation order e2_base -> e2_rebal -> e2 (full); preble_e2 = e2 (file name)
    "e2": PrebleE2,
    "preble_e2": PrebleE2,
    "e2_base": PrebleE2Base,
    "e2_rebal": PrebleE2Rebal,
    # PreServe (specs/preserve.md §6): anticipation-aware routing and its MU baseline (both in preserve.py)
    "preserve": Preserve,
    "min_usage": MinUsage,
    # Switchyard's own cost (switchyard_policy.py) and its ablations, one term dropped each: switchyard-no_<term>
    "switchyard": Switchyard,
    **SWITCHYARD_ABLATIONS,
}

SIMULATOR_ONLY = frozenset({"oracle_partition"})  # policies that need the whole trace; the daemon refuses them
DEFAULT_POLICY = "switchyard"  # README "Switchyard's default policy": measured against e2, smg_cache_aware, least_request


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    """The policy registered as `name`, its config's fields overridden by `params` (none: the defaults)."""
    try:
        ctor = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    policy = ctor()
    if not params:
        return policy
    base = config_of(policy)
    if base is None:
        raise ValueError(f"policy {name!r} has no parameters (got {', '.join(params)})")
    configured = type(policy)(with_params(name, base, params))  # type: ignore[call-arg]
    configured.name = policy.name  # an ablation's registry key (set on the instance)
    return configured


def config_of(policy: Policy) -> Any | None:
    """The config object `policy` was built with (E2's `cfg`, the baselines' `config`), or None."""
    cfg = getattr(policy, "cfg", None) or getattr(policy, "config", None)
    return cfg if isinstance(cfg, BaseModel) or dataclasses.is_dataclass(cfg) else None


def policy_params(policy: Policy) -> dict[str, Any]:
    """Every knob of `policy` and its value (empty for a policy without a config)."""
    cfg = config_of(policy)
    if cfg is None:
        return {}
    return cfg.model_dump() if isinstance(cfg, BaseModel) else dataclasses.asdict(cfg)


def with_params(name: str, base: Any, params: Mapping[str, Any]) -> Any:
    """A copy of `base` with `params` set, validated: pydantic configs by their own field constraints, dataclass
    configs by their fields' types (strings from a command line or an environment are converted)."""
    if isinstance(base, BaseModel):
        try:
            return type(base).model_validate({**base.model_dump(), **params})
        except ValidationError as e:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors(include_url=False)
            )
            raise ValueError(f"policy {name!r}: {problems}; its keys: {', '.join(type(base).model_fields)}") from None
    hints = typing.get_type_hints(type(base))
    fields = [f.name for f in dataclasses.fields(base)]
    unknown = [k for k in params if k not in fields]
    if unknown:
        raise ValueError(f"policy {name!r}: unknown parameters {', '.join(unknown)}; its keys: {', '.join(fields)}")
    return dataclasses.replace(base, **{k: _convert(name, k, v, hints[k]) for k, v in params.items()})


def _convert(name: str, key: str, value: Any, kind: Any) -> Any:
    """`value` as a dataclass field of type `kind` (bool, int, float, str; other types are taken as given)."""
    try:
        if kind is bool:
            if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
                return value.strip().lower() in ("true", "1")
            if isinstance(value, bool):
                return value
            raise ValueError
        if kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind is float:
            if isinstance(value, bool) or math.isnan(number := float(value)):  # inf stays: "never" for a knob
                raise ValueError
            return number
        if kind is str:
            return str(value)
    except (TypeError, ValueError):
        raise ValueError(f"policy {name!r}: {key} expects {kind.__name__}, got {value!r}") from None
    return value
