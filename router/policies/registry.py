"""Policy name -> constructor. A policy's registry key matches its file name."""

from __future__ import annotations

from collections.abc import Callable

from switchyard.router.policies.aibrix_prefix import AibrixPrefix
from switchyard.router.policies.base import Policy
from switchyard.router.policies.dynamo_kv import DynamoKv
from switchyard.router.policies.least_request import LeastRequest
from switchyard.router.policies.llmd_scorer import LlmdScorer
from switchyard.router.policies.power_of_two import PowerOfTwo
from switchyard.router.policies.preble_e2 import PrebleE2, PrebleE2Base, PrebleE2Rebal
from switchyard.router.policies.preserve import MinUsage, Preserve
from switchyard.router.policies.round_robin import RoundRobin
from switchyard.router.policies.smg_cache_aware import SmgCacheAware
from switchyard.router.policies.smg_least_load import SmgLeastLoad
from switchyard.router.policies.switchyard_policy import ABLATIONS as SWITCHYARD_ABLATIONS
from switchyard.router.policies.switchyard_policy import Switchyard

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

DEFAULT_POLICY = "switchyard"  # README "Switchyard's default policy": measured against e2, smg_cache_aware, least_request


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
