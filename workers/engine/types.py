"""Plain data crossing the engine's boundary: requests in, step results and stats out."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.Enum):
    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS (simulated stop point) when ignore_eos is false
    ABORT = "abort"


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int  # > 0
    arrival_s: float  # engine clock when it was added
    ignore_eos: bool = False
    seed: int | None = None  # deterministic output tokens (and the EOS point when ignore_eos is false)
    priority: int = 0  # lower runs first when the scheduler uses priorities
    predicted_output_tokens: int = 0  # 0 = no hint
    lora_name: str | None = None
    cache_salt: str | None = None
    # Simulation only: the output length to produce when ignore_eos is false (a trace's real output length).
    # None: the simulated EOS point is derived from the seed.
    target_output_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: tuple[int, ...]  # usually 1 per decode step; empty for a prefill chunk
    finish_reason: FinishReason | None = None  # set when the request finished in this step
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (set once scheduled)
    num_output_tokens: int = 0  # total so far


@dataclass(frozen=True, slots=True)
class StepResult:
    """One engine iteration, scheduled at `start_s`; its outputs become visible at `start_s + duration_s`."""

    start_s: float
    duration_s: float
    outputs: tuple[RequestOutput, ...] = field(default_factory=tuple)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_iterations: int = 1  # > 1 when decode-only iterations were fast-forwarded


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int  # cumulative, tokens
    prefix_cache_hits: int  # cumulative, tokens
    num_iterations: int
    num_preemptions: int
    num_waiting_uncached_tokens: int
    prompt_tokens_total: int  # cumulative
    generation_tokens_total: int  # cumulative
    num_requests_received: int = 0  # cumulative: requests added, however many routers sent them
