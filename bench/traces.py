"""Request traces for the simulator: parse JSONL traces with block hashes (Mooncake's, Qwen-Bailian's, ACDC's
offline batch jobs) and CSV traces (Azure's, BurstGPT's, splitwise-sim's), gzip-compressed or not, keep the rows
whose columns have given values (BurstGPT's one model, Qwen-Bailian's text requests), slice and rescale them in
time, and turn each request's prompt description into deterministic token ids and chained block hashes.

A prompt is described by *segments* `(namespace, key, length)`: equal `(namespace, key)` give identical tokens,
so prefix sharing in a trace (Mooncake's 512-token `hash_ids`, Bailian's 16-token ones, synthetic shared-prefix
groups) becomes real prefix sharing in the engines' caches. Tokens are drawn lazily, at arrival, and memoized per 512-token chunk.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import re
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import date
from functools import lru_cache
from itertools import groupby
from pathlib import Path

import numpy as np

from switchyard.ext.blockhash import block_digests, event_hashes, none_hash
from switchyard.workers.engine.perf_model import PerfProfile

# Segment namespaces: tokens of (namespace, key) never collide with another namespace's.
NS_MOONCAKE = 0  # key = a JSONL trace's block hash id (Mooncake: 512 tokens, Qwen-Bailian: 16)
NS_UNIQUE = 1  # key = request index; never shared
NS_GROUP = 2  # key = a synthetic shared-prefix group

MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's hash_ids cover 512 tokens each
BAILIAN_BLOCK_TOKENS = 16  # Qwen-Bailian's (unless the file name says `blksz_N`)
CHUNK_TOKENS = 512  # token generation and hash memo granularity
TOKEN_LOW, TOKEN_HIGH = 3, 32000  # generated ids avoid BOS/EOS/pad (0..2), stay inside a Llama-2 vocabulary

NAMED_TRACES: dict[str, str] = {
    "mooncake-conversation": "mooncake-fast25/conversation_trace.jsonl",
    "azure-code": "azure-llm-2023/AzureLLMInferenceTrace_code.csv",
    "azure-conv": "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
}

Segment = tuple[int, int, int]  # (namespace, key, number of tokens)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace, before any tokens exist."""

    request_id: str
    arrival_s: float  # seconds from the trace start (after any rescaling)
    num_prompt_tokens: int  # == sum of segment lengths
    # the trace's output length (> 0), target_output_tokens and max_tokens; 0 where the trace has none (ACDC's
    # content-hash jobs): `fill_outputs` draws them
    num_output_tokens: int
    segments: tuple[Segment, ...]  # the prompt, as token chunks; see the module docstring


@dataclass(frozen=True, slots=True)
class Trace:
    name: str
    requests: tuple[TraceRequest, ...]  # sorted by arrival_s
    source: str = ""  # file path, or a description of the generator
    has_prefix_identity: bool = False  # False: prompts are unique random tokens (Azure)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if len(self.requests) > 1 else 0.0

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span between the first and last arrival."""
        d = self.duration_s
        return (len(self.requests) - 1) / d if d > 0 else 0.0


# ---------------------------------------------------------------------------------------------------- finding data
def find_data_dir() -> Path:
    """The `shared/data` folder: $SWITCHYARD_DATA_DIR, else the first `shared/data` above cwd or this file."""
    env = os.environ.get("SWITCHYARD_DATA_DIR")
    if env:
        return Path(env)
    for start in (Path.cwd(), Path(__file__).resolve().parent):
        for d in (start, *start.parents):
            cand = d / "shared" / "data"
            if cand.is_dir():
                return cand
    raise FileNotFoundError("no shared/data folder found above cwd or the package; set SWITCHYARD_DATA_DIR")


def resolve_trace_path(name_or_path: str) -> tuple[str, Path]:
    """(trace name, file path) for a named trace or a path to a Mooncake-JSONL / Azure-CSV file.

    A path to one of the named traces' files gets that trace's name (and so its defaults).
    """
    if name_or_path in NAMED_TRACES:
        return name_or_path, find_data_dir() / NAMED_TRACES[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        known = ", ".join(sorted(NAMED_TRACES))
        raise FileNotFoundError(f"trace {name_or_path!r} is neither a file nor a known name ({known})")
    try:
        data_dir = find_data_dir().resolve()
    except FileNotFoundError:
        data_dir = None
    for name, rel in NAMED_TRACES.items():
        if data_dir is not None and path.resolve() == data_dir / rel:
            return name, path
    stem = Path(path.stem).stem if path.suffix.lower() == ".gz" else path.stem
    return stem.replace("_", "-").lower(), path


# ---------------------------------------------------------------------------------------------------- parsing
# A trace file is read into columns first (arrival, prompt and output tokens; Mooncake's block ids), and only the
# requests of the window asked for become `TraceRequest`s: a week of Azure 2024 (16.8M rows) is sliced, not held.
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")  # Azure LLM inference traces, 2023 and 2024
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")  # BurstGPT (Azure OpenAI via a campus)
# splitwise-sim's and SageServe's request traces (relative seconds; their other columns are not read)
SPLITWISE_COLUMNS = ("arrival_timestamp", "prompt_size", "token_size")

CSV_FORMATS = {"Azure": AZURE_COLUMNS, "BurstGPT": BURSTGPT_COLUMNS, "splitwise-sim": SPLITWISE_COLUMNS}

# ISO 8601 as the Azure traces write it: '2023-11-16 18:15:46.6805900' (2023: no zone, 7 digits) or
# '2024-05-10 00:00:00.009930+00:00' (2024: a UTC offset); 'T', 'Z', '+0000' and whole seconds are read too
_TIMESTAMP = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}):(\d{2}):(\d{2}(?:\.\d*)?)\s*(Z|[+-]\d{2}(?::?\d{2})?)?")


Where = Mapping[str, Collection[str]]  # column (CSV) or field (JSONL) -> the values a kept row has there


def parse_where(items: Iterable[str]) -> dict[str, list[str]]:
    """The benches' `--where KEY=VALUE` items -> `Where`; a key given twice keeps a row with either value."""
    out: dict[str, list[str]] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--where {item!r}: expected COLUMN=VALUE (e.g. Model=ChatGPT, type=text)")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


