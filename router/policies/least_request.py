"""least_request: the worker with the fewest requests this router has in flight on it.

Score = in_flight (router-side, updated at dispatch/finish, so it never lags like polled stats); ties go to
fewer running + waiting from the last Stats, then to registration order. vLLM production-stack's
`least_request` / SMG `least_load` without the token weighting.
"""

from __future__ import annotations

from switchyard.router.policies.base import Decision, FleetView, Policy, RoutingContext, candidates


class LeastRequest(Policy):
    name = "least_request"

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        best = min(pool, key=lambda w: (w.in_flight, w.num_running + w.num_waiting))
        return Decision(worker_id=best.worker_id, reason=f"in_flight={best.in_flight}")
