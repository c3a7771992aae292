"""The vLLM v1 scheduler, simulated: picks each iteration's tokens (running requests first, then admissions from
the waiting queue under the token budget), preempts by recompute when blocks run out, and applies a step's
result (`schedule() -> StepPlan`, `update_from_step(plan)`), as `vllm/v1/core/sched/scheduler.py`.
It also fast-forwards pure decode stretches exactly (`fast_forward_decode`).

Option `scheduling="preble_groups"`: Preble's local scheduler (specs/preble.md §5.6, code `fcfs-mpq`) for the
admissions: see `priority_group` and `Scheduler._admit_groups`. Option `scheduling="lpm"`: SGLang's default
longest-prefix-match-first admission order, the baseline of Preble's fairness claim (`Scheduler._admit_lpm`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from switchyard.workers.engine.kv_cache_manager import KVCacheManager
from switchyard.workers.engine.request import Request, RequestStatus
from switchyard.workers.engine.types import FinishReason, RequestOutput

if TYPE_CHECKING:
    from switchyard.workers.engine.core import EngineConfig


_EMPTY: list[int] = []


def priority_group(num_cached_tokens: int, num_tokens: int, num_groups: int) -> int:
    """Preble's priority group of a request (specs/preble.md §5.6): 0 with no cached token, else
    ceil(cached / tokens × P) - 1, so 63 of 100 cached with P = 10 is group 6 and fully cached is group P - 1.

    Integer arithmetic: 70 / 100 × 10 is 7.000000000000001 in floats, whose ceil would give group 7, not 6.
    """
    if num_cached_tokens <= 0:
        return 0
    return min(num_groups - 1, -(-num_cached_tokens * num_groups // num_tokens) - 1)


def group_quota(group: int, quota_unit: int) -> int:
    """Requests group g may admit in the step that serves it: (g + 1) × k (k = 10: group 9 → 100, group 0 → 10)."""
    return (group + 1) * quota_unit


@dataclass(frozen=True, slots=True)
class StepPlan:
    """One iteration's schedule (vLLM `SchedulerOutput`, reduced to what the time model and tests need)."""

    scheduled: tuple[tuple[Request, int], ...]  # (request, tokens to compute): running first, then admitted
    num_new_reqs: int  # how many of `scheduled` were admitted from the waiting queue this step (at the end)
    preempted_req_ids: tuple[str, ...]  # sent back to waiting this step, in preemption order
    num_prefill_tokens: int  # tokens of prompt (or recompute) chunks
    prefill_attn_pairs: int  # sum over chunks of n * (c + (n + 1) / 2): query-key pairs, c = tokens before it
    num_decode_reqs: int  # requests computing their one newest token
    decode_context_tokens: int  # sum over decodes of the context each attends to (c + 1)
    admission_blocked: str | None  # why requests still wait: max_num_seqs | budget | blocks | preempted
    # | priority_groups (preble_groups: others wait in groups this step did not serve)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {r.request_id: n for r, n in self.scheduled}

    @property
    def total_num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_reqs


class WaitingQueue:
    """FCFS (deque; preempted requests go to the front) or priority ((priority, arrival) min-heap, as vLLM)."""

    def __init__(self, by_priority: bool) -> None:
        self.by_priority = by_priority
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()

    def add(self, r: Request) -> None:
        if self.by_priority:
            heapq.heappush(self._heap, (r.priority, r.arrival_s, next(self._seq), r))
        else:
            self._fifo.append(r)

    def prepend(self, r: Request) -> None:
        if self.by_priority:
            self.add(r)  # a heap has no front: order is (priority, arrival) anyway
        else:
            self._fifo.appendleft(r)

    def peek(self) -> Request:
        return self._heap[0][3] if self.by_priority else self._fifo[0]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3] if self.by_priority else self._fifo.popleft()

    def remove(self, r: Request) -> None:
        if self.by_priority:
            self._heap = [e for e in self._heap if e[3] is not r]
            heapq.heapify(self._heap)
        else:
            self._fifo.remove(r)

    def sort(self, key: Callable[[Request], int]) -> None:
        """Reorder a FCFS queue in place by `key`, stably (ties keep their order)."""
        if self.by_priority:
            raise ValueError("a priority queue keeps its own order")
        self._fifo = deque(sorted(self._fifo, key=key))

    def __len__(self) -> int:
        return len(self._heap) if self.by_priority else len(self._fifo)

    def __iter__(self) -> Iterator[Request]:
        if self.by_priority:
            return iter([e[3] for e in sorted(self._heap)])
        return iter(self._fifo)