class _RowFilter:
    """Keeps a row when each `where` column's value (stripped; a JSON value as `str`) is one of its values. It
    counts the values it saw (the first `MAX_SEEN` distinct ones per column: a column of timestamps or ids must not
    hold a week's rows in memory), so a filter that keeps nothing names what the file has instead."""

    MAX_SEEN = 1000

    def __init__(self, where: Where | None, source: str) -> None:
        self.where = {k: frozenset(v) for k, v in (where or {}).items()}
        self.source = source
        self.seen: dict[str, Counter[str]] = {k: Counter() for k in self.where}
        self.kept = 0

    def keep(self, values: Sequence[str]) -> bool:
        """`values` in the order of `self.where`'s keys."""
        ok = True
        for (key, allowed), v in zip(self.where.items(), values, strict=True):
            seen = self.seen[key]
            if v in seen or len(seen) < self.MAX_SEEN:
                seen[v] += 1
            ok = ok and v in allowed
        self.kept += ok
        return ok

    def check(self) -> None:
        """Raises if the filter kept no row of a file that had some."""
        if self.where and not self.kept and any(self.seen.values()):
            have = "; ".join(
                f"{k}: {', '.join(repr(v) for v, _ in c.most_common(8))}" for k, c in self.seen.items()
            )
            asked = "; ".join(f"{k} in {sorted(v)}" for k, v in self.where.items())
            raise ValueError(f"{self.source}: no row has {asked} (most common values: {have})")


@dataclass(slots=True)
class _Rows:
    """A trace file's rows as columns, in file order; `arrival_s` on the file's own clock."""

    arrival_s: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    output_tokens: array = field(default_factory=lambda: array("q"))
    hash_ids: list[Sequence[int]] | None = None  # JSONL: each row's block ids
    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per block id

    def add(self, arrival_s: float, prompt_tokens: int, output_tokens: int | None) -> None:
        """A request with no prompt or no output is kept, as one token of each (a trace counts it as an arrival);
        an output the trace does not give (None) is stored as 0, for `fill_outputs`; a time that is not finite or
        a count below 0 is an error (the caller names the line)."""
        if not math.isfinite(arrival_s) or prompt_tokens < 0 or (output_tokens is not None and output_tokens < 0):
            raise ValueError(f"arrival {arrival_s} s, {prompt_tokens} prompt and {output_tokens} output tokens")
        self.arrival_s.append(arrival_s)
        self.prompt_tokens.append(max(1, prompt_tokens))
        self.output_tokens.append(0 if output_tokens is None else max(1, output_tokens))


