"""Other router replicas' requests, fed to this replica's policy as if it had dispatched them.

Why: a replica knows its own dispatches at once, but another replica's only when the worker's KV events announce
the blocks, after the prefill: a burst of requests for one long prefix, spread over K replicas, is prefilled on up
to K workers, and each replica prices 1/K of the load. Workers are the source of truth: each one reports which
replica sent it which request (`RequestAdmitted`, `RequestFirstToken`, `RequestEnded`, in its KV event stream, one
event lag late), so every replica keeps the same in-flight view with no channel between replicas.
"""

from __future__ import annotations

from collections.abc import Iterable

from switchyard.router.fleet import Fleet
from switchyard.router.peer_keys import PeerKeyCharges
from switchyard.router.policies.base import Decision, Policy, RoutingContext, WorkerId
from switchyard.workers.engine.kv_events import RequestAdmitted, RequestEnded, RequestEvent, RequestFirstToken


def peer_key(origin: str, request_id: str) -> str:
    """A mirrored request's id in the policy: never equal to an id this replica dispatched (those carry no NUL)."""
    return f"\0{origin}\0{request_id}"


class PeerMirror:
    """Maps one worker's request events onto the policy's hooks (where it `mirrors_peers`) and the API keys' limits
    (`keys`, where the Router service has keys), skipping this replica's own (`origin`)."""

    __slots__ = ("origin", "policy", "fleet", "keys", "live", "by_worker")

    def __init__(self, origin: str, policy: Policy, fleet: Fleet, keys: PeerKeyCharges | None = None) -> None:
        self.origin = origin
        self.policy = policy
        # this replica's view: what a peer's select saw (`Policy.on_peer_dispatch`), and each worker's count of the
        # others' open requests (`peer_in_flight`, which the queue's hold condition reads)
        self.fleet = fleet
        self.keys = keys
        self.live: dict[str, WorkerId] = {}  # mirrored request -> its worker, from admission to end
        self.by_worker: dict[WorkerId, set[str]] = {}

    @property
    def active(self) -> bool:
        """Whether the other replicas' request events are wanted at all (the registry decodes them only then)."""
        return self.policy.mirrors_peers or self.keys is not None

    def apply(self, worker_id: WorkerId, model: str, events: Iterable[RequestEvent], now: float) -> None:
        policy = self.policy if self.policy.mirrors_peers else None
        keys = self.keys
        if policy is None and keys is None:
            return
        live = self.live
        before = len(self.by_worker.get(worker_id, ()))
        for ev in events:
            if ev.origin == self.origin:
                continue  # our own: the dispatcher already called the hooks
            key = peer_key(ev.origin, ev.request_id)
            if isinstance(ev, RequestAdmitted):
                if keys is not None:
                    keys.admitted(key, worker_id, ev)  # a replay is not charged again
                if key in live:
                    continue  # a replayed batch
                live[key] = worker_id
                self.by_worker.setdefault(worker_id, set()).add(key)
                if policy is not None:
                    ctx = RoutingContext(
                        request_id=key, model=model, prompt_token_ids=(), block_hashes=ev.block_hashes,
                        max_tokens=ev.max_tokens, arrival_s=now,
                        predicted_output_tokens=ev.predicted_output_tokens or None, lora_name=ev.lora_name,
                        cache_salt=ev.cache_salt, prompt_len=ev.num_prompt_tokens,
                    )
                    decision = Decision(worker_id, predicted_output_tokens=ev.predicted_output_tokens)
                    policy.on_peer_dispatch(ctx, decision, self.fleet, now)
            elif live.get(key) != worker_id:
                continue  # admitted before this replica subscribed: nothing to update
            elif isinstance(ev, RequestFirstToken):
                if keys is not None:
                    keys.first_token(key)
                if policy is not None:
                    policy.on_first_token(key, worker_id, now)
            elif isinstance(ev, RequestEnded):
                del live[key]
                self.by_worker[worker_id].discard(key)
                if keys is not None:
                    keys.ended(key, ev.num_output_tokens)
                if policy is not None:
                    if ev.finished:
                        policy.on_finish(key, worker_id, now, ev.num_output_tokens)
                    else:
                        policy.on_abort(key, worker_id, now)
        if self.count(worker_id) != before:
            self.fleet.set_peer_in_flight(worker_id, self.count(worker_id))

    def forget_worker(self, worker_id: WorkerId, now: float) -> None:
        """The worker was lost or removed, or its stream resumes with a snapshot: its mirrored requests end (the
        snapshot re-announces the live ones)."""
        mirrors = self.policy.mirrors_peers
        for key in self.by_worker.pop(worker_id, ()):
            del self.live[key]
            if mirrors:
                self.policy.on_abort(key, worker_id, now)
        if self.keys is not None:
            self.keys.detach_worker(worker_id, now)
        self.fleet.set_peer_in_flight(worker_id, 0)

    def count(self, worker_id: WorkerId) -> int:
        """Other replicas' requests open on the worker."""
        return len(self.by_worker.get(worker_id, ()))

    def __len__(self) -> int:
        return len(self.live)
