"""oracle_partition: Preble's oracle-partition baseline [specs/preble.md §7.4 (2), P §5.2], for the simulator only.

Preble builds, offline, one prefix tree over all of a workload's requests, picks its key-portion layer, splits that
layer evenly into K subtrees (K = the number of instances, "e.g., with the hash values of tokens") and, online,
always sends a request that hits a partition to its instance. Such oracle information "cannot be acquired in a
real serving system", so the daemon refuses this policy (`SIMULATOR_ONLY` in the registry); the simulator hands it
the table.

The table (`bench.preble_workloads.oracle_partition_table`) maps each request id to its key portion's rank among
the workload's distinct key portions, ordered by a hash of their tokens; a request goes to worker `rank mod K` of
the model's workers in registration order, so the key portions split evenly by count, whatever their traffic
(Preble's point: uneven questions per video defeat it). A request without a key portion in the table, or whose
partition worker is not routable (down, or failed this request), goes round-robin over the routable ones.
"""

from __future__ import annotations

from collections.abc import Mapping

from switchyard.router.policies.base import Decision, FleetView, Policy, RoutingContext, candidates


class OraclePartition(Policy):
    name = "oracle_partition"

    def __init__(self) -> None:
        self.partition: dict[str, int] = {}  # request id -> its key portion's rank (the oracle; `set_partition`)
        self._turn = 0  # round-robin cursor for requests outside every partition
        self._fell_back = ""  # the request the last select sent round-robin (advances the cursor on dispatch)

    def set_partition(self, table: Mapping[str, int]) -> None:
        """Install the offline oracle: request id -> key-portion rank (>= 0)."""
        if any(rank < 0 for rank in table.values()):
            raise ValueError("oracle_partition: key-portion ranks must be >= 0")
        self.partition = dict(table)

    def select(self, ctx: RoutingContext, fleet: FleetView, now: float) -> Decision | None:
        pool = candidates(ctx, fleet)
        if not pool:
            return None
        rank = self.partition.get(ctx.request_id)
        if rank is not None:
            ids = [w.worker_id for w in fleet.workers(ctx.model)]
            target = ids[rank % len(ids)]
            if any(w.worker_id == target for w in pool):
                return Decision(worker_id=target, reason=f"key-portion partition {rank % len(ids)}")
        self._fell_back = ctx.request_id
        return Decision(worker_id=pool[self._turn % len(pool)].worker_id, reason="no partition: round robin")

    def on_dispatch(self, ctx: RoutingContext, decision: Decision, now: float) -> None:
        if ctx.request_id == self._fell_back:
            self._turn += 1
            self._fell_back = ""
