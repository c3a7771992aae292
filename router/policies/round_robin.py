"""round_robin: the next routable worker in registration order after the last one dispatched to.

The cursor advances only in `on_dispatch`, so a retry (which re-selects with the failed worker excluded) does
not skip a worker twice. Baseline in every benchmark; vLLM production-stack's and SMG's `round_robin`.
"""

from __future__ import annotations

from switchyard.router.policies.base import Decision, FleetView, Policy, RoutingContext, WorkerId, candidates


class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._last: dict[str, WorkerId] = {}  # model -> worker last dispatched to

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        ids = [w.worker_id for w in fleet.workers(ctx.model)]
        last = self._last.get(ctx.model)
        start = ids.index(last) + 1 if last in ids else 0
        allowed = {w.worker_id for w in pool}
        for k in range(len(ids)):
            wid = ids[(start + k) % len(ids)]
            if wid in allowed:
                return Decision(worker_id=wid, reason="next in rotation")
        return None  # pragma: no cover - pool is non-empty, so some id is allowed

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        self._last[ctx.model] = decision.worker_id
