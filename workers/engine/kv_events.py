"""KV cache events with vLLM's semantics (`vllm/distributed/kv_events.py`), as plain frozen data.

Producers: the engine's block pool (simulated worker) and the vLLM ZMQ subscriber (real worker). Consumer: the
router's prefix view, through one ingestion path. Hashes are the uint64 event ids (low 64 bits of the digest).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
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


# Request lifecycle, in the same stream: which router replica sent which request to this worker, and when it got its
# first token and ended. Every replica subscribes to every worker, so each learns of the others' requests (their
# in-flight prefixes and load) from the workers, with no replica-to-replica channel (Switchyard's own; vLLM has none).
@dataclass(frozen=True, slots=True)
class RequestAdmitted:
    request_id: str
    origin: str  # the router replica that sent it (GenerateRequest.origin); "" = not a Switchyard router
    block_hashes: tuple[int, ...]  # its prompt's full blocks, as BlockStored will announce them once computed
    num_prompt_tokens: int
    max_tokens: int
    predicted_output_tokens: int = 0  # the sender's prediction; 0 = none
    lora_name: str | None = None
    cache_salt: str | None = None
    tenant: str = ""  # the API key's name the sender charged it to (its limits hold across replicas); "" = none


@dataclass(frozen=True, slots=True)
class RequestFirstToken:
    request_id: str
    origin: str


@dataclass(frozen=True, slots=True)
class RequestEnded:
    request_id: str
    origin: str
    num_output_tokens: int
    finished: bool  # False: aborted, cancelled or failed


RequestEvent = RequestAdmitted | RequestFirstToken | RequestEnded


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    seq: int  # monotonically increasing per worker, from 1
    ts: float  # when the engine step that produced the events ended (engine clock)
    events: tuple[KvEvent, ...] = field(default_factory=tuple)
    requests: tuple[RequestEvent, ...] = ()  # applied before `events` (an admission precedes its blocks)
    # the first part of a snapshot: its request events are every request open on the worker, none other
    snapshot: bool = False


# One cached block as a snapshot lists it: (hash, parent hash, its token ids, block size, LoRA name).
CachedBlock = tuple[int, int | None, tuple[int, ...], int, str | None]


def chain_stored(blocks: Iterable[CachedBlock]) -> list[BlockStored]:
    """The BlockStored events that re-announce `blocks` (parents before children), one per maximal chain.

    Why: a snapshot that announced each block alone cost a subscribing router ~17 µs per block on its event loop
    (a full cache, 52k blocks: 0.9 s to decode and for E2 to apply), and E2's radix tree built from it held one
    node per block (52k, against 503 from chains). A block continues the chain that ends at its parent, as
    vLLM stores a sequence's new blocks in one event; a second child of the same parent starts a chain of its
    own. A hash already announced is skipped (the pool may hold two blocks of one digest).
    """
    chains: list[tuple[list[int], int | None, list[int], int, str | None]] = []
    ends: dict[int, int] = {}  # last hash of a chain -> the chain's index, while it may still grow
    seen: set[int] = set()
    for h, parent, token_ids, block_size, lora_name in blocks:
        if h in seen:
            continue
        seen.add(h)
        i = ends.pop(parent, None) if parent is not None else None
        if i is not None and chains[i][3] == block_size and chains[i][4] == lora_name:
            chains[i][0].append(h)
            chains[i][2].extend(token_ids)
        else:
            i = len(chains)
            chains.append(([h], parent, list(token_ids), block_size, lora_name))
        ends[h] = i
    return [BlockStored(tuple(hs), p, tuple(t), bs, lora) for hs, p, t, bs, lora in chains]


def split_stored(events: Sequence[KvEvent], max_blocks: int) -> list[list[KvEvent]]:
    """`events` in order, cut into parts of at most `max_blocks` blocks (a BlockStored chain split where needed).
    Why: as one message, a full cache of unique prompts (64k blocks) was 4.25 MiB, past gRPC's default 4 MiB
    receive limit; and the router's event loop runs between parts."""
    parts: list[list[KvEvent]] = [[]]
    n = 0
    for ev in events:
        pieces: list[KvEvent] = [ev]
        if isinstance(ev, BlockStored) and len(ev.block_hashes) > max_blocks:
            hs, bs = ev.block_hashes, ev.block_size
            pieces = [
                BlockStored(
                    block_hashes=hs[j : j + max_blocks],
                    parent_block_hash=hs[j - 1] if j else ev.parent_block_hash,
                    token_ids=ev.token_ids[j * bs : (j + max_blocks) * bs],
                    block_size=bs,
                    lora_name=ev.lora_name,
                )
                for j in range(0, len(hs), max_blocks)
            ]
        for piece in pieces:
            k = 0 if isinstance(piece, AllBlocksCleared) else len(piece.block_hashes)
            if n + k > max_blocks and parts[-1]:
                parts.append([])
                n = 0
            parts[-1].append(piece)
            n += k
    return parts
