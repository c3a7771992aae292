"""Other router replicas' requests, charged to their API keys' limits here too.

Why: each replica enforces a key's `max_in_flight`, `rate` and `tokens_per_min` on the calls it serves; with K
replicas behind a load balancer a key could use K times its limits. The workers already tell every replica which
replica sent which request (`PeerMirror`); the admission also names the key it was charged to (`tenant`), so each
replica counts the others' requests of the key as it counts its own, one event lag late, with no channel between
replicas. A request queued at another replica and not yet on a worker is not seen, nor are calls other than
Generate.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from switchyard.auth import KeyLimits, KeySpec, TokenCharge
from switchyard.router.policies.base import WorkerId
from switchyard.workers.engine.kv_events import RequestAdmitted

DETACHED_KEEP_S = 120.0  # how long a charge whose worker went away waits for a snapshot to re-announce it


@dataclass(slots=True)
class _Charge:
    tokens: TokenCharge  # the key, and what the request reserved and used, settled as this replica's own are
    worker: WorkerId | None  # None: detached (its worker was lost or its stream gapped) since `since`
    since: float = 0.0


class PeerKeyCharges:
    """The other replicas' open requests of each key, kept in `limits` (`KeyLimits.note_peer_call` /
    `note_peer_end`). `named` finds a key by name (`ApiKeys.named`); a name this replica does not know is not
    charged (its keys file differs). `counted(name, n)` hears each new count (the router's gauge)."""

    __slots__ = ("limits", "named", "counted", "charges")

    def __init__(
        self, limits: KeyLimits, named: Callable[[str], KeySpec | None],
        counted: Callable[[str, int], None] | None = None,
    ) -> None:
        self.limits = limits
        self.named = named
        self.counted = counted
        self.charges: dict[str, _Charge] = {}  # `peer_key` -> the charge, from admission to end

    def _count(self, key: KeySpec) -> None:
        if self.counted is not None:
            self.counted(key.name, self.limits.peer_in_flight(key.name))

    def admitted(self, key: str, worker_id: WorkerId, ev: RequestAdmitted) -> None:
        got = self.charges.get(key)
        if got is not None:
            if got.worker is None:  # re-announced by a snapshot after a loss or gap: in flight again, not re-charged
                got.worker = worker_id
                self.limits.note_peer_call(got.tokens.key, 0, charge=False)
                self._count(got.tokens.key)
            return
        spec = self.named(ev.tenant) if ev.tenant else None
        if spec is None:
            return
        reserved = ev.num_prompt_tokens + ev.max_tokens if spec.tokens_per_min else 0
        self.charges[key] = _Charge(TokenCharge(spec, ev.num_prompt_tokens, reserved), worker_id)
        self.limits.note_peer_call(spec, reserved)
        self._count(spec)

    def first_token(self, key: str) -> None:
        got = self.charges.get(key)
        if got is not None:
            got.tokens.ran = True

    def ended(self, key: str, num_output_tokens: int) -> None:
        """What it did not use goes back: the output short of max_tokens, and the prompt too if it never ran (as
        this replica settles its own)."""
        got = self.charges.pop(key, None)
        if got is None or got.worker is None:
            return
        t = got.tokens
        if num_output_tokens:
            t.seen(num_output_tokens)
        self.limits.note_peer_end(t.key, t.reserved - t.used)  # no quota: reserved 0, nothing is refunded
        self._count(t.key)

    def detach_worker(self, worker_id: WorkerId, now: float) -> None:
        """The worker was lost, or its stream resumes with a snapshot: its requests leave the in-flight counts; the
        snapshot re-announces those still open (`admitted` takes them back without charging again). What ended
        meanwhile keeps its whole reservation (what it used is not known); charges detached for longer than
        `DETACHED_KEEP_S` are dropped."""
        for key, c in list(self.charges.items()):
            if c.worker == worker_id:
                c.worker, c.since = None, now
                self.limits.note_peer_end(c.tokens.key, 0)
                self._count(c.tokens.key)
            elif c.worker is None and now - c.since > DETACHED_KEEP_S:
                del self.charges[key]