class Scheduler:
    """Running list + waiting queue over a KVCacheManager. Counters are cumulative."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.by_priority = config.scheduling == "priority"
        self.by_groups = config.scheduling == "preble_groups"
        self.by_lpm = config.scheduling == "lpm"
        self.group_cursor = 0  # preble_groups: the group served last; the next step scans down from cursor - 1
        self.running: list[Request] = []
        self.waiting = WaitingQueue(self.by_priority)
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_waiting_uncached_tokens = 0
        self.num_requests_received = 0

    # -- queue management ----------------------------------------------------------------------------------
    def add_request(self, r: Request) -> None:
        self.requests[r.request_id] = r
        self.num_requests_received += 1
        self._set_uncached_estimate(r, r.num_tokens - self.kv.num_cached_prefix_tokens(r))
        self.waiting.add(r)

    def _set_uncached_estimate(self, r: Request, n: int) -> None:
        self.num_waiting_uncached_tokens += n - r.uncached_tokens_estimate
        r.uncached_tokens_estimate = n

    def abort_request(self, request_id: str) -> Request | None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return None
        if r.status == RequestStatus.RUNNING:
            self.running.remove(r)
            self.kv.free(r)
        else:
            self.waiting.remove(r)
            self._set_uncached_estimate(r, 0)
        r.status = RequestStatus.FINISHED
        r.finish_reason = FinishReason.ABORT
        return r

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    # -- scheduling ----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        cfg = self.config
        kv = self.kv
        budget = cfg.max_num_batched_tokens
        bs = kv.block_size
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(r.num_tokens - r.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            c = r.num_computed_tokens
            if n == 1 and c % bs and (c + 1) % bs:
                # fast path: the slot is in an allocated block and no block fills, so allocate_slots is a no-op
                scheduled.append((r, 1))
                budget -= 1
                i += 1
                continue
            ok = True
            while kv.allocate_slots(r, n) is None:
                victim = self._pick_victim()
                vi = running.index(victim) if self.by_priority else len(running) - 1
                running.pop(vi)
                if vi < i:  # NOTE: only under priority: undo a victim scheduled earlier in this step
                    i -= 1
                    for j, (s, m) in enumerate(scheduled):
                        if s is victim:
                            budget += m
                            del scheduled[j]
                            break
                self._preempt(victim)
                preempted.append(victim)
                if victim is r:
                    ok = False
                    break
            if not ok:
                break
            scheduled.append((r, n))
            budget -= n
            i += 1

        num_running_scheduled = len(scheduled)
        blocked: str | None = None
        if preempted:
            # vLLM admits nothing in a step that preempted
            blocked = "preempted" if len(self.waiting) else None
        elif self.by_groups:
            blocked = self._admit_groups(scheduled, budget)
        elif self.by_lpm:
            blocked = self._admit_lpm(scheduled, budget)
        else:
            blocked = self._admit(scheduled, budget)
        return self._make_plan(scheduled, len(scheduled) - num_running_scheduled, preempted, blocked)

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int) -> str | None:
        cfg = self.config
        kv = self.kv
        waiting = self.waiting
        while len(waiting):
            if budget <= 0:
                return "budget"
            if len(self.running) >= cfg.max_num_seqs:
                return "max_num_seqs"
            r = waiting.peek()
            hit_blocks, num_hit = kv.get_computed_blocks(r)
            self._set_uncached_estimate(r, r.num_tokens - num_hit)
            n = r.num_tokens - num_hit
            if not cfg.enable_chunked_prefill and n > budget:
                return "budget"
            n = min(n, budget)
            if kv.allocate_slots(r, n, num_hit, hit_blocks) is None:
                return "blocks"
            waiting.pop()
            self._start(r, n, num_hit, scheduled)
            budget -= n
        return None

    def _admit_lpm(self, scheduled: list[tuple[Request, int]], budget: int) -> str | None:
        """SGLang's `lpm` schedule policy (`schedule_policy.py`: `_sort_by_longest_prefix`,
        `_determine_active_policy`): before admitting, the waiting queue is sorted in place, stably, by the number
        of prompt tokens the cache holds now, longest first; while more than `lpm_max_queue` (128) wait the sort is
        skipped and the queue keeps its last order. Admission then runs in queue order as FCFS does. Highly cached
        requests go first, so a request with nothing cached can wait as long as cached ones keep arriving: the
        starvation Preble's priority groups bound (specs/preble.md §5.6, claim 9)."""
        waiting = self.waiting
        if 0 < len(waiting) <= self.config.lpm_max_queue:
            kv = self.kv

            def cached_now(r: Request) -> int:
                num_hit = kv.num_cached_prefix_tokens(r)
                self._set_uncached_estimate(r, r.num_tokens - num_hit)
                return -num_hit

            waiting.sort(cached_now)
        return self._admit(scheduled, budget)

    def _start(self, r: Request, n: int, num_hit: int, scheduled: list[tuple[Request, int]]) -> None:
        """Bookkeeping of an admission whose slots are allocated (the request is already out of `waiting`)."""
        self._set_uncached_estimate(r, 0)
        r.status = RequestStatus.RUNNING
        r.num_computed_tokens = num_hit
        if r.num_cached_tokens < 0:
            r.num_cached_tokens = num_hit
        self.prefix_cache_queries += r.num_tokens
        self.prefix_cache_hits += num_hit
        self.running.append(r)
        scheduled.append((r, n))

    def waiting_groups(self) -> list[list[Request]]:
        """The waiting requests by priority group, each list in queue order, groups recomputed from the cache now
        (hit ratios drift as blocks are cached and evicted [P §4.3 code])."""
        p = self.config.num_priority_groups
        groups: list[list[Request]] = [[] for _ in range(p)]
        for r in self.waiting:
            num_hit = self.kv.num_cached_prefix_tokens(r)
            self._set_uncached_estimate(r, r.num_tokens - num_hit)
            groups[priority_group(num_hit, r.num_tokens, p)].append(r)
        return groups

    def _admit_groups(self, scheduled: list[tuple[Request, int]], budget: int) -> str | None:
        """Preble's local scheduler (specs/preble.md §5.6, code version): each step serves ONE priority group,
        round-robin downward (cursor - 1, skipping empty groups, wrapping from 0 to P - 1); group g admits up to
        (g + 1) × k of its requests, FCFS within the group, under the token budget, max_num_seqs and free blocks.

        Highly cached requests get the larger quotas, and every non-empty group is served within P steps, so a
        request with no cached token is not starved (it waits at most P admission steps per quota of 10 ahead).

        Returns why requests still wait; "priority_groups" when others wait in groups this step did not serve (the
        next step may admit them, so decode-only fast-forward must not skip it).
        """
        cfg = self.config
        if not len(self.waiting):
            return None
        if budget <= 0:
            return "budget"
        if len(self.running) >= cfg.max_num_seqs:
            return "max_num_seqs"
        p = cfg.num_priority_groups
        groups = self.waiting_groups()
        g = (self.group_cursor - 1) % p
        while not groups[g]:
            g = (g - 1) % p
        self.group_cursor = g
        kv = self.kv
        blocked: str | None = None
        quota = group_quota(g, cfg.priority_group_quota)
        for r in groups[g][:quota]:
            if budget <= 0:
                blocked = "budget"
                break
            if len(self.running) >= cfg.max_num_seqs:
                blocked = "max_num_seqs"
                break
            hit_blocks, num_hit = kv.get_computed_blocks(r)
            n = r.num_tokens - num_hit
            if not cfg.enable_chunked_prefill and n > budget:
                blocked = "budget"
                break
            n = min(n, budget)
            if kv.allocate_slots(r, n, num_hit, hit_blocks) is None:
                blocked = "blocks"
                break
            self.waiting.remove(r)
            self._start(r, n, num_hit, scheduled)
            budget -= n
        if not len(self.waiting) or blocked == "max_num_seqs":
            return blocked if len(self.waiting) else None
        return "priority_groups"

    def _pick_victim(self) -> Request:
        if self.by_priority:
            return max(self.running, key=lambda x: (x.priority, x.arrival_s))
        return self.running[-1]

    def _preempt(self, r: Request) -> None:
        """Recompute mode: drop its blocks and computed tokens; it waits at the front (FCFS)."""
        self.kv.free(r)
        r.status = RequestStatus.PREEMPTED
        r.num_computed_tokens = 0
        r.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(r)
        self._set_uncached_estimate(r, r.num_tokens)

    @staticmethod
    def _make_plan(
        scheduled: list[tuple[Request, int]], num_new: int, preempted: list[Request], blocked: str | None
    ) -> StepPlan:
        prefill_tokens = pairs = decodes = dctx = 0
        for r, n in scheduled:
            c = r.num_computed_tokens
            if n == 1 and r.num_output_tokens > 0:
                decodes += 1
                dctx += c + 1
            else:
                prefill_tokens += n
                pairs += n * c + n * (n + 1) // 2
        return StepPlan(
            scheduled=tuple(scheduled),
            num_new_reqs=num_new,
            preempted_req_ids=tuple(r.request_id for r in preempted),
            num_prefill_tokens=prefill_tokens,
            prefill_attn_pairs=pairs,
            num_decode_reqs=decodes,
            decode_context_tokens=dctx,
            admission_blocked=blocked,
        )

    # -- applying a step -----------------------------------------------------------------------------------
    def update_from_step(self, plan: StepPlan) -> list[RequestOutput]:
        """Advance computed tokens; a request that caught up samples one token; finished ones free their blocks."""
        cfg = self.config
        vocab, eos, max_len = cfg.vocab_size, cfg.eos_token_id, self.max_model_len
        outputs: list[RequestOutput] = []
        any_finished = False
        for r, n in plan.scheduled:
            if r.status is not RequestStatus.RUNNING:
                continue  # aborted since schedule()
            r.num_computed_tokens += n
            if r.num_computed_tokens < r.num_tokens:  # a prefill chunk: nothing sampled yet
                outputs.append(
                    RequestOutput(
                        r.request_id, (), None, r.num_prompt_tokens, r.num_cached_tokens, r.num_output_tokens
                    )
                )
                continue
            tok = r.next_token(vocab, eos)
            r.all_token_ids.append(tok)
            r.num_output_tokens += 1
            self.generation_tokens_total += 1
            if r.num_output_tokens == 1:
                self.prompt_tokens_total += r.num_prompt_tokens
            reason = r.finish_reason_now(max_len)
            if reason is not None:
                self._finish(r, reason)
                any_finished = True
            outputs.append(
                RequestOutput(
                    r.request_id,
                    (tok,),
                    reason,
                    r.num_prompt_tokens,
                    r.num_cached_tokens,
                    r.num_output_tokens,
                )
            )
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    def _finish(self, r: Request, reason: FinishReason) -> None:
        r.status = RequestStatus.FINISHED
        r.finish_reason = reason
        self.kv.free(r)
        self.requests.pop(r.request_id, None)

    # -- exact fast-forward of decode-only iterations ------------------------------------------------------
    def can_fast_forward(self, plan: StepPlan, outputs: list[RequestOutput]) -> bool:
        """After a pure-decode step that scheduled every running request, admitted, preempted and finished
        nothing, and left the waiting head blocked for a reason that further decodes cannot lift."""
        if plan.num_prefill_tokens or plan.num_new_reqs or plan.preempted_req_ids:
            return False
        if plan.num_decode_reqs != len(self.running) or len(outputs) != len(self.running) or not self.running:
            return False
        if len(self.waiting) and plan.admission_blocked not in ("max_num_seqs", "budget", "blocks"):
            return False
        return all(o.finish_reason is None for o in outputs)

    def fast_forward_decode(
        self,
        start_s: float,
        horizon_s: float,
        iteration_time_s: Callable[[int, int], float],
        head_blocked_by_blocks: bool,
    ) -> tuple[int, float, dict[str, list[int]], list[RequestOutput]]:
        """Run decode iterations starting at start_s, exactly as schedule()/update_from_step() would.

        Stops before an iteration that would start at or after horizon_s, before one that would need more blocks
        than are free (a preemption), and, while the waiting head is blocked for blocks, before one that would
        evict a cached block or cache a block of the head's prefix (either could let it in); it stops after the
        first iteration in which a request finishes.

        Returns:
            (iterations run, end time, request_id -> tokens sampled, outputs of requests that finished).
        """
        running = self.running
        kv = self.kv
        bs = kv.block_size
        cfg = self.config
        max_len = self.max_model_len
        num_dec = len(running)
        k_fin = min(r.remaining_outputs(max_len) for r in running)
        # Durations: iteration j (1-based) computes position c0 + j - 1, attending to c0 + j tokens.
        ctx0 = 0
        for r in running:
            ctx0 += r.num_computed_tokens
        ends: list[float] = []
        t = start_s
        while len(ends) < k_fin and t < horizon_s:
            t = t + iteration_time_s(num_dec, ctx0 + (len(ends) + 1) * num_dec)
            ends.append(t)
        k_max = len(ends)
        if k_max == 0:
            return 0, start_s, {}, []
        # Pre-sample every request's next k_max tokens (pure function of position); the unused tail is dropped.
        c0 = [r.num_computed_tokens for r in running]
        out0 = [r.num_output_tokens for r in running]
        ntok0 = [r.num_tokens for r in running]
        sampled = [r.sample_tokens(k_max, cfg.vocab_size, cfg.eos_token_id) for r in running]
        for r, toks in zip(running, sampled, strict=True):
            r.all_token_ids.extend(toks)
        # Requests grouped by c0 mod bs: those needing a new block / filling a block in iteration j.
        by_phase: dict[int, list[int]] = {}
        for idx, c in enumerate(c0):
            by_phase.setdefault(c % bs, []).append(idx)
        head = self.waiting.peek() if head_blocked_by_blocks and len(self.waiting) else None
        head_set = head.digest_set() if head is not None else None
        pool = kv.block_pool
        fq = pool.free_block_queue
        k = 0
        for j in range(1, k_max + 1):
            alloc = by_phase.get((1 - j) % bs, _EMPTY)
            full = by_phase.get((-j) % bs, _EMPTY) if bs > 1 else _EMPTY
            if len(alloc) > fq.num_free_blocks:
                break  # someone would be preempted: leave it to a normal step
            if head is not None:
                if alloc and any(b.digest is not None for b in fq.peek(len(alloc))):
                    break
                hit = False
                for idx in full:
                    nb = (c0[idx] + j) // bs
                    kv.ensure_block_hashes(running[idx], nb)
                    if running[idx].block_digests[nb - 1] in head_set:
                        hit = True
                if hit:
                    break
            touched = sorted(alloc + full) if full else alloc
            for idx in touched:
                r = running[idx]
                r.num_computed_tokens = c0[idx] + j - 1
                kv.allocate_slots(r, 1)  # cannot fail: checked above
            k = j
        end_s = ends[k - 1] if k else start_s
        tokens: dict[str, list[int]] = {}
        finished: list[RequestOutput] = []
        for idx, r in enumerate(running):
            del r.all_token_ids[ntok0[idx] + k :]
            r.num_computed_tokens = c0[idx] + k
            r.num_output_tokens = out0[idx] + k
            if k:
                tokens[r.request_id] = sampled[idx][:k]
        self.generation_tokens_total += k * num_dec
        if k and k == k_fin:
            for r in running:
                reason = r.finish_reason_now(max_len)
                if reason is not None:
                    self._finish(r, reason)
                    finished.append(
                        RequestOutput(
                            r.request_id,
                            (),
                            reason,
                            r.num_prompt_tokens,
                            r.num_cached_tokens,
                            r.num_output_tokens,
                        )
                    )
            self.running = [r for r in running if r.status is RequestStatus.RUNNING]
        return k, end_s, tokens, finished
