"""Reference implementation of vLLM's chained prefix-cache block hash (obviously correct, not fast).

vLLM v1 (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`), as reproduced on this machine
(`shared/specs/vllm-and-peer-routers.md`, "Block hash"):

    NONE_HASH = hash_fn("vllm-none-hash")                   # chain seed, deterministic unless PYTHONHASHSEED
    h_i       = hash_fn((h_{i-1} or NONE_HASH, tuple(block_i_tokens), extra_keys_i))
    hash_fn(x) = sha256(pickle.dumps(x, protocol=5)).digest()         # "sha256"
               = xxh3_128(pickle.dumps(x, protocol=5)).digest()       # "xxhash"
    event id  = int.from_bytes(h_i, "big") & (2**64 - 1)             # KV events carry the low 64 bits

extra_keys_i is None, or a tuple of: the LoRA name (every block) then the cache salt (first block only).
Chaining always uses the full digest; only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

HASH_ALGOS = ("sha256", "xxhash")
_MASK64 = (1 << 64) - 1


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _xxhash(obj: Any) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def hash_fn(algo: str) -> Callable[[Any], bytes]:
    """The digest function for a vLLM `--prefix-caching-hash-algo` name."""
    if algo == "sha256":
        return _sha256
    if algo == "xxhash":
        return _xxhash
    raise ValueError(f"unsupported block hash algorithm {algo!r}; expected one of {HASH_ALGOS}")


def none_hash(algo: str, seed: str = "") -> bytes:
    """The chain seed: vLLM's NONE_HASH ("vllm-none-hash"), or a custom seed string."""
    return hash_fn(algo)(seed or "vllm-none-hash")


def extra_keys(block_index: int, lora_name: str | None, cache_salt: str | None) -> tuple[Any, ...] | None:
    """vLLM's per-block extra keys: LoRA name on every block, cache salt on the first block only."""
    keys: list[Any] = []
    if lora_name:
        keys.append(lora_name)
    if cache_salt and block_index == 0:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def block_digests(
    token_ids: Sequence[int],
    block_size: int,
    algo: str = "xxhash",
    *,
    parent: bytes | None = None,
    start_block: int = 0,
    lora_name: str | None = None,
    cache_salt: str | None = None,
    seed: str = "",
) -> list[bytes]:
    """Full digests of every full block of `token_ids`, chained from `parent` (NONE_HASH when None).

    `start_block` is the index of the first block of `token_ids` in the whole sequence (it decides where the
    cache salt goes), so a caller can extend an existing chain incrementally.
    """
    fn = hash_fn(algo)
    prev = parent if parent is not None else none_hash(algo, seed)
    out: list[bytes] = []
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        prev = fn((prev, block, extra_keys(start_block + i, lora_name, cache_salt)))
        out.append(prev)
    return out


def to_event_hash(digest: bytes) -> int:
    """The uint64 id that vLLM's KV events carry for a block (the digest's low 64 bits)."""
    return int.from_bytes(digest, "big") & _MASK64


def event_hashes(digests: Sequence[bytes]) -> list[int]:
    """`[to_event_hash(d) for d in digests]`, unpacked in one call where the digests share a length that is a
    multiple of 8 (a prompt's blocks: one per block, so this runs for every request the router admits)."""
    n = len(digests)
    if n < 4:
        return [to_event_hash(d) for d in digests]
    size = len(digests[0])
    if size == 0 or size % 8 or len(set(map(len, digests))) != 1:
        return list(map(to_event_hash, digests))
    k = size >> 3
    return list(struct.unpack(f">{k * n}Q", b"".join(digests))[k - 1 :: k])