def mooncake_segments(
    input_length: int, hash_ids: Sequence[int], index: int, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> tuple[Segment, ...]:
    """`block_tokens`-token segments, one per hash_id, the last truncated so the lengths sum to `input_length`.

    `len(hash_ids) == ceil(input_length / 512)` on every row of the published Mooncake trace; a row with fewer ids
    gets a unique tail, extra ids beyond the input are dropped.
    """
    segs: list[Segment] = []
    left = input_length
    for hid in hash_ids:
        if left <= 0:
            break
        n = min(block_tokens, left)
        segs.append((NS_MOONCAKE, int(hid), n))
        left -= n
    if left > 0:
        segs.append((NS_UNIQUE, index, left))
    return tuple(segs)


def _read_jsonl(lines: Iterable[str], source: str, where: Where | None = None) -> _Rows:
    """A JSONL trace of input_length, output_length, hash_ids and timestamp: Mooncake's (FAST'25: ms, 512-token
    blocks), Qwen-Bailian's (ATC'25, rows with a `chat_id`: seconds, 16-token blocks, or N where the file name
    says `blksz_N`), or ACDC's offline batch jobs (SOSP'26, in alibaba/ServeGen's `data/offline`: a `request_id`
    and no `timestamp`, the job submitted whole, so every row arrives at 0 in file order; its content-hash traces
    have no `output_length` either, stored as 0 for `fill_outputs`); only the rows `where` keeps. The first row
    says which fields the file has: a later row with or without `timestamp` or `output_length` where the first
    row differs, or a row without input_length, is an error.
    Outside Bailian's files and a `blksz_N` name, the tokens per block id are what the rows' ids say
    (`_block_tokens_of`: ACDC's are 16), else Mooncake's 512."""
    rows = _Rows(hash_ids=[])
    rf = _RowFilter(where, source)
    per_ms = True
    clock = outputs = True
    named = re.search(r"blksz_(\d+)", Path(source).name)
    block_votes: Counter[int] = Counter()
    first = True
    for lineno, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
            if first:
                if "chat_id" in row or "parent_chat_id" in row:  # Qwen-Bailian
                    per_ms = False
                    rows.block_tokens = BAILIAN_BLOCK_TOKENS
                clock, outputs = "timestamp" in row, "output_length" in row
                first = False
            if rf.where:
                missing = [k for k in rf.where if k not in row]
                if missing:
                    raise KeyError(f"no field {missing[0]!r} to select on")
                if not rf.keep([str(row[k]).strip() for k in rf.where]):
                    continue
            for key, has in (("timestamp", clock), ("output_length", outputs)):
                if (key in row) != has:
                    raise ValueError(f"{'no' if has else 'a'} {key!r} field, where the first row has "
                                     f"{'one' if has else 'none'}")
            t = float(row["timestamp"]) if clock else 0.0
            n_in, ids = int(row["input_length"]), row.get("hash_ids", ())
            rows.add(t / 1000.0 if per_ms else t, n_in, int(row["output_length"]) if outputs else None)
            rows.hash_ids.append(ids)
            if per_ms and not named and block_votes.total() < 1000:  # the first 1,000 rows that tell
                b = _block_tokens_of(n_in, len(ids))
                if b:
                    block_votes[b] += 1
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{source}: line {lineno}: not a JSONL trace row ({e!r}): {line[:120]!r}") from None
    if named:
        rows.block_tokens = int(named.group(1))
    elif block_votes:
        rows.block_tokens = block_votes.most_common(1)[0][0]
    if rows.block_tokens < 1:
        raise ValueError(f"{source}: blocks of {rows.block_tokens} tokens")
    rf.check()
    return rows


def _block_tokens_of(input_length: int, num_ids: int) -> int | None:
    """The power of two b (1..65536) with ceil(input_length / b) == num_ids, the tokens each of a row's block ids
    covers: None where no b fits or the row cannot tell (fewer than 2 ids: any b >= input_length fits one). With
    2 ids or more at most one power of two fits. The published Mooncake rows all fit 512, ACDC's 16."""
    if num_ids < 2 or input_length <= 0:
        return None
    b = 1
    while b <= 65536:
        if -(-input_length // b) == num_ids:
            return b
        b *= 2
    return None


def _parse_azure_timestamp(ts: str) -> tuple[int, float]:
    """'2023-11-16 18:15:46.6805900' or '2024-05-10 00:00:00.009930+00:00' -> (day ordinal, seconds since that
    day's midnight, in UTC: below 0 or past a day where the offset moves it); no zone is read as UTC.

    Kept as two numbers so subtracting two stamps does not lose the sub-millisecond digits to a large epoch.
    """
    m = _TIMESTAMP.fullmatch(ts.strip())
    if m is None:
        raise ValueError(f"not an ISO 8601 timestamp: {ts!r}")
    day, hh, mm, ss, zone = m.groups()
    ordinal, offset = _day_and_offset(day, zone)
    return ordinal, int(hh) * 3600 + int(mm) * 60 + float(ss) - offset


@lru_cache(maxsize=256)
def _day_and_offset(day: str, zone: str | None) -> tuple[int, int]:
    """(the date's ordinal, the zone's offset east of UTC in s): a week's trace has a handful of each, so each is
    read once, not once per row."""
    offset = 0
    if zone and zone != "Z":
        digits = zone[1:].replace(":", "")
        offset = int(digits[:2]) * 3600 + int(digits[2:] or 0) * 60
        offset = offset if zone[0] == "+" else -offset
    return date.fromisoformat(day).toordinal(), offset


def _read_csv(lines: Iterable[str], source: str, where: Where | None = None) -> _Rows:
    """An Azure LLM inference trace (`AZURE_COLUMNS`: 2023's or 2024's, arrivals relative to the earliest row),
    BurstGPT (`BURSTGPT_COLUMNS`) or splitwise-sim / SageServe (`SPLITWISE_COLUMNS`), both in relative seconds;
    CRLF or LF line ends. Other columns are read only to keep the rows `where` selects (BurstGPT's `Model` and
    `Log Type`)."""
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader, [])]
    for columns in CSV_FORMATS.values():
        if all(c in header for c in columns):
            t, n_in, n_out = (header.index(c) for c in columns)
            break
    else:
        expected = "; ".join(f"{', '.join(c)} ({name})" for name, c in CSV_FORMATS.items())
        raise ValueError(f"{source}: unknown CSV columns {header}: expected {expected}")
    rf = _RowFilter(where, source)
    unknown = [k for k in rf.where if k not in header]
    if unknown:
        raise ValueError(f"{source}: no column {unknown[0]!r} to select on; the columns are {header}")
    sel = [header.index(k) for k in rf.where]
    rows = _Rows()
    azure = columns == AZURE_COLUMNS
    days, secs = array("q"), array("d")
    for row in reader:
        if not row:
            continue
        try:
            if sel and not rf.keep([row[i].strip() for i in sel]):
                continue
            if azure:
                day, sec = _parse_azure_timestamp(row[t])
                days.append(day)
                secs.append(sec)
                arrival = 0.0  # set below, from the earliest row
            else:
                arrival = float(row[t])
            rows.add(arrival, int(row[n_in]), int(row[n_out]))
        except (ValueError, IndexError) as e:
            raise ValueError(f"{source}: line {reader.line_num}: {e}: {row}") from None
    if azure and days:
        day0, sec0 = min(zip(days, secs, strict=True))
        rows.arrival_s = array("d", (round((d - day0) * 86400 + (s - sec0), 7) for d, s in zip(days, secs, strict=True)))
    rf.check()
    return rows


