"""KV cache events with vLLM's semantics (`vllm/distributed/kv_events.py`), as plain frozen data.

Producers: the engine's block pool (simulated worker) and the vLLM ZMQ subscriber (real worker). Consumer: the
router's prefix view, through one ingestion path. Hashes are the uint64 event ids (low 64 bits of the digest).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]  # consecutive blocks of one sequence, in order
    parent_block_hash: int | None  # the block before the first one; None at the start of a sequence
    token_ids: tuple[int, ...]  # all tokens of the stored blocks (block_size x len(block_hashes))
    block_size: int
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]  # evicted from the cache (one or more)


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    seq: int  # monotonically increasing per worker, from 1
    ts: float  # when the engine step that produced the events ended (engine clock)
    events: tuple[KvEvent, ...] = field(default_factory=tuple)
