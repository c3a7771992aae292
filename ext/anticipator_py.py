"""Per-worker load anticipator (PreServe §4.3.1, specs/preserve.md §5): pure-Python reference.

CONTRACT (fixed; the anticipation tracker and the Cython twin `_anticipator_c.pyx` code against it):

The load-look-ahead map U[0..max_len) holds, per future decode iteration, the KV tokens the worker is expected
to hold. Offset 0 is absolute iteration `iteration` (the next decode iteration); the map moves forward with
`advance_to`. Everything inside is an exact integer token count: adding then removing a request restores the
map bit for bit (no float drift, claim 5); only the queries divide by `capacity_tokens`.

    a = Anticipator(capacity_tokens, max_len=4096, ext_frac=0.2)
    a.add(rid, prompt_tokens, predicted_tokens, context_tokens=None)
                                                 # after prefill: record {P, start=iteration, predicted=D,
                                                 # end=start+min(D, max_len)}; offset i in [0, end-start) gets
                                                 # += P + i. Duplicate rid -> ValueError. context_tokens (default
                                                 # P): the tokens its decode attends to at the start, shared
                                                 # prefix included (read by decode_in alone, not the map)
    a.advance_to(iteration)                      # offset 0 moves forward (never back: ValueError); moved-over
                                                 # slots are dropped. A live record with end <= iteration has
                                                 # overrun its prediction: it gets extensions of
                                                 # ext = max(1, ceil(ext_frac * predicted)) (values P + (a -
                                                 # start) at absolute iteration a) until end > iteration, its
                                                 # total length capped at max_len (a record at the cap then
                                                 # holds nothing in the future until finished)
    a.finish(rid) -> bool                        # done or aborted: subtract its contribution over
                                                 # [iteration, end), i.e. the over-estimated tail of an early
                                                 # finish, nothing if it ran to its end; False if unknown
    rid in a; len(a)
    a.iteration -> int                           # absolute index of offset 0
    a.generated(rid) -> int                      # iteration - start: tokens decoded as the map assumes
    a.record(rid) -> (prompt_tokens, start, predicted_tokens, end)   # end = effective end (absolute)
    a.batch(queued) -> (running, queued)         # running [(end - iteration, context + generated)] of the
                                                 # records with decode left; queued [(P, private P, D)] of
                                                 # `queued` ({rid: request not yet running})
    a.decode_in(queued, D, cost) -> float        # D_in of a request of D predicted tokens beside batch(queued)
    a.load_tokens(horizon) -> list[int]          # U[0..h) in tokens (exact)
    a.occupancy(offset) -> float                 # U[offset] / capacity (0.0 beyond the map)
    a.peak(horizon=100) -> float                 # max_{j<h} U[j] / capacity (0.0 for h = 0)
    a.virtual_peak(P, D, horizon=100) -> float   # max_{j<h} (U[j] + (P + j)*[j < D]) / capacity; no mutation:
                                                 # equals add, peak, finish (routing's "virtual add")
    a.overload_fraction(horizon=100, threshold=0.95) -> float   # |{j<h : U[j]/capacity > threshold}| / h
    a.remaining_decode_tokens() -> int           # sum over records of max(0, end - iteration)
    a.resident_tokens() -> int                   # U[0] in tokens

Validation (both builds): token counts and iterations are ints (operator.index: floats raise TypeError);
tokens (context_tokens too) in [0, MAX_TOKENS], iterations in [0, MAX_ITERATION], 1 <= capacity_tokens <= MAX_CAPACITY,
1 <= max_len <= MAX_LEN, ext_frac finite and >= 0, horizon and offset >= 0; otherwise ValueError. A horizon is
clamped to max_len: no record reaches past offset max_len - 1, and `overload_fraction` divides by the clamped
horizon. An unknown rid in generated/record -> KeyError. `predicted_tokens = 0` is allowed: such a record holds
nothing and, like any record at its end, is extended by the next advance_to (also advance_to(iteration) with
the current iteration; it runs the overrun check).

Cost (R records, h horizon, D predicted): add O(min(D, max_len)); finish O(end - iteration); advance_to O(1)
when no record reached its end (a lower bound on the earliest end is kept), else O(R + extension lengths),
plus O(moved slots) capped at the ring size; peak / virtual_peak / overload_fraction O(h);
remaining_decode_tokens O(R); batch and decode_in O(R + queued) (decode_in in C, no Python object per record).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Hashable, Sequence
from typing import Any

from switchyard.ext.e2_select_py import decode_in as batch_decode_in

MAX_TOKENS = (1 << 31) - 1  # per request: prompt_tokens and predicted_tokens (keeps the C sums in int64)
MAX_LEN = 1 << 20  # ring slots per worker (8 MiB of int64 in the C build)
MAX_ITERATION = 1 << 62
MAX_CAPACITY = 1 << 53  # token sums and capacity stay exact as doubles, so both builds divide alike
_NO_END = 1 << 63  # "no extendable record" for the earliest-end bound


def _count(value: object, name: str, upper: int = MAX_TOKENS) -> int:
    v = operator.index(value)  # type: ignore[arg-type]
    if v < 0 or v > upper:
        raise ValueError(f"{name} must be in [0, {upper}], got {v}")
    return v


class _Record:
    """One request past prefill. `end` is absolute and grows with each overrun extension."""

    __slots__ = ("prompt", "start", "predicted", "end", "ext", "context")

    def __init__(self, prompt: int, start: int, predicted: int, end: int, ext: int, context: int) -> None:
        self.prompt = prompt
        self.start = start
        self.predicted = predicted
        self.end = end
        self.ext = ext  # tokens per overrun extension: max(1, ceil(ext_frac * predicted)), at most max_len
        self.context = context  # the tokens its decode attends to at its start (decode_in), shared ones included


class Anticipator:
    """One worker's load-look-ahead map over future decode iterations; see the module docstring."""

    def __init__(self, capacity_tokens: int, max_len: int = 4096, ext_frac: float = 0.2) -> None:
        capacity = operator.index(capacity_tokens)
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity_tokens must be in [1, {MAX_CAPACITY}], got {capacity}")
        length = operator.index(max_len)
        if not 1 <= length <= MAX_LEN:
            raise ValueError(f"max_len must be in [1, {MAX_LEN}], got {length}")
        frac = float(ext_frac)
        if not (math.isfinite(frac) and frac >= 0.0):
            raise ValueError(f"ext_frac must be finite and >= 0, got {ext_frac!r}")
        self._capacity = capacity
        self._max_len = length
        self._ext_frac = frac
        self._size = length + 1  # ring slots: any end (<= start + max_len <= iteration + max_len) fits
        self._ring = [0] * self._size  # absolute iteration a lives at slot a % size
        self._it = 0
        self._records: dict[Hashable, _Record] = {}
        self._min_end = _NO_END  # <= the end of every record that can still be extended

    # ---- properties --------------------------------------------------------------------------------------

    @property
    def iteration(self) -> int:
        return self._it

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    @property
    def max_len(self) -> int:
        return self._max_len

    @property
    def ext_frac(self) -> float:
        return self._ext_frac

    def __contains__(self, rid: object) -> bool:
        return rid in self._records

    def __len__(self) -> int:
        return len(self._records)

    # ---- ring helpers ------------------------------------------------------------------------------------

    def _add_range(self, lo: int, hi: int, first: int, sign: int) -> None:
        """Slots of absolute iterations [lo, hi) += sign * (first, first + 1, ...)."""
        n = hi - lo
        if n <= 0:
            return
        ring, size = self._ring, self._size
        s = lo % size
        head = min(n, size - s)  # up to the end of the list, then wrap to slot 0
        ring[s : s + head] = [u + sign * (first + i) for i, u in enumerate(ring[s : s + head])]
        if head < n:
            first += head
            ring[: n - head] = [u + sign * (first + i) for i, u in enumerate(ring[: n - head])]

    def _window(self, horizon: int) -> list[int]:
        h = operator.index(horizon)
        if h < 0:
            raise ValueError(f"horizon must be >= 0, got {h}")
        h = min(h, self._max_len)
        s = self._it % self._size
        out = self._ring[s : s + h]
        if len(out) < h:
            out += self._ring[: h - len(out)]
        return out

    # ---- updates -----------------------------------------------------------------------------------------

    def add(self, rid: Hashable, prompt_tokens: int, predicted_tokens: int, context_tokens: int | None = None) -> None:
        p = _count(prompt_tokens, "prompt_tokens")
        d = _count(predicted_tokens, "predicted_tokens")
        c = p if context_tokens is None else _count(context_tokens, "context_tokens")
        if rid in self._records:
            raise ValueError(f"request {rid!r} is already in the map")
        start = self._it
        end = start + min(d, self._max_len)
        x = self._ext_frac * d
        # an extension longer than max_len would be capped anyway (and this keeps C's cast in range)
        ext = self._max_len if x >= self._max_len else max(1, math.ceil(x))
        self._records[rid] = _Record(p, start, d, end, ext, c)
        self._add_range(start, end, p, +1)
        if end < start + self._max_len:
            self._min_end = min(self._min_end, end)

    def finish(self, rid: Hashable) -> bool:
        r = self._records.pop(rid, None)
        if r is None:
            return False
        # its value at absolute iteration a is P + (a - start); only [iteration, end) is still in the map
        self._add_range(self._it, r.end, r.prompt + (self._it - r.start), -1)
        return True

    def advance_to(self, iteration: int) -> None:
        it = _count(iteration, "iteration", MAX_ITERATION)
        if it < self._it:
            raise ValueError(f"iteration {it} is before the map's origin {self._it}")
        moved = it - self._it
        if moved >= self._size:
            self._ring = [0] * self._size
        else:  # the slots of [old, it) become those of [old + size, it + size): the new far future, empty
            for a in range(self._it, it):
                self._ring[a % self._size] = 0
        self._it = it
        if self._min_end <= it:
            self._extend_overruns()

    def _extend_overruns(self) -> None:
        """Extend every live record with end <= iteration; recompute the earliest-end bound."""
        it, max_len = self._it, self._max_len
        min_end = _NO_END
        for r in self._records.values():
            cap = r.start + max_len
            if r.end >= cap:
                continue  # at the cap: never extended again
            if r.end <= it:
                # repeated extensions of r.ext until end > it; those over past iterations left no trace
                k = (it - r.end) // r.ext + 1
                new_end = min(r.end + k * r.ext, cap)
                self._add_range(it, new_end, r.prompt + (it - r.start), +1)
                r.end = new_end
            if r.end < cap:
                min_end = min(min_end, r.end)
        self._min_end = min_end

    # ---- queries -----------------------------------------------------------------------------------------

    def generated(self, rid: Hashable) -> int:
        return self._it - self._records[rid].start

    def record(self, rid: Hashable) -> tuple[int, int, int, int]:
        r = self._records[rid]
        return (r.prompt, r.start, r.predicted, r.end)

    def batch(self, queued: dict[Hashable, Any]) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """A router's anticipated batch on this worker (the default policy's `Switchyard.batch`, priced per worker
        per select): running [(remaining predicted tokens, context + generated)] for each record with decode left,
        in the map's order (the Cython build's differs after a finish: the sums over it are of ints and halves,
        the same in any order), and queued [(prompt_tokens, kv_prompt_tokens, predicted_tokens)] for each request
        of `queued` ({rid: a request dispatched here without its first token}, none of them in the map), in its
        order. A router whose requests enter the map at their first token with their whole prompt as context (the
        anticipation tracker) gets the batch its own records describe."""
        it = self._it
        running = [(r.end - it, r.context + it - r.start) for r in self._records.values() if r.end > it]
        return running, [(rq.prompt_tokens, rq.kv_prompt_tokens, rq.predicted_tokens) for rq in queued.values()]

    def decode_in(self, queued: dict[Hashable, Any], d: int, cost: Any) -> float:
        """D_in of a request of d predicted tokens beside `batch(queued)`: `e2_select_py.decode_in` of that batch
        (the default policy's fill level reads it for every worker each select; the Cython build sums the records
        in C without building the batch)."""
        return batch_decode_in(*self.batch(queued), 0, d, cost)  # D_in's formula lives with the other terms

    def load_tokens(self, horizon: int) -> list[int]:
        return self._window(horizon)

    def occupancy(self, offset: int) -> float:
        j = operator.index(offset)
        if j < 0:
            raise ValueError(f"offset must be >= 0, got {j}")
        if j >= self._max_len:
            return 0.0
        return self._ring[(self._it + j) % self._size] / self._capacity

    def peak(self, horizon: int = 100) -> float:
        return max(self._window(horizon), default=0) / self._capacity

    def virtual_peak(self, prompt_tokens: int, predicted_tokens: int, horizon: int = 100) -> float:
        p = _count(prompt_tokens, "prompt_tokens")
        d = _count(predicted_tokens, "predicted_tokens")
        window = self._window(horizon)
        return max((u + (p + j if j < d else 0) for j, u in enumerate(window)), default=0) / self._capacity

    def overload_fraction(self, horizon: int = 100, threshold: float = 0.95) -> float:
        window = self._window(horizon)
        if not window:
            return 0.0
        thr = float(threshold)
        return sum(1 for u in window if u / self._capacity > thr) / len(window)

    def remaining_decode_tokens(self) -> int:
        return sum(max(0, r.end - self._it) for r in self._records.values())

    def resident_tokens(self) -> int:
        return self._ring[self._it % self._size]


