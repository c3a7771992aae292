"""Preble's workloads (specs/preble.md §7.1-7.2, §9.3): seeded generators for its five datasets, shaped to the
statistics of its Table 1, the Azure 2023 mixed replay, and the Table-1 statistics computed back from a trace.

Each generator builds prompts from shared segments, so the sharing is real token-level prefix sharing in the
engines' caches (see `bench/traces.py`):

    toolbench    system ─┬─ tool instruction k (key portion) ─┬─ question      (T tools, uniform or Zipf)
                         │                                    └─ question ...
    agent        instruction+demo+first observation (key) ─ out₁ ─ obs₁ ─ out₂ ─ obs₂ ...   (one chain, request
                 t+1's prompt = request t's prompt + its output + the next observation)
    programming  demo system prompt ─ problem ─┬─ sample tail   (n samples of a problem arrive together)
    videoqa      video (key, ~99%) ─┬─ question                 (~8.6 questions per video)
    loogle       13-token system ─ document (key, ~94%) ─┬─ question   (~18 questions per document)

Lengths are gamma draws with Table 1's (mean, std) (rounded, >= 1), fitted so the *prompt* totals match; see
`TABLE1` and `workload_stats`, and `python -m switchyard.bench.preble_workloads` for the side-by-side table.
"""

from __future__ import annotations

import argparse
import csv
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from switchyard.bench.traces import (
    NS_UNIQUE,
    Segment,
    Trace,
    TraceRequest,
    _parse_azure_timestamp,
    load_trace,
    resolve_trace_path,
    scale_time,
    take_slice,
)

# Segment namespaces of these generators (bench/traces.py uses 0..2)
NS_SYSTEM = 10  # key = which workload's system prompt
NS_TOOL = 11  # key = tool id
NS_AGENT = 12  # key = a step's output or observation (reused by the chain's later requests)
NS_PROBLEM = 13  # key = problem id
NS_VIDEO = 14  # key = video id
NS_DOC = 15  # key = document id

AZURE_TIME_SCALE = 0.7  # "0.7x (42% more intensive request load)" [P §5.4]
AZURE_VIDEOQA_UID_BASE = 1 << 40  # keeps the VideoQA questions' unique keys apart from the ToolBench ones


@dataclass(frozen=True, slots=True)
class Table1Row:
    """One row of Preble's Table 1: each pair is (mean, std); fractions of the prompt in [0, 1]."""

    num_requests: int
    prompt_tokens: tuple[float, float]
    output_tokens: tuple[float, float]
    shared_prefix_frac: tuple[float, float]
    key_portion_frac: tuple[float, float]
    requests_per_key_portion: tuple[float, float]


TABLE1: dict[str, Table1Row] = {
    "toolbench": Table1Row(210415, (1835, 742), (43, 16), (0.85, 0.13), (0.76, 0.16), (39, 64)),
    "agent": Table1Row(7538, (2285, 471), (16, 13), (0.97, 0.14), (0.76, 0.12), (48, 8)),
    "programming": Table1Row(102840, (3871, 1656), (190, 343), (0.97, 0.074), (0.78, 0.13), (126, 2157)),
    "videoqa": Table1Row(8564, (9865, 5976), (4, 1.5), (0.88, 0.32), (0.99, 0.002), (8.6, 2)),
    "loogle": Table1Row(1951, (23474, 6105), (16, 9.9), (0.91, 0.24), (0.94, 0.15), (18, 8.6)),
}


# ---------------------------------------------------------------------------------------------------- helpers
def gamma_lengths(rng: np.random.Generator, mean: float, std: float, n: int, hi: int | None = None) -> np.ndarray:
    """`n` token counts with about this mean and std: gamma(shape (mean/std)², scale std²/mean), rounded, >= 1."""
    shape = (mean / std) ** 2
    x = np.maximum(1, np.rint(rng.gamma(shape, std * std / mean, n))).astype(np.int64)
    return np.minimum(x, hi) if hi is not None else x


def group_sizes(rng: np.random.Generator, mean: float, std: float, total: int) -> list[int]:
    """Sizes (each round(normal(mean, std)) >= 1) of consecutive groups that add up to exactly `total`."""
    sizes: list[int] = []
    left = total
    while left > 0:
        k = max(1, int(round(rng.normal(mean, std))))
        sizes.append(min(k, left))
        left -= sizes[-1]
    return sizes