def _window(
    rows: _Rows, name: str, source: str, start_s: float, duration_s: float | None, max_requests: int | None
) -> Trace:
    """The requests arriving in [first + start_s, first + start_s + duration_s), at most `max_requests`, re-based
    to 0: `take_slice` of the whole trace, building only those. Request i (`r{i}`, the key of its unique tokens) is
    the i-th arrival of the file (ties in file order)."""
    arrival = np.frombuffer(rows.arrival_s, dtype=np.float64)
    order = np.argsort(arrival, kind="stable")
    at = arrival[order]
    if len(at):
        at = at - at[0]  # the whole trace from 0, then the window from its first arrival: as take_slice does
    lo, hi = 0, len(at)
    if hi:
        t0 = float(at[0]) + start_s
        lo = int(np.searchsorted(at, t0, side="left"))
        if duration_s is not None:
            hi = int(np.searchsorted(at, t0 + duration_s, side="left"))
        if max_requests is not None:
            hi = min(hi, lo + max_requests)
    hi = max(lo, hi)
    base = float(at[lo]) if lo < hi else 0.0
    reqs = []
    for k, i, t in zip(range(lo, hi), order[lo:hi].tolist(), at[lo:hi].tolist(), strict=True):
        n_in = rows.prompt_tokens[i]
        segments = (
            mooncake_segments(n_in, rows.hash_ids[i], k, rows.block_tokens)
            if rows.hash_ids is not None
            else ((NS_UNIQUE, k, n_in),)
        )
        reqs.append(TraceRequest(f"r{k}", t - base, n_in, rows.output_tokens[i], segments))
    return Trace(name=name, requests=tuple(reqs), source=source, has_prefix_identity=rows.hash_ids is not None)