# ---------------------------------------------------------------------------------------------- iteration clock
class IterationClock:
    """A worker's decode-iteration clock (`router/policies/anticipation.py`'s module docstring has the rule):

        iteration(now) = base + sample_iterations + int(since_sample)

    where `since_sample` integrates the iteration rate from the Stats sample the clock is anchored on, piecewise,
    up to `last_t`. The rate is 1 / `cost.decode_iteration_s(n, c)` at the map's batch (n requests, c resident
    tokens; memoised on (n, c)), `observed_rate` for a worker without a profile (`cost` None) once it has one,
    else the default profile's; 0 while the map is empty. The tracker re-anchors the fields on a new sample
    (`_observe_stats`); `advance` and `same_sample` are what every select runs per worker (`sync_known`).
    """

    __slots__ = ("cost", "default_cost", "base", "sample_iterations", "sample_at", "has_sample", "since_sample",
                 "last_t", "observed_rate", "rate_n", "rate_c", "memo_rate")

    def __init__(self, cost: Any, default_cost: Any, now: float) -> None:
        self.cost = cost  # the worker's profile cost model; None: real vLLM, rate from observed Stats
        self.default_cost = default_cost
        self.base = 0
        self.sample_iterations = 0
        self.sample_at = now  # no Stats yet: count from 0 at first sight
        self.has_sample = False  # a real Stats sample anchors the clock
        self.since_sample = 0.0  # iterations extrapolated from the sample up to `last_t`
        self.last_t = now
        self.observed_rate = 0.0  # iterations/s between the last two progressing samples (no-profile workers)
        self.rate_n = -1  # the last profile rate and its batch (map size, resident tokens)
        self.rate_c = -1
        self.memo_rate = 0.0

    def same_sample(self, stats_at: Any, num_iterations: Any) -> bool:
        """The worker's Stats sample is the one the clock is anchored on, by its exact time and count."""
        return (
            self.has_sample
            and isinstance(stats_at, (int, float))
            and float(stats_at) == self.sample_at
            and num_iterations == self.sample_iterations
        )

    def rate(self, ant: Any) -> float:
        """Decode iterations per second at the map's current batch; 0 when the map is empty."""
        n = len(ant)
        if n == 0:
            return 0.0
        cost = self.cost
        if cost is None:
            if self.observed_rate > 0:
                return self.observed_rate
            cost = self.default_cost
        c = ant.resident_tokens()
        if n == self.rate_n and c == self.rate_c:  # NOTE: exact, a function of (n, c) alone: a worker's cost is fixed
            return self.memo_rate
        t = cost.decode_iteration_s(n, c)  # profile.iteration_time_s(0, 0, n, c), bit for bit
        rate = 1.0 / t if t > 0 else 0.0
        self.rate_n, self.rate_c, self.memo_rate = n, c, rate
        return rate

    def observe(self, ant: Any, stats_at: Any, stats_age_s: float, num_iterations: int, now: float) -> None:
        """Re-anchor on the worker's Stats sample (taken at `stats_at`, else `now - stats_age_s`, with its
        iteration counter): nothing when it is the one anchored on or there is none yet (a non-finite age). The
        clock is integrated at the old anchor first, so it stays monotonic; a counter that went down (the worker
        restarted) re-bases `base` so the clock continues from where it was; two progressing samples give the
        observed rate."""
        if self.same_sample(stats_at, num_iterations):
            return
        if not math.isfinite(stats_age_s):
            return  # no sample yet
        at = float(stats_at) if isinstance(stats_at, (int, float)) else now - stats_age_s
        n = num_iterations
        if self.has_sample and at == self.sample_at and n == self.sample_iterations:
            return
        self.advance(ant, now)
        if n < self.sample_iterations:
            self.base = ant.iteration - n
        elif self.has_sample and n > self.sample_iterations and at > self.sample_at:
            self.observed_rate = (n - self.sample_iterations) / (at - self.sample_at)
        self.has_sample = True
        self.sample_iterations = n
        self.sample_at = at
        self.since_sample = max(0.0, now - at) * self.rate(ant)
        self.last_t = now

    def advance(self, ant: Any, now: float) -> None:
        """Integrate the clock up to `now` (never back) and move the map's offset 0 to it."""
        dt = now - self.last_t
        if dt > 0:
            self.since_sample += dt * self.rate(ant)
            self.last_t = now
        target = self.base + self.sample_iterations + int(self.since_sample)
        if target > ant.iteration:
            ant.advance_to(target)


def sync_known(states: dict[Any, Any], pool: Sequence[Any], now: float) -> list[Any]:
    """Per pool worker view, in order: when the tracker knows it (`states[worker_id]`, with an `anticipator` and
    a `clock`), its map with the clock re-anchored on the view's Stats sample (`stats_at`, `num_iterations`;
    `stats_age_s` is read only when the sample is not the one anchored on) and advanced to `now`; None for any
    other, which the caller creates."""
    out: list[Any] = []
    for w in pool:
        st = states.get(w.worker_id)
        ant = st.anticipator if st is not None else None
        if ant is None:
            out.append(None)
            continue
        clock = st.clock
        at, n = getattr(w, "stats_at", None), w.num_iterations
        if not clock.same_sample(at, n):
            clock.observe(ant, at, w.stats_age_s, n, now)
        clock.advance(ant, now)
        out.append(ant)
    return out
