"""EngineCore: one vLLM v1-like engine iteration at a time, on a clock the caller supplies.

CONTRACT (fixed; other modules code against it):

    core = EngineCore(EngineConfig(...), profile)        # profile: perf_model.PerfProfile
    core.add_request(EngineRequest(...))                 # queued as waiting; ValueError if prompt > max_model_len
    core.abort_request(request_id) -> bool               # frees its blocks; True if it was known
    core.has_unfinished() -> bool
    core.step(now_s, horizon_s=None) -> StepResult | None
        Schedules and executes one iteration starting at now_s (None when there is nothing to run).
        The result's outputs become visible at now_s + result.duration_s; the caller delivers them then and
        must not call step() again before that time. With horizon_s set, the engine may fast-forward several
        decode-only iterations exactly (same state and outputs as stepping one by one), stopping before any
        iteration that would start at or after horizon_s, before any finish, and before any preemption;
        result.num_iterations says how many ran; outputs then hold every token produced (per request, in
        order) and the finish of at most the last iteration.
    core.take_kv_events() -> list[KvEvent]               # events since the last call, in engine order
    core.snapshot_kv_events() -> list[KvEvent]           # BlockStored events re-announcing every cached block
                                                         # (parents before children) for a fresh subscriber
    core.stats() -> EngineStats
    core.config, core.profile                            # read-only
    core.block_hash_algo -> str ; core.block_hash_seed -> str

Requests carry token ids only. Output token ids are deterministic from (seed or request_id, position).
"""
