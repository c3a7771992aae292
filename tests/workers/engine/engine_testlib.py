"""Engine test helpers (imported by the test files beside it): a small engine, requests from plain numbers."""

from __future__ import annotations

from switchyard.workers.engine.core import EngineConfig, EngineCore
from switchyard.workers.engine.profiles import get_profile
from switchyard.workers.engine.types import EngineRequest


def make_request(rid: str, prompt: list[int] | tuple[int, ...], max_tokens: int = 8, **kw) -> EngineRequest:
    kw.setdefault("ignore_eos", True)
    return EngineRequest(rid, tuple(prompt), max_tokens, kw.pop("arrival_s", 0.0), **kw)


def make_engine(**cfg) -> EngineCore:
    cfg.setdefault("max_model_len", 4096)
    cfg.setdefault("num_kv_blocks", 64)
    profile = cfg.pop("profile", "llama3-8b-a100")
    return EngineCore(EngineConfig(**cfg), get_profile(profile))
