"""EngineCore: one vLLM v1-like engine iteration at a time, on a clock the caller supplies.

CONTRACT (fixed; other modules code against it):

    core = EngineCore(EngineConfig(...), profile)        # profile: perf_model.PerfProfile
    core.add_request(EngineRequest(...))                 # queued as waiting; ValueError if prompt > max_model_len
    core.abort_request(request_id) -> bool               # frees its blocks; True if it was known
    core.has_unfinished() -> bool
    core.step(now_s, horizon_s=None) -> StepResult | None
        Schedules and executes one iteration starting at now_s (None when there is nothing to run: the drivers
        then wait for an arrival or an abort, so None never leaves a runnable request behind).
        The result's outputs become visible at now_s + result.duration_s; the caller delivers them then and
        must not call step() again before that time. With horizon_s set, the engine may fast-forward several
        decode-only iterations exactly (same state and outputs as stepping one by one), stopping before any
        iteration that would start at or after horizon_s, before any finish, and before any preemption;
        result.num_iterations says how many ran; outputs then hold every token produced (per request, in
        order) and the finish of at most the last iteration.
    core.take_kv_events() -> list[KvEvent]               # events since the last call, in engine order
    core.snapshot_kv_events() -> list[KvEvent]           # BlockStored events re-announcing every cached block
                                                         # (parents before children) for a fresh subscriber
    core.capture_kv_snapshot() -> Callable[[], list[KvEvent]]  # the same, read now, built by the function
                                                         # (which touches no engine state: any thread may call it)
    core.stats() -> EngineStats
    core.config, core.profile                            # read-only
    core.block_hash_algo -> str ; core.block_hash_seed -> str

Requests carry token ids only. Output token ids are deterministic from (seed or request_id, position).

Additions beyond the contract:
    core.config has num_kv_blocks and max_model_len resolved from the profile (never None after construction).
    add_request also raises ValueError for an empty prompt, max_tokens < 1, a duplicate live id, or a request
        whose prompt + max_tokens - 1 (capped at max_model_len) could never fit in the KV cache on its own.
    core.reset_prefix_cache() -> bool                    # AllBlocksCleared; refused (False) while blocks are in use
    core.scheduler, core.kv_cache_manager                # the layers below, for tests and introspection
    Fast-forward: one RequestOutput per request covering all its tokens; duration_s is the sum of the
    iteration times added in order (equal to stepping one by one up to float rounding of the final subtraction).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from switchyard.workers.engine.kv_cache_manager import KVCacheManager
from switchyard.workers.engine.kv_events import KvEvent
from switchyard.workers.engine.perf_model import PerfProfile
from switchyard.workers.engine.request import Request
from switchyard.workers.engine.scheduler import Scheduler
from switchyard.workers.engine.types import EngineRequest, EngineStats, RequestOutput, StepResult


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """vLLM engine arguments the simulation honours."""

    block_size: int = 16  # tokens per KV block (--block-size)
    num_kv_blocks: int | None = None  # KV blocks incl. vLLM's null block; None = the profile's capacity
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 8192  # token budget per iteration
    max_model_len: int | None = None  # prompt + output cap; None = the profile's
    enable_chunked_prefill: bool = True  # split long prompts across iterations by the remaining budget
    enable_prefix_caching: bool = True
    block_hash_algo: str = "xxhash"  # --prefix-caching-hash-algo: "xxhash" | "sha256"
    block_hash_seed: str = ""  # NONE_HASH seed; "" = vLLM's "vllm-none-hash" (PYTHONHASHSEED unset)
    vocab_size: int = 32000  # simulated tokens are drawn from [3, vocab_size)
    eos_token_id: int = 2  # emitted as the last token of a STOP finish
    scheduling: str = "fcfs"  # "fcfs" | "priority" (lower `priority` first, then arrival) | "preble_groups" | "lpm"
    num_priority_groups: int = 10  # preble_groups: P, groups by cached fraction of the prompt (specs/preble.md §5.6)
    priority_group_quota: int = 10  # preble_groups: k; group g admits up to (g + 1) × k requests in its step
    lpm_max_queue: int = 128  # lpm: SGLang sorts only while at most this many wait (then the queue keeps its order)


SCHEDULINGS = ("fcfs", "priority", "preble_groups", "lpm")


class EngineCore:
    """The simulated engine: Scheduler -> KVCacheManager -> BlockPool, timed by a PerfProfile."""

    def __init__(self, config: EngineConfig, profile: PerfProfile) -> None:
        if config.scheduling not in SCHEDULINGS:
            raise ValueError(f"unknown scheduling {config.scheduling!r}")
        if config.num_priority_groups < 1 or config.priority_group_quota < 1:
            raise ValueError("num_priority_groups and priority_group_quota must be >= 1")
        if config.vocab_size <= 3 or config.block_size < 1:
            raise ValueError("vocab_size must exceed 3 and block_size be positive")
        config = replace(
            config,
            num_kv_blocks=config.num_kv_blocks or profile.num_kv_blocks(config.block_size),
            max_model_len=config.max_model_len or profile.max_model_len,
        )
        assert config.num_kv_blocks is not None and config.max_model_len is not None
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < config.max_model_len:
            # a prompt longer than one iteration's budget could never be admitted, and would wait forever (vLLM's
            # SchedulerConfig refuses this configuration too)
            raise ValueError(
                f"max_num_batched_tokens {config.max_num_batched_tokens} < max_model_len {config.max_model_len}"
                " without chunked prefill"
            )
        self._config = config
        self._profile = profile
        self.kv_cache_manager = KVCacheManager(
            config.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.block_hash_algo,
            config.block_hash_seed,
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager, config.max_model_len)
        self._num_iterations = 0
        self._decode_time = lambda num_reqs, ctx: profile.iteration_time_s(0, 0, num_reqs, ctx)

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def profile(self) -> PerfProfile:
        return self._profile

    @property
    def block_hash_algo(self) -> str:
        return self._config.block_hash_algo

    @property
    def block_hash_seed(self) -> str:
        return self._config.block_hash_seed

    # -- requests ------------------------------------------------------------------------------------------
    def add_request(self, req: EngineRequest) -> None:
        cfg = self._config
        assert cfg.max_model_len is not None and cfg.num_kv_blocks is not None
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError(f"request {req.request_id}: empty prompt")
        if n > cfg.max_model_len:
            raise ValueError(
                f"request {req.request_id}: prompt of {n} tokens > max_model_len {cfg.max_model_len}"
            )
        if req.max_tokens < 1:
            raise ValueError(f"request {req.request_id}: max_tokens must be >= 1")
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request {req.request_id}: duplicate request id")
        need = min(n + req.max_tokens - 1, cfg.max_model_len)  # the last sampled token is never computed
        if -(-need // cfg.block_size) > cfg.num_kv_blocks - 1:
            raise ValueError(
                f"request {req.request_id}: {need} tokens can never fit in {cfg.num_kv_blocks - 1} blocks"
            )
        self.scheduler.add_request(Request(req, vocab_size=cfg.vocab_size))

    def prompt_block_hashes(self, request_id: str) -> tuple[int, ...]:
        """The event hashes of a queued request's full prompt blocks, as BlockStored will announce them (memoised on
        the request: the cache lookup at admission already computed most of them)."""
        r = self.scheduler.requests[request_id]
        n = r.num_prompt_tokens // self._config.block_size
        self.kv_cache_manager.ensure_block_hashes(r, n)
        return tuple(r.block_event_hashes[:n])

    def abort_request(self, request_id: str) -> bool:
        return self.scheduler.abort_request(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- stepping ------------------------------------------------------------------------------------------
    def step(self, now_s: float, horizon_s: float | None = None) -> StepResult | None:
        sched = self.scheduler
        if not sched.has_unfinished():
            return None
        plan = sched.schedule()
        while not plan.scheduled and plan.preempted_req_ids:
            # Under priority scheduling the request that could not grow may be its own victim, and the running
            # loop then stops (as vLLM's does) before the requests behind it, with nothing scheduled. vLLM's busy
            # loop schedules again at once; returning None here told the drivers "idle until an arrival", and
            # the rest hung. Each pass preempts a running request and admits none, so this ends.
            plan = sched.schedule()
        if not plan.scheduled:
            return None
        duration = self._profile.iteration_time_s(
            plan.num_prefill_tokens, plan.prefill_attn_pairs, plan.num_decode_reqs, plan.decode_context_tokens
        )
        outputs = sched.update_from_step(plan)
        self._num_iterations += 1
        if horizon_s is None or not sched.can_fast_forward(plan, outputs):
            return StepResult(
                now_s, duration, tuple(outputs), plan.num_prefill_tokens, plan.num_decode_reqs, 1
            )
        watch_head = plan.admission_blocked == "blocks" or (
            plan.admission_blocked == "budget" and not self._config.enable_chunked_prefill
        )
        k, end_s, tokens, finished = sched.fast_forward_decode(
            now_s + duration, horizon_s, self._decode_time, watch_head
        )
        if k == 0:
            return StepResult(now_s, duration, tuple(outputs), 0, plan.num_decode_reqs, 1)
        self._num_iterations += k
        fin = {o.request_id: o for o in finished}
        merged = []
        for o in outputs:
            more = tokens[o.request_id]
            f = fin.get(o.request_id)
            merged.append(
                RequestOutput(
                    o.request_id,
                    o.new_token_ids + tuple(more),
                    f.finish_reason if f else None,
                    o.num_prompt_tokens,
                    o.num_cached_tokens,
                    o.num_output_tokens + len(more),
                )
            )
        return StepResult(now_s, end_s - now_s, tuple(merged), 0, plan.num_decode_reqs * (k + 1), k + 1)

    # -- KV cache ------------------------------------------------------------------------------------------
    def take_kv_events(self) -> list[KvEvent]:
        return self.kv_cache_manager.take_events()

    def snapshot_kv_events(self) -> list[KvEvent]:
        return self.kv_cache_manager.block_pool.snapshot_events()

    def capture_kv_snapshot(self) -> Callable[[], list[KvEvent]]:
        return self.kv_cache_manager.block_pool.capture_snapshot()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        s = self.scheduler
        pool = self.kv_cache_manager.block_pool
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_used=pool.get_num_used_blocks(),
            kv_blocks_total=pool.num_blocks - 1,  # usable blocks (vLLM's null block excluded)
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_iterations=self._num_iterations,
            num_preemptions=s.num_preemptions,
            num_waiting_uncached_tokens=s.num_waiting_uncached_tokens,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            num_requests_received=s.num_requests_received,
        )