def poisson_arrivals(rng: np.random.Generator, rate: float, n: int) -> np.ndarray:
    """`n` arrival times, the first at 0, exponential gaps with mean 1/rate."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    gaps = rng.exponential(1.0 / rate, n)
    return np.concatenate(([0.0], np.cumsum(gaps[1:]))) if n else np.zeros(0)


def _fit(unique: int, output: int, prefix: int, max_model_len: int | None) -> tuple[int, int]:
    """(unique tail, output) shrunk, tail first, so prefix + tail + output <= max_model_len (tail, output >= 1)."""
    if max_model_len is None:
        return unique, output
    over = prefix + unique + output - max_model_len
    if over > 0:
        unique = max(1, unique - over)
        output = max(1, min(output, max_model_len - prefix - unique))
    return unique, output


def _shared_cap(max_model_len: int | None, reserve: int) -> int | None:
    """The longest a shared portion may be so its requests' own tails and outputs still fit."""
    if max_model_len is None:
        return None
    return max(1, max_model_len - min(reserve, max_model_len // 4))


def _assemble(name: str, rows: list[tuple[tuple[Segment, ...], int]], arrivals: np.ndarray, source: str) -> Trace:
    reqs = tuple(
        TraceRequest(
            request_id=f"r{i}",
            arrival_s=float(arrivals[i]),
            num_prompt_tokens=sum(s[2] for s in segs),
            num_output_tokens=int(out),
            segments=segs,
        )
        for i, (segs, out) in enumerate(rows)
    )
    return Trace(name=name, requests=reqs, source=source, has_prefix_identity=True)


# ---------------------------------------------------------------------------------------------------- generators
@dataclass(frozen=True, slots=True)
class PrebleSpec:
    """Knobs shared by the generators; each generator reads the ones it names."""

    num_requests: int = 2000
    rate: float = 4.0  # Poisson requests/s
    max_model_len: int | None = None  # clip prompt + output to this (a profile's limit); None = no clip
    num_tools: int = 200  # toolbench: tools (key portions); the paper's ablation also uses 1500
    zipf: float | None = None  # toolbench: Zipf exponent of tool popularity (Fig. 10 uses 1.1); None = uniform
    samples_together: bool = True  # programming: a problem's n samples arrive at one instant (parallel sampling)
    num_active_chains: int = 32  # agent: episodes in flight; each arrival advances one of them
    uid_base: int = 0  # added to NS_UNIQUE keys (lets two generated traces be merged)


def make_toolbench(spec: PrebleSpec, seed: int = 0) -> Trace:
    """System prompt (170) → tool instruction (gamma 1420 ± 780, the key portion) → question (gamma 245 ± 115);
    output 43 ± 16. Tools are picked uniformly, or with P(rank k) ∝ k^-zipf over a seeded shuffle of the tools.
    Requests per tool ≈ num_requests / num_tools (Table 1's 39 ⇔ 7800 requests over 200 tools)."""
    rng = np.random.default_rng(seed)
    n, t = spec.num_requests, spec.num_tools
    system = 170
    tool_len = np.maximum(2 * system, gamma_lengths(rng, 1470, 850, t, hi=_shared_cap(spec.max_model_len, 600 + system)))
    if spec.zipf:
        w = np.arange(1, t + 1, dtype=np.float64) ** -spec.zipf
        tools = rng.permutation(t)[rng.choice(t, n, p=w / w.sum())]
    else:
        tools = rng.integers(0, t, n)
    question = gamma_lengths(rng, 195, 130, n)
    output = gamma_lengths(rng, 43, 16, n)
    rows = []
    for i in range(n):
        k = int(tools[i])
        q, out = _fit(int(question[i]), int(output[i]), system + int(tool_len[k]), spec.max_model_len)
        segs = ((NS_SYSTEM, 0, system), (NS_TOOL, k, int(tool_len[k])), (NS_UNIQUE, spec.uid_base + i, q))
        rows.append((segs, out))
    skew = f"zipf {spec.zipf}" if spec.zipf else "uniform"
    return _assemble("preble-toolbench", rows, poisson_arrivals(rng, spec.rate, n),
                     f"preble toolbench: {t} tools, {skew}, seed {seed}")


def make_agent(spec: PrebleSpec, seed: int = 0) -> Trace:
    """Episodes of round(normal(48, 8)) steps. Step 0's prompt: instruction+demo (gamma 1740 ± 350) + a first
    observation; step t+1's prompt: step t's prompt + its output (16 ± 13) + an observation (gamma 7 ± 5). The
    key portion is the first node (instruction+demo+observation), shared by the whole episode.

    Arrivals: Poisson; each arrival advances a random one of `num_active_chains` episodes in flight (a new one
    starts when one ends), so a chain's consecutive steps are ~num_active_chains / rate seconds apart.
    """
    rng = np.random.default_rng(seed)
    n = spec.num_requests
    cap = spec.max_model_len
    chains: list[list[tuple[tuple[Segment, ...], int]]] = []
    seg_id = 0
    for length in group_sizes(rng, 48, 8, n):
        base = int(gamma_lengths(rng, 1740, 350, 1, hi=cap // 2 if cap else None)[0])
        obs = int(gamma_lengths(rng, 7, 5, 1)[0])
        prefix: tuple[Segment, ...] = ((NS_AGENT, seg_id, base + obs),)
        seg_id += 1
        steps = []
        for _ in range(length):
            out = int(gamma_lengths(rng, 16, 13, 1)[0])
            prompt_len = sum(s[2] for s in prefix)
            if cap is not None and prompt_len + out > cap:
                break  # the episode ran out of context
            steps.append((prefix, out))
            obs = int(gamma_lengths(rng, 7, 5, 1)[0])
            prefix = prefix + ((NS_AGENT, seg_id, out), (NS_AGENT, seg_id + 1, obs))
            seg_id += 2
        chains.append(steps)
    # interleave: each arrival takes the next step of a random active episode
    rows = []
    pending = list(reversed(chains))
    active: list[list[tuple[tuple[Segment, ...], int]]] = []
    while pending or active:
        while pending and len(active) < spec.num_active_chains:
            c = pending.pop()
            if c:
                active.append(c[::-1])
        if not active:
            break
        j = int(rng.integers(len(active)))
        rows.append(active[j].pop())
        if not active[j]:
            active.pop(j)
    return _assemble("preble-agent", rows, poisson_arrivals(rng, spec.rate, len(rows)),
                     f"preble embodied agent: {len(chains)} episodes, seed {seed}")


def make_programming(spec: PrebleSpec, seed: int = 0) -> Trace:
    """Demo system prompt (1100) → problem (gamma 2680 ± 1650) → a per-sample tail (gamma 80 ± 40, e.g. the
    sample's own instruction); round(normal(100, 25)) samples per problem; output gamma 190 ± 343.

    NOTE: the tail is what makes Table 1's shared fraction (97% ± 7.4%) reachable: identical samples would give
    a mean near 99% whenever the std is that small. With `samples_together` a problem's samples arrive at one
    Poisson instant (problems at rate / 100); otherwise each request is its own Poisson arrival, shuffled.
    """
    rng = np.random.default_rng(seed)
    n = spec.num_requests
    system = 600
    sizes = group_sizes(rng, 100, 25, n)
    problem = gamma_lengths(rng, 3190, 1650, len(sizes), hi=_shared_cap(spec.max_model_len, 1000 + system))
    tail = gamma_lengths(rng, 80, 40, n)
    output = gamma_lengths(rng, 190, 343, n)
    rows = []
    i = 0
    for p, k in enumerate(sizes):
        prefix = ((NS_SYSTEM, 1, system), (NS_PROBLEM, p, int(problem[p])))
        for _ in range(k):
            u, out = _fit(int(tail[i]), int(output[i]), system + int(problem[p]), spec.max_model_len)
            rows.append((prefix + ((NS_UNIQUE, spec.uid_base + i, u),), out))
            i += 1
    if spec.samples_together:
        mean_k = n / len(sizes)
        starts = poisson_arrivals(rng, spec.rate / mean_k, len(sizes))
        arrivals = np.repeat(starts, sizes)
    else:
        rows = [rows[j] for j in rng.permutation(n)]
        arrivals = poisson_arrivals(rng, spec.rate, n)
    return _assemble("preble-programming", rows, arrivals,
                     f"preble programming: {len(sizes)} problems, seed {seed}")


def _grouped_qa(
    rng: np.random.Generator,
    spec: PrebleSpec,
    head: tuple[Segment, ...],
    ns: int,
    key_len: tuple[float, float],
    per_key: tuple[float, float],
    question: Callable[[int], np.ndarray],
    output: tuple[float, float],
) -> tuple[list[tuple[tuple[Segment, ...], int]], int]:
    """head → key portion (one per group) → question; groups of round(normal(*per_key)); requests shuffled."""
    n = spec.num_requests
    head_len = sum(s[2] for s in head)
    sizes = group_sizes(rng, *per_key, n)
    key = gamma_lengths(rng, *key_len, len(sizes), hi=_shared_cap(spec.max_model_len, 300 + head_len))
    q = question(n)
    out = gamma_lengths(rng, *output, n)
    rows = []
    i = 0
    for g, k in enumerate(sizes):
        prefix = (*head, (ns, g, int(key[g])))
        for _ in range(k):
            u, o = _fit(int(q[i]), int(out[i]), head_len + int(key[g]), spec.max_model_len)
            rows.append((prefix + ((NS_UNIQUE, spec.uid_base + i, u),), o))
            i += 1
    return [rows[j] for j in rng.permutation(n)], len(sizes)


def make_videoqa(spec: PrebleSpec, seed: int = 0) -> Trace:
    """Video tokens (gamma 9800 ± 5950, the key portion) → a multiple-choice question (gamma 65 ± 15);
    round(normal(8.6, 2)) questions per video; output gamma 4 ± 1.5."""
    rng = np.random.default_rng(seed)
    rows, groups = _grouped_qa(
        rng, spec, (), NS_VIDEO, (9800, 5950), (8.6, 2), lambda k: gamma_lengths(rng, 65, 15, k), (4, 1.5)
    )
    return _assemble("preble-videoqa", rows, poisson_arrivals(rng, spec.rate, len(rows)),
                     f"preble videoqa: {groups} videos, seed {seed}")


def make_loogle(spec: PrebleSpec, seed: int = 0) -> Trace:
    """13-token system prompt → document (gamma 21900 ± 4700, the key portion) → question; round(normal(18,
    8.6)) questions per document; output gamma 16 ± 9.9. Questions: gamma 60 ± 40, except a 12% minority that
    carry a passage of 30-90% of their document's length.

    NOTE: the minority is what Table 1's 15% key-portion std needs next to a prompt std of only 26% of the mean:
    a short question leaves the document ≥ 99% of the prompt, so only long ones can spread the fraction.
    """
    rng = np.random.default_rng(seed)
    n = spec.num_requests
    system = 13
    sizes = group_sizes(rng, 18, 8.6, n)
    doc = gamma_lengths(rng, 21900, 4700, len(sizes), hi=_shared_cap(spec.max_model_len, 300 + system))
    short_q = gamma_lengths(rng, 60, 40, n)
    is_long = rng.random(n) < 0.12
    long_frac = rng.uniform(0.3, 0.9, n)
    out = gamma_lengths(rng, 16, 9.9, n)
    rows = []
    i = 0
    for g, k in enumerate(sizes):
        d = int(doc[g])
        prefix = ((NS_SYSTEM, 2, system), (NS_DOC, g, d))
        for _ in range(k):
            q = max(1, int(round(long_frac[i] * d))) if is_long[i] else int(short_q[i])
            u, o = _fit(q, int(out[i]), system + d, spec.max_model_len)
            rows.append((prefix + ((NS_UNIQUE, spec.uid_base + i, u),), o))
            i += 1
    rows = [rows[j] for j in rng.permutation(n)]
    return _assemble("preble-loogle", rows, poisson_arrivals(rng, spec.rate, n),
                     f"preble loogle: {len(sizes)} documents, seed {seed}")


GENERATORS: dict[str, Callable[[PrebleSpec, int], Trace]] = {
    "preble-toolbench": make_toolbench,
    "preble-agent": make_agent,
    "preble-programming": make_programming,
    "preble-videoqa": make_videoqa,
    "preble-loogle": make_loogle,
}
AZURE_MIX = "preble-azure-mix"
TRACE_NAMES = (*GENERATORS, AZURE_MIX)


# ---------------------------------------------------------------------------------------------------- Azure mix
def azure_mix(
    spec: PrebleSpec,
    seed: int = 0,
    start_s: float = 0.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    time_scale: float = AZURE_TIME_SCALE,
) -> Trace:
    """Azure 2023 code + conversation arrivals merged, sliced (trace seconds), inter-arrivals × `time_scale`;
    the i-th code arrival is served by the i-th request of a ToolBench trace and the i-th conversation arrival by
    the i-th request of a VideoQA trace, each generated (in random order) for exactly that many arrivals [P §5.4].
    The Azure prompt/output lengths are dropped: the served request's own lengths replace them.
    """
    code = load_trace("azure-code")
    conv = load_trace("azure-conv")
    # each file is re-based to its own first row; put both back on one clock
    offset = _first_stamp_s("azure-conv") - _first_stamp_s("azure-code")
    merged = sorted(
        [(r.arrival_s, 0) for r in code.requests] + [(r.arrival_s + offset, 1) for r in conv.requests]
    )
    t0 = merged[0][0] if merged else 0.0
    is_conv = [kind for _, kind in merged]
    base = Trace(  # arrivals only; segment key = index into is_conv
        name=AZURE_MIX,
        requests=tuple(TraceRequest(f"a{i}", t - t0, 1, 1, ((NS_UNIQUE, i, 1),)) for i, (t, _) in enumerate(merged)),
    )
    base = scale_time(take_slice(base, start_s, duration_s, max_requests), time_scale)
    conv_flags = [is_conv[r.segments[0][1]] for r in base.requests]
    n_conv = sum(conv_flags)
    tool = make_toolbench(replace(spec, num_requests=len(conv_flags) - n_conv), seed)
    video = make_videoqa(replace(spec, num_requests=n_conv, uid_base=AZURE_VIDEOQA_UID_BASE), seed + 1)
    it_tool, it_video = iter(tool.requests), iter(video.requests)
    reqs = []
    for i, (r, c) in enumerate(zip(base.requests, conv_flags, strict=True)):
        src = next(it_video) if c else next(it_tool)
        reqs.append(TraceRequest(f"r{i}", r.arrival_s, src.num_prompt_tokens, src.num_output_tokens, src.segments))
    return Trace(
        name=AZURE_MIX,
        requests=tuple(reqs),
        source=f"azure 2023 code+conv x{time_scale}: code -> {tool.source}; conv -> {video.source}",
        has_prefix_identity=True,
    )


def _first_stamp_s(name: str) -> float:
    """Seconds since 0001-01-01 of a named Azure trace's earliest row (load_trace re-bases each file to 0)."""
    _, path = resolve_trace_path(name)
    with open(path, newline="", encoding="utf-8") as f:
        rows = csv.DictReader(f)
        day, sec = min(_parse_azure_timestamp(row["TIMESTAMP"]) for row in rows)
    return day * 86400.0 + sec


def make_preble_trace(name: str, spec: PrebleSpec, seed: int = 0) -> Trace:
    """A generated Preble workload by `--trace` name (not the Azure mix, which also takes a slice)."""
    try:
        gen = GENERATORS[name]
    except KeyError:
        raise ValueError(f"unknown Preble workload {name!r}; known: {', '.join(GENERATORS)}") from None
    return gen(spec, seed)


# ---------------------------------------------------------------------------------------------------- statistics
@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """Table 1's columns, computed from a trace's segments; pairs are (mean, std) over requests (key-portion
    counts: over distinct key portions)."""

    num_requests: int
    prompt_tokens: tuple[float, float]
    output_tokens: tuple[float, float]
    shared_prefix_frac: tuple[float, float]
    key_portion_frac: tuple[float, float]
    requests_per_key_portion: tuple[float, float]


def _mean_std(x: list[float] | list[int]) -> tuple[float, float]:
    a = np.asarray(x, dtype=np.float64)
    return (float(a.mean()), float(a.std())) if len(a) else (0.0, 0.0)


@dataclass(frozen=True, slots=True)
class KeyPortion:
    """A request's key portion in the radix tree of all of a trace's prompts (see `key_portions`)."""

    node: int  # the key node's id in that tree (-1: none)
    num_tokens: int  # the key node's own tokens
    segments: tuple[Segment, ...]  # the prompt's segments up to and including the key node


def _prefix_tree(trace: Trace) -> tuple[list[list[int]], list[int], list[float]]:
    """Each request's node path in the tree of all prompts (segments are the atoms: two segments are the same
    tokens iff their (namespace, key, length) agree), the requests through each node, and each request's shared
    prefix fraction (its longest prefix already in an earlier prompt, arrival order, over its length)."""
    child: dict[tuple[int, Segment], int] = {}  # (parent node, segment) -> node; node 0 is the root
    count: list[int] = [0]  # requests through each node
    paths: list[list[int]] = []
    shared: list[float] = []
    for r in trace.requests:
        node, path, hit, matching = 0, [], 0, True
        for seg in r.segments:
            nxt = child.get((node, seg))
            if nxt is None:
                matching = False
                nxt = child[(node, seg)] = len(count)
                count.append(0)
            elif matching:
                hit += seg[2]
            count[nxt] += 1
            path.append(nxt)
            node = nxt
        paths.append(path)
        shared.append(hit / r.num_prompt_tokens)
    return paths, count, shared


def _key_portions(trace: Trace, paths: list[list[int]], count: list[int]) -> list[KeyPortion]:
    out: list[KeyPortion] = []
    for r, path in zip(trace.requests, paths, strict=True):
        # radix compression: a segment joins its parent's node when the same requests go through both
        best_end, best_len, best_j, seen, node_len = -1, 0, -1, 0, 0
        for j, (seg, nid) in enumerate(zip(r.segments, path, strict=True)):
            node_len += seg[2]
            last = j + 1 == len(path) or count[path[j + 1]] != count[nid]
            if last:
                if node_len > seen:
                    best_end, best_len, best_j = nid, node_len, j
                seen += node_len
                node_len = 0
        out.append(KeyPortion(best_end, best_len, tuple(r.segments[: best_j + 1])))
    return out


def key_portions(trace: Trace) -> list[KeyPortion]:
    """Each request's key portion (§3, E5), in trace order: in the radix tree of all prompts, the deepest node on
    the request's path with more tokens than all its predecessors together."""
    paths, count, _ = _prefix_tree(trace)
    return _key_portions(trace, paths, count)


def oracle_partition_table(trace: Trace) -> dict[str, int]:
    """Preble's oracle partition [P §5.2], offline: request id -> the rank of its key portion among the trace's
    distinct key portions ordered by a hash of their tokens (`OraclePartition` sends rank r to worker r mod K, an
    even split by count). Key portions shared by no other request are left out: they partition nothing."""
    keys = key_portions(trace)
    users: dict[tuple[Segment, ...], int] = {}
    for k in keys:
        users[k.segments] = users.get(k.segments, 0) + 1
    shared = sorted((zlib.crc32(repr(segs).encode()), segs) for segs, n in users.items() if n > 1)
    rank = {segs: i for i, (_, segs) in enumerate(shared)}
    return {r.request_id: rank[k.segments] for r, k in zip(trace.requests, keys, strict=True) if k.segments in rank}


def workload_stats(trace: Trace) -> WorkloadStats:
    """Table 1's statistics over a prefix tree of the prompts, as the paper measures them [P §3]:

    - shared prefix: the prompt's longest prefix already present in an earlier request's prompt (arrival order,
      an infinite cache), over the prompt length;
    - key portion (§3, E5, `key_portions`): its fraction of the prompt;
    - requests per key portion: for each distinct key portion, the requests whose prompt goes through it.
    """
    paths, count, shared = _prefix_tree(trace)
    keys = _key_portions(trace, paths, count)
    return WorkloadStats(
        num_requests=len(trace.requests),
        prompt_tokens=_mean_std([r.num_prompt_tokens for r in trace.requests]),
        output_tokens=_mean_std([r.num_output_tokens for r in trace.requests]),
        shared_prefix_frac=_mean_std(shared),
        key_portion_frac=_mean_std([k.num_tokens / r.num_prompt_tokens for r, k in zip(trace.requests, keys,
                                                                                       strict=True)]),
        requests_per_key_portion=_mean_std(list({k.node: count[k.node] for k in keys}.values())),
    )


TABLE1_SIZES = {  # requests per generated trace for the Table-1 comparison (toolbench: 39 per tool x 200 tools)
    "toolbench": 7800, "agent": 7538, "programming": 10000, "videoqa": 8564, "loogle": 1951,
}


def comparison_table(seed: int = 0, max_model_len: int | None = None) -> str:
    """Markdown: ours vs Table 1 for each generator, at the TABLE1_SIZES request counts."""
    lines = [
        "| workload | n | prompt | output | shared prefix | key portion | req / key portion |",
        "|---|---|---|---|---|---|---|",
    ]

    def cell(x: tuple[float, float], pct: bool = False) -> str:
        return f"{x[0]:.0%} ± {x[1]:.1%}" if pct else f"{x[0]:.1f} ± {x[1]:.1f}"

    for short, n in TABLE1_SIZES.items():
        s = workload_stats(make_preble_trace(f"preble-{short}", PrebleSpec(num_requests=n, max_model_len=max_model_len), seed))
        p = TABLE1[short]
        for who, row in (("ours", s), ("paper", p)):
            lines.append(
                f"| {short} ({who}) | {row.num_requests} | {cell(row.prompt_tokens)} | {cell(row.output_tokens)} | "
                f"{cell(row.shared_prefix_frac, True)} | {cell(row.key_portion_frac, True)} | "
                f"{cell(row.requests_per_key_portion)} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Preble workload generators vs Table 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    args = p.parse_args(argv)
    print(comparison_table(args.seed, args.max_model_len))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
