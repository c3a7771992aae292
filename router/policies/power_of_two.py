"""power_of_two: sample two distinct routable workers, send to the less loaded (Mitzenmacher's two choices).

Load = in_flight (router-side) + num_waiting (last Stats). The pair is drawn from a hash of (seed, request id,
attempt), not from a mutable RNG, so `select` stays side-effect free and replays identically in the simulator.
SMG `power_of_two` / production-stack's equivalent.
"""

from __future__ import annotations

import hashlib

from switchyard.router.policies.base import Decision, FleetView, Policy, RoutingContext, candidates


class PowerOfTwo(Policy):
    name = "power_of_two"

    def __init__(self, seed: int = 0) -> None:
        self._seed = seed

    def _draw(self, ctx: RoutingContext, n: int) -> tuple[int, int]:
        digest = hashlib.blake2b(f"{self._seed}:{ctx.request_id}:{ctx.attempt}".encode(), digest_size=16).digest()
        a = int.from_bytes(digest[:8], "little") % n
        b = int.from_bytes(digest[8:], "little") % (n - 1)
        return a, b + (b >= a)  # b drawn from the n-1 others

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        if len(pool) == 1:
            return Decision(worker_id=pool[0].worker_id, reason="only candidate")
        i, j = self._draw(ctx, len(pool))
        a, b = pool[i], pool[j]
        load_a, load_b = a.in_flight + a.num_waiting, b.in_flight + b.num_waiting
        pick = a if load_a <= load_b else b
        return Decision(worker_id=pick.worker_id, reason=f"pair=({a.worker_id}:{load_a},{b.worker_id}:{load_b})")
