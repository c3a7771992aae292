"""Synthetic multi-turn conversations, written as Qwen-Bailian JSONL rows and read back by that trace's parser.

The real Bailian traces (ATC'25 `qwen_trace*`) are not in `shared/data`; this makes traces of their shape, so a
policy's handling of follow-up turns (a conversation coming back to the worker that caches its history, or not)
can be measured from one command: `switchyard bench sim --trace conversations`.

Each request either opens a conversation (its prompt 20-199 fresh blocks) or, with probability `follow_frac`,
continues one picked uniformly from the earlier requests (the last `recent` of them; 0: any), its prompt that
request's blocks plus 5-59 fresh ones, so it shares that whole prefix. Each prompt's last block is cut short by
0-15 tokens; outputs are uniform in [1, output_max). Arrivals are Poisson at `rate`. Every draw comes from one
`random.Random(seed)` in a fixed order, so a trace is the same on every machine, and its first n requests do not
depend on `num_requests`.

The rows go through `traces.parse_jsonl` exactly as a Bailian file's would (block ids expanded into deterministic
tokens, 16 per block), so `conversation_rows` written to a file and loaded with `--trace FILE_blksz_16.jsonl`
gives the same trace.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from switchyard.bench.traces import BAILIAN_BLOCK_TOKENS, Trace, parse_jsonl

NAME = "conversations"
FIRST_BLOCKS = (20, 200)  # an opening prompt's blocks, [lo, hi)
TURN_BLOCKS = (5, 60)  # the blocks a follow-up adds, [lo, hi)


@dataclass(frozen=True, slots=True)
class ConversationSpec:
    num_requests: int = 5000
    rate: float = 8.0  # Poisson arrivals per second
    follow_frac: float = 0.5  # the share of requests that continue an earlier one
    recent: int = 0  # a follow-up continues one of the last `recent` requests (0: any earlier one)
    output_max: int = 500  # outputs uniform in [1, output_max)

    def __post_init__(self) -> None:
        if self.num_requests < 0 or self.rate <= 0 or not 0.0 <= self.follow_frac <= 1.0:
            raise ValueError(f"bad conversation spec: {self}")
        if self.recent < 0 or self.output_max < 2:
            raise ValueError(f"bad conversation spec: {self}")


def conversation_rows(spec: ConversationSpec, seed: int = 0) -> Iterator[dict[str, Any]]:
    """The trace's rows, in Bailian's JSONL fields (one turn per row; `parent_chat_id` -1, as the prefix is carried
    by `hash_ids`)."""
    rng = random.Random(seed)
    next_id = 0
    earlier: list[list[int]] = []
    t = 0.0
    for i in range(spec.num_requests):
        t += rng.expovariate(spec.rate)
        if earlier and rng.random() < spec.follow_frac:
            base = rng.choice(earlier[-spec.recent:] if spec.recent else earlier)
            grow = rng.randrange(*TURN_BLOCKS)
        else:
            base, grow = [], rng.randrange(*FIRST_BLOCKS)
        ids = base + list(range(next_id + 1, next_id + grow + 1))
        next_id += grow
        earlier.append(ids)
        n = len(ids) * BAILIAN_BLOCK_TOKENS - rng.randrange(0, BAILIAN_BLOCK_TOKENS)
        yield {"chat_id": i, "parent_chat_id": -1, "timestamp": round(t, 3), "input_length": n,
               "output_length": rng.randrange(1, spec.output_max), "type": "text", "turn": 1, "hash_ids": ids}


def make_conversations(spec: ConversationSpec, seed: int = 0) -> Trace:
    """The trace as `load_trace` would read its rows from a Bailian JSONL file."""
    return parse_jsonl((json.dumps(row) for row in conversation_rows(spec, seed)), name=NAME,
                       source=f"synthetic {spec}, seed {seed}")