def parse_jsonl(lines: Iterable[str], name: str = "jsonl", source: str = "", where: Where | None = None) -> Trace:
    """A whole JSONL trace, Mooncake's or Qwen-Bailian's (`load_trace` reads a window of a file)."""
    return _window(_read_jsonl(lines, source or name, where), name, source, 0.0, None, None)


def parse_csv(lines: Iterable[str], name: str = "csv", source: str = "", where: Where | None = None) -> Trace:
    """A whole CSV trace of one of `CSV_FORMATS` (Azure's, BurstGPT's, splitwise-sim's). No prefix identity: every
    prompt is unique random tokens."""
    return _window(_read_csv(lines, source or name, where), name, source, 0.0, None, None)


def load_trace(
    name_or_path: str,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    where: Where | None = None,
) -> Trace:
    """A named trace or a file, sliced as `take_slice` would (the whole trace by default) after `where` kept its
    rows (`_RowFilter`: every key a column or field, the row's value one of the key's). A gzip file (by its magic
    bytes) is read as the file it holds; the format is taken from the extension (less `.gz`), else sniffed from the
    first line (a JSON object: Mooncake; else a CSV header)."""
    name, path = resolve_trace_path(name_or_path)
    with open(path, "rb") as raw:
        packed = raw.read(2) == b"\x1f\x8b"
    suffixes = [x.lower() for x in path.suffixes]
    suffix = suffixes[-2] if packed and len(suffixes) > 1 and suffixes[-1] == ".gz" else path.suffix.lower()
    # newline="" keeps the CRLF handling to the csv module (and JSON ignores a trailing \r anyway); utf-8-sig
    # drops a byte-order mark
    opener = gzip.open if packed else open
    with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
        first = f.readline()
        lines = _chain_first(first, f)
        if suffix in (".jsonl", ".json") or first.lstrip().startswith("{"):
            rows = _read_jsonl(lines, str(path), where)
        elif suffix == ".csv" or any(all(c in first for c in cols) for cols in CSV_FORMATS.values()):
            rows = _read_csv(lines, str(path), where)
        else:
            raise ValueError(
                f"cannot tell the format of {path}: expected a JSONL trace (Mooncake, Qwen-Bailian) or a CSV of "
                f"{', '.join(CSV_FORMATS)}"
            )
    return _window(rows, name, str(path), start_s, duration_s, max_requests)


def _chain_first(first: str, rest: Iterable[str]) -> Iterable[str]:
    """The first line, read to sniff the format, then the rest: a gzip stream is not seeked back."""
    if first:
        yield first
    yield from rest


# ---------------------------------------------------------------------------------------------------- time
def take_slice(trace: Trace, start_s: float = 0.0, duration_s: float | None = None, max_requests: int | None = None) -> Trace:
    """Requests arriving in [first + start_s, first + start_s + duration_s), at most `max_requests`, re-based to 0."""
    if not trace.requests:
        return trace
    t0 = trace.requests[0].arrival_s + start_s
    out: list[TraceRequest] = []
    for r in trace.requests:
        if r.arrival_s < t0:
            continue
        if duration_s is not None and r.arrival_s >= t0 + duration_s:
            break
        if max_requests is not None and len(out) >= max_requests:
            break
        out.append(r)
    base = out[0].arrival_s if out else 0.0
    return replace(trace, requests=tuple(replace(r, arrival_s=r.arrival_s - base) for r in out))


def scale_time(trace: Trace, time_scale: float) -> Trace:
    """Multiply every arrival time (and so every gap) by `time_scale`: < 1 compresses = more load."""
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if time_scale == 1.0:
        return trace
    return replace(trace, requests=tuple(replace(r, arrival_s=r.arrival_s * time_scale) for r in trace.requests))


