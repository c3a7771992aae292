"""The engine's mutable per-request state (vLLM `vllm/v1/request.py`), and its deterministic simulated sampler.

Output token i of a request is a pure function of (seed, else a stable hash of the request id) and i, drawn from
[3, vocab_size) so it is never BOS/EOS/pad. The stop point when `ignore_eos` is false: `target_output_tokens`
when given, else a seeded draw, uniform on [1, max_tokens] (mean ~ max_tokens / 2). A stop before max_tokens
emits `eos_token_id` as the last token (finish STOP); reaching max_tokens is finish LENGTH (vLLM checks the
length cap first).
"""

from __future__ import annotations

import enum

import xxhash

from switchyard.workers.engine.types import EngineRequest, FinishReason

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_STOP_SALT = 0x5DEECE66D


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a cheap, well-spread 64-bit integer hash."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def token_base(request_id: str, seed: int | None) -> int:
    """The per-request sampler key: the seed when given, else xxh64 of the request id (stable across runs)."""
    if seed is not None:
        return _mix64(seed & _M64)
    return xxhash.xxh64_intdigest(request_id.encode())


def output_tokens(base: int, start: int, stop: int, vocab_size: int) -> list[int]:
    """Sampled ids of output positions [start, stop): 3 + mix64(base + (i + 1) * golden) % (vocab_size - 3)."""
    span = vocab_size - 3
    out = []
    for i in range(start, stop):
        x = (base + (i + 1) * _GOLDEN) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        out.append(3 + (x ^ (x >> 31)) % span)
    return out


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED = "finished"


class Request:
    """One request inside the engine. `all_token_ids` = prompt + sampled outputs (vLLM's layout)."""

    __slots__ = (
        "request_id",
        "num_prompt_tokens",
        "max_tokens",
        "arrival_s",
        "priority",
        "lora_name",
        "cache_salt",
        "all_token_ids",
        "num_output_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "num_preemptions",
        "status",
        "finish_reason",
        "stop_len",
        "base",
        "block_digests",
        "block_event_hashes",
        "uncached_tokens_estimate",
        "_digest_set",
    )

    def __init__(self, req: EngineRequest, *, vocab_size: int) -> None:
        self.request_id = req.request_id
        self.num_prompt_tokens = len(req.prompt_token_ids)
        self.max_tokens = req.max_tokens
        self.arrival_s = req.arrival_s
        self.priority = req.priority
        self.lora_name = req.lora_name
        self.cache_salt = req.cache_salt
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.num_output_tokens = 0
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set the first time it is scheduled
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.base = token_base(req.request_id, req.seed)
        # stop_len: the output count at which the request stops with EOS; None = only max_tokens ends it.
        if req.ignore_eos:
            self.stop_len: int | None = None
        elif req.target_output_tokens is not None:
            self.stop_len = max(1, min(req.target_output_tokens, req.max_tokens))
        else:
            self.stop_len = 1 + _mix64(self.base ^ _STOP_SALT) % req.max_tokens
        if self.stop_len is not None and self.stop_len >= self.max_tokens:
            self.stop_len = None  # LENGTH wins at max_tokens
        # Memoised chained block hashes of the full blocks of all_token_ids (full digests + uint64 event ids).
        self.block_digests: list[bytes] = []
        self.block_event_hashes: list[int] = []
        self.uncached_tokens_estimate = 0
        self._digest_set: frozenset[bytes] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def remaining_outputs(self, max_model_len: int) -> int:
        """Outputs still to sample before it finishes (the finishing one included)."""
        limit = self.max_tokens if self.stop_len is None else self.stop_len
        return min(limit - self.num_output_tokens, max_model_len - len(self.all_token_ids))

    def sample_tokens(self, n: int, vocab_size: int, eos_token_id: int) -> list[int]:
        """The next n output ids (the EOS at the stop point included), without appending them."""
        start = self.num_output_tokens
        toks = output_tokens(self.base, start, start + n, vocab_size)
        if self.stop_len is not None and start < self.stop_len <= start + n:
            toks[self.stop_len - 1 - start] = eos_token_id
        return toks

    def next_token(self, vocab_size: int, eos_token_id: int) -> int:
        """The next output id (sample_tokens(1, ...)[0] without the list)."""
        i = self.num_output_tokens
        if self.stop_len is not None and i + 1 == self.stop_len:
            return eos_token_id
        x = (self.base + (i + 1) * _GOLDEN) & _M64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return 3 + (x ^ (x >> 31)) % (vocab_size - 3)

    def finish_reason_now(self, max_model_len: int) -> FinishReason | None:
        """vLLM's check_stop after a token was appended: the length caps first, then the stop point."""
        if self.num_output_tokens >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            return FinishReason.LENGTH
        if self.stop_len is not None and self.num_output_tokens >= self.stop_len:
            return FinishReason.STOP
        return None

    def digest_set(self) -> frozenset[bytes]:
        """Its block digests as a set (memoised; only used while it waits, when the list does not grow)."""
        if self._digest_set is None or len(self._digest_set) < len(self.block_digests):
            self._digest_set = frozenset(self.block_digests)
        return self._digest_set

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens})"
        )
