"""Test factories: fleets, stats and requests built from plain numbers only."""

from __future__ import annotations

from switchyard.router.fleet import Fleet, StatsSample, WorkerInfo, WorkerState
from switchyard.router.policies.base import RoutingContext, WorkerId


def make_worker_info(
    i: int,
    model: str = "m",
    max_model_len: int = 4096,
    block_size: int = 16,
    kv_capacity_blocks: int = 1000,
    max_num_seqs: int = 8,
    perf_profile: str = "",
) -> WorkerInfo:
    return WorkerInfo(
        worker_id=WorkerId(f"w{i}"),
        model=model,
        max_model_len=max_model_len,
        block_size=block_size,
        kv_capacity_blocks=kv_capacity_blocks,
        max_num_seqs=max_num_seqs,
        address=f"127.0.0.1:{50100 + i}",
        perf_profile=perf_profile,
    )


def make_fleet(
    n: int,
    model: str = "m",
    max_model_len: int = 4096,
    block_size: int = 16,
    kv_capacity_blocks: int = 1000,
    max_num_seqs: int = 8,
    now: float = 0.0,
    perf_profile: str = "",
) -> Fleet:
    """`n` ready, healthy workers w0..w{n-1} of one model, in registration order, with empty stats ("" profile:
    the router fits each worker's cost online; a profile name: its `ProfileCost`)."""
    fleet = Fleet()
    fleet.set_time(now)
    for i in range(n):
        fleet.add_worker(
            make_worker_info(i, model, max_model_len, block_size, kv_capacity_blocks, max_num_seqs, perf_profile),
            state=WorkerState.READY,
            healthy=True,
        )
    return fleet


def make_stats(
    num_running: int = 0,
    num_waiting: int = 0,
    kv_blocks_used: int = 0,
    kv_blocks_total: int = 1000,
    prefix_cache_queries: int = 0,
    prefix_cache_hits: int = 0,
) -> StatsSample:
    return StatsSample(
        num_running=num_running,
        num_waiting=num_waiting,
        kv_blocks_used=kv_blocks_used,
        kv_blocks_total=kv_blocks_total,
        prefix_cache_queries=prefix_cache_queries,
        prefix_cache_hits=prefix_cache_hits,
    )


def make_requests(
    n: int,
    prompt_len: int = 32,
    shared_prefix: int = 0,
    model: str = "m",
    max_tokens: int = 16,
    block_size: int = 16,
    start_s: float = 0.0,
    gap_s: float = 0.0,
) -> list[RoutingContext]:
    """`n` contexts r0..r{n-1}; the first `shared_prefix` tokens are common, the rest unique per request.

    Block hashes here are stand-ins (the index of the block in a chain keyed by its tokens), not the workers'
    recipe: policy tests only need equal prefixes to give equal leading hashes.
    """
    out = []
    for i in range(n):
        tokens = tuple(range(shared_prefix)) + tuple(100_000 + i * prompt_len + k for k in range(prompt_len - shared_prefix))
        hashes: list[int] = []
        prev = 0
        for b in range(len(tokens) // block_size):
            prev = hash((prev, tokens[b * block_size : (b + 1) * block_size])) & (2**64 - 1)
            hashes.append(prev)
        out.append(
            RoutingContext(
                request_id=f"r{i}",
                model=model,
                prompt_token_ids=tokens,
                block_hashes=tuple(hashes),
                max_tokens=max_tokens,
                arrival_s=start_s + i * gap_s,
            )
        )
    return out