def scale_to_rate(trace: Trace, rate: float) -> Trace:
    """Rescale arrivals so the mean rate (first to last arrival) is `rate` requests/s."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if trace.mean_rate <= 0:
        return trace
    return scale_time(trace, trace.mean_rate / rate)


def spread_ties(trace: Trace, seed: int = 0) -> Trace:
    """For a trace whose clock was read in coarse steps (Mooncake's conversation trace: 3 s): each request at time
    t moved to a seeded uniform time in [t, t + the clock's step), the requests of one stamp kept in the file's
    order. The step is the least gap between two distinct stamps: 3 s there, and on a trace with a fine clock and a
    few coincident stamps a few ms, which moves nothing far. Replayed as written, each step's ~10 requests reach
    the router within microseconds, as no clients send them. A trace without ties is returned as it is."""
    reqs = trace.requests
    times = np.unique(np.asarray([r.arrival_s for r in reqs], dtype=np.float64))
    if len(times) == len(reqs) or len(times) < 2:
        return trace  # no ties, or one stamp: no step to spread over
    step = float(np.diff(times).min())
    rng = np.random.default_rng(seed)
    out: list[TraceRequest] = []
    for t, group in groupby(reqs, key=lambda r: r.arrival_s):
        same = list(group)
        offsets = np.sort(rng.uniform(0.0, step, len(same)))
        out.extend(replace(r, arrival_s=t + float(o)) for r, o in zip(same, offsets, strict=True))
    return replace(trace, requests=tuple(out))


def has_clock(trace: Trace) -> bool:
    """False for a batch job's trace (every request at one instant: ACDC's, which have no timestamps) of two or
    more requests: no rate can be read from it, nor rescaled to."""
    reqs = trace.requests
    return len(reqs) < 2 or reqs[-1].arrival_s > reqs[0].arrival_s


def pace_batch(trace: Trace, rate: float, seed: int = 0) -> Trace:
    """A batch job's requests (`has_clock` False) sent as a Poisson stream at `rate` req/s in the file's order, the
    first at 0, the gaps from `default_rng(seed)`; a trace with a clock is returned as it is. Replayed as written,
    the whole job reaches the router at once."""
    if has_clock(trace):
        return trace
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, len(trace.requests))
    gaps[0] = 0.0
    times = np.cumsum(gaps).tolist()
    return replace(trace, requests=tuple(replace(r, arrival_s=t) for r, t in zip(trace.requests, times, strict=True)))


def fill_outputs(trace: Trace, draw: Callable[[np.random.Generator, int], np.ndarray], seed: int = 0) -> Trace:
    """The requests whose trace gives no output length (0: ACDC's content-hash jobs) get one from `draw(rng, n)`
    (`workloads.parse_length_dist`, values >= 1), `default_rng(seed)` in request order; the rest keep theirs."""
    missing = [i for i, r in enumerate(trace.requests) if r.num_output_tokens == 0]
    if not missing:
        return trace
    drawn = iter(np.maximum(1, draw(np.random.default_rng(seed), len(missing))).tolist())
    reqs = list(trace.requests)
    for i in missing:
        reqs[i] = replace(reqs[i], num_output_tokens=int(next(drawn)))
    return replace(trace, requests=tuple(reqs))


# ---------------------------------------------------------------------------------------------------- tokens, hashes
_M64 = (1 << 64) - 1
_U = np.uint64


def _chunk_base(seed: int, ns: int, key: int, c: int) -> int:
    return (
        seed * 0x9E3779B97F4A7C15 ^ (ns + 1) * 0xBF58476D1CE4E5B9 ^ key * 0x94D049BB133111EB ^ (c + 1) * 0xD6E8FEB86659FD93
    ) & _M64


def _splitmix_tokens(x: np.ndarray) -> np.ndarray:
    """splitmix64's output function of the counters `x` (uint64, in place), mapped into [TOKEN_LOW, TOKEN_HIGH)."""
    x ^= x >> _U(30)
    x *= _U(0xBF58476D1CE4E5B9)
    x ^= x >> _U(27)
    x *= _U(0x94D049BB133111EB)
    x ^= x >> _U(31)
    return (x % _U(TOKEN_HIGH - TOKEN_LOW) + _U(TOKEN_LOW)).astype(np.uint16)


def chunk_tokens(seed: int, ns: int, key: int, c: int) -> np.ndarray:
    """The 512 token ids of chunk `c` of segment (ns, key): splitmix64 of consecutive positions, mapped into
    [TOKEN_LOW, TOKEN_HIGH). A pure function (no RNG state), ~20 µs a chunk."""
    # wraps mod 2**64, as splitmix's counter does
    return _splitmix_tokens(np.arange(CHUNK_TOKENS, dtype=np.uint64) + _U(_chunk_base(seed, ns, key, c)))


def chunks_tokens(seed: int, pieces: Sequence[tuple[int, int, int, int]]) -> list[np.ndarray]:
    """The first `take` token ids of each piece's chunk, (ns, key, c, take): `chunk_tokens(...)[:take]` each, in
    one pass over all of them (a Qwen-Bailian prompt is ~140 chunks of 16 tokens: one call, not 140)."""
    takes = np.fromiter((p[3] for p in pieces), dtype=np.int64, count=len(pieces))
    bases = np.fromiter((_chunk_base(seed, ns, key, c) for ns, key, c, _ in pieces), dtype=np.uint64,
                        count=len(pieces))
    ends = np.cumsum(takes)
    offsets = np.arange(int(ends[-1]) if len(ends) else 0, dtype=np.uint64) - np.repeat(
        (ends - takes).astype(np.uint64), takes)
    return np.split(_splitmix_tokens(np.repeat(bases, takes) + offsets), ends[:-1])


class PromptFactory:
    """Deterministic prompt tokens and block hashes for trace requests, memoized per 512-token chunk.

    Tokens of chunk c of segment (ns, key) are `chunk_tokens(seed, ns, key, c)`, so a truncated segment is a
    prefix of the full one and equal keys give equal tokens. Shared chunks are kept as uint16 arrays (up to 1 KiB).
    Block hashes follow the workers' recipe (`ext.blockhash`); the memo maps (parent digest, ns, key, chunk) ->
    that chunk's block digests, which is what makes the Mooncake trace cheap (the same 512-token blocks recur
    under the same parents).
    """

    def __init__(
        self,
        block_size: int,
        seed: int = 0,
        hash_algo: str = "xxhash",
        hash_seed: str = "",
        max_memo_chunks: int = 400_000,
        max_token_chunks: int = 400_000,
    ) -> None:
        self.block_size = block_size
        self.seed = seed
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed
        self._none_digest = none_hash(hash_algo, hash_seed)
        self._chunk_tokens: dict[tuple[int, int, int], np.ndarray] = {}
        self._max_token_chunks = max_token_chunks
        self._digest_memo: dict[tuple[bytes, int, int, int], tuple[list[bytes], list[int]]] = {}
        self._max_memo_chunks = max_memo_chunks
        self._aligned = CHUNK_TOKENS % block_size == 0
        self.num_hash_memo_hits = 0
        self.num_hash_memo_misses = 0

    # -- tokens
    def tokens(self, req: TraceRequest) -> tuple[int, ...]:
        """The prompt's token ids: each chunk from the memo when it holds at least the tokens taken, the others
        made in one `chunks_tokens` pass and kept (as many as taken: 32 bytes for a 16-token block)."""
        parts: list[np.ndarray | None] = []
        missing: list[tuple[int, int, int, int]] = []
        at: list[int] = []
        memo = self._chunk_tokens
        for ns, key, n in req.segments:
            for c in range(math.ceil(n / CHUNK_TOKENS)):
                take = min(CHUNK_TOKENS, n - c * CHUNK_TOKENS)
                toks = memo.get((ns, key, c))
                if toks is not None and len(toks) >= take:
                    parts.append(toks if len(toks) == take else toks[:take])
                else:
                    at.append(len(parts))
                    missing.append((ns, key, c, take))
                    parts.append(None)
        if missing:
            for i, piece, toks in zip(at, missing, chunks_tokens(self.seed, missing), strict=True):
                parts[i] = toks
                if piece[0] != NS_UNIQUE:  # unique chunks never recur
                    if len(memo) >= self._max_token_chunks:
                        memo.clear()  # NOTE: crude bound (<= 400 MiB); trace slices stay well under it
                    memo[piece[:3]] = toks.copy()  # not a view: it would keep the whole pass alive
        return tuple(np.concatenate(parts).tolist()) if parts else ()

    # -- hashes
    def block_hashes(self, req: TraceRequest, tokens: Sequence[int] | None = None) -> tuple[int, ...]:
        """uint64 event hashes of the prompt's full blocks, equal to what the engines' KV events carry.

        `tokens` (this request's, from `tokens()`) saves regenerating them; misses hash slices of it.
        """
        if tokens is None:
            tokens = self.tokens(req)
        bs = self.block_size
        algo = self.hash_algo
        parent = self._none_digest
        memo = self._digest_memo
        events: list[int] = []
        pos = 0
        for ns, key, n in req.segments:
            for c in range(math.ceil(n / CHUNK_TOKENS)):
                take = min(CHUNK_TOKENS, n - c * CHUNK_TOKENS)
                if not self._aligned or pos % bs:
                    # unaligned chunk boundary: hash the rest of the prompt directly
                    start = pos - pos % bs
                    digs = block_digests(tokens[start:], bs, algo, parent=parent, start_block=start // bs)
                    events.extend(event_hashes(digs))
                    return tuple(events)
                mkey = (parent, ns, key, c)
                hit = memo.get(mkey)
                nfull = take // bs
                if hit is None or len(hit[0]) < nfull:
                    self.num_hash_memo_misses += 1
                    digs = block_digests(tokens[pos : pos + take], bs, algo, parent=parent, start_block=pos // bs)
                    hit = (digs, event_hashes(digs))
                    if ns != NS_UNIQUE:
                        if len(memo) >= self._max_memo_chunks:
                            memo.clear()  # NOTE: crude bound; the trace slices we run fit well under it
                        memo[mkey] = hit
                else:
                    self.num_hash_memo_hits += 1
                if nfull:
                    events.extend(hit[1][:nfull] if nfull < len(hit[1]) else hit[1])
                    parent = hit[0][nfull - 1]
                pos += take
        return tuple(events)


def bound_cached_tokens(trace: Trace, prompts: PromptFactory, capacity_blocks: int | None = None) -> list[int]:
    """Per request, in trace order, the prompt tokens one worker serving the whole trace in arrival order finds
    cached: the most any fleet can reuse for it, whatever the routing (a block can only hit if an earlier request
    stored it), when `capacity_blocks` is None. With `capacity_blocks` (the fleet's KV blocks pooled into one LRU
    cache): a reference for what the fleet's capacity allows, not a bound (a partitioned cache and a smarter
    eviction order can both beat one LRU). As in vLLM, a prompt's last token is always computed: at most
    (P - 1) // block_size blocks hit."""
    lru: OrderedDict[int, None] = OrderedDict()
    out: list[int] = []
    bs = prompts.block_size
    for r in trace.requests:
        tokens = prompts.tokens(r)
        hashes = prompts.block_hashes(r, tokens)
        k, cap = 0, max(0, (len(tokens) - 1) // bs)
        while k < cap and hashes[k] in lru:
            k += 1
        out.append(k * bs)
        for h in hashes:
            lru[h] = None
            lru.move_to_end(h)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return out


def prefix_hit_bound(trace: Trace, prompts: PromptFactory, capacity_blocks: int | None = None) -> float:
    """The prefix-cache hit ratio (cached / prompt tokens) of `bound_cached_tokens`: unbounded, an upper bound on
    any fleet's ratio; a policy at it gains nothing more from reuse, only from when and where the misses run."""
    total = sum(r.num_prompt_tokens for r in trace.requests)
    return sum(bound_cached_tokens(trace, prompts, capacity_blocks)) / total if total else 0.0


def ttft_floors(trace: Trace, prompts: PromptFactory, profile: PerfProfile, max_batched_tokens: int) -> np.ndarray:
    """Per request, in trace order, the least TTFT any router can give it on engines of `profile`.

    Why it bounds: say the request finds its first j blocks cached. Each of them was stored at the end of an
    iteration that began no earlier than the arrival of the first request holding it, and lasted at least
    `min_prefill_iteration_s`; the request's own first step begins after they are stored (hits are read at
    admission). So TTFT >= max(0, max over those blocks of (first arrival + one prefill iteration) - arrival) +
    the rest of its prompt computed in the fewest iterations (`PerfProfile.first_token_floor_s`). A block whose
    first holder arrives with it or after it was computed inside its TTFT, on its own worker, so it counts as
    computed; the floor is the least over j up to the leading blocks an earlier arrival held. A burst's shared
    prefix is therefore no request's of that burst, and the floor moves with the rate a trace is rescaled to.
    Queueing, batching and every miss only add, so a policy's TTFT mean or any percentile over these requests is
    at least the same statistic here. `trace.requests` are in arrival order."""
    lead = profile.min_prefill_iteration_s()
    first: dict[int, float] = {}  # block hash -> arrival of the first request holding it
    bs = prompts.block_size
    out = np.empty(len(trace.requests))
    for i, r in enumerate(trace.requests):
        tokens = prompts.tokens(r)
        hashes = prompts.block_hashes(r, tokens)
        p, t, cap = len(tokens), r.arrival_s, max(0, (len(tokens) - 1) // bs)
        best = profile.first_token_floor_s(p, 0, max_batched_tokens)
        ready = -math.inf  # when the first j blocks can all be stored
        for j in range(cap):
            seen = first.get(hashes[j], math.inf)
            if seen >= t:
                break
            if seen + lead > ready:  # the wait grows at block j: the cheapest with the wait before it is j blocks
                if j:
                    best = min(best, max(0.0, ready - t) + profile.first_token_floor_s(p - j * bs, j * bs,
                                                                                    max_batched_tokens))
                ready = seen + lead
        else:
            j = cap
        if j:
            best = min(best, max(0.0, ready - t) + profile.first_token_floor_s(p - j * bs, j * bs, max_batched_tokens))
        for h in hashes:
            first.setdefault(h, t)
        out[i] = best
    return out
