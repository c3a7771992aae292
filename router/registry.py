"""The worker registry: connections to workers and the background tasks that keep the fleet view current.

Per worker: one grpc.aio channel; Info on connect (tokenizer and block-hash recipe checked against the model's
other workers); a Stats poll loop that is also the health check (feeds `Fleet.apply_stats`); one KvEvents
subscription (feeds `Fleet.apply_kv_events`, resumes after the last applied seq). Everything it learns comes from
the workers, so a restarted router rebuilds the same view. Workers come from the static list or Admin calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from switchyard.router import api
from switchyard.router.admission import ApiError, ModelSpec
from switchyard.router.clock import Clock
from switchyard.router.config import WorkersConfig
from switchyard.router.fleet import Fleet, WorkerInfo, WorkerState
from switchyard.router.metrics import RouterMetrics
from switchyard.router.peer_mirror import PeerMirror
from switchyard.router.policies.base import Policy, WorkerId, load_poll_period
from switchyard.router.worker_session import SessionCall, WorkerSender
from switchyard.tls import aio_channel
from switchyard.v1 import router_pb2, worker_pb2, worker_pb2_grpc
from switchyard.workers.tokenizer import Tokenizer, same_tokenizer

log = logging.getLogger(__name__)

# an Info call that got no answer: no process, no route, or a TLS handshake that cannot succeed
NO_CONNECTION = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class RejectedWorker(Exception):
    """The worker answered Info but cannot join (tokenizer or recipe mismatch, duplicate id)."""


@dataclass(eq=False)
class WorkerConn:
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    tls_generation: int = 0  # which load of the router's client TLS files built `channel` (`_renew_channel`)
    info: WorkerInfo | None = None  # from the last successful Info
    connected: bool = False  # Info succeeded and Stats answer; False after `unhealthy_after_failures` misses
    drained: bool = False  # Admin.DrainWorker: never routed to again until re-registered
    removed: bool = False
    ever_failed: bool = False
    rejected: bool = False  # the last Info answered but failed the join checks
    last_error: str = ""
    num_failures: int = 0  # consecutive failed Stats polls
    first_attempt: asyncio.Event = field(default_factory=asyncio.Event)  # set after the first connect attempt
    kv_ready: asyncio.Event = field(default_factory=asyncio.Event)  # set while the KV stream may run
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    sender: WorkerSender = field(init=False)  # `WorkerRegistry.generate`'s (`_new_sender`)

    @property
    def worker_id(self) -> WorkerId | None:
        return self.info.worker_id if self.info else None


class WorkerRegistry:
    """Owns worker connections; the only writer of the Fleet's worker set, health and Stats/KV ingestion."""

    def __init__(
        self,
        config: WorkersConfig,
        fleet: Fleet,
        policy: Policy,
        tokenizer_for: Callable[[str], Tokenizer],
        clock: Clock,
        metrics: RouterMetrics,
        channel_close_grace_s: float = 5.0,
    ) -> None:
        self._cfg = config
        self.poll_interval_s = load_poll_period(policy, config.stats_interval_s)  # a peer's own, where faster
        self.tls = config.client_tls()  # re-read when rotated, before a worker is dialled again (`_renew_channel`)
        self._fleet = fleet
        self._policy = policy
        self._tokenizer_for = tokenizer_for
        self._clock = clock
        self._metrics = metrics
        self._close_grace_s = channel_close_grace_s
        # this replica, as the workers' request events name it (random per process: a restarted router is another
        # replica, whose predecessor's requests the workers ended), and the other replicas' requests from them
        self.origin = uuid.uuid4().hex[:16]
        self.mirror = PeerMirror(self.origin, policy, fleet)
        self._conns: dict[str, WorkerConn] = {}  # address -> connection
        self._listeners: list[Callable[[], None]] = []  # called after stats / worker changes (queue pump)
        self._background: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ queries
    def add_listener(self, fn: Callable[[], None]) -> None:
        self._listeners.append(fn)

    def _notify(self) -> None:
        for fn in self._listeners:
            fn()

    def spec(self, model: str) -> ModelSpec | None:
        """`ModelCatalog` for admission: the model's limits and hashing recipe, from its workers' Info."""
        workers = self._fleet.workers(model)
        if not workers:
            return None
        first = workers[0].info
        return ModelSpec(
            model=model,
            max_model_len=min(w.info.max_model_len for w in workers),
            block_size=first.block_size,
            block_hash_algo=first.block_hash_algo,
            block_hash_seed=first.block_hash_seed,
            num_routable=len(self._fleet.routable(model)),
        )

    def stub(self, worker_id: WorkerId) -> worker_pb2_grpc.WorkerStub | None:
        conn = self._conn_of(worker_id)
        return conn.stub if conn else None

    def _conn_of(self, worker_id: WorkerId) -> WorkerConn | None:
        rec = self._fleet.get(worker_id)
        conn = self._conns.get(rec.info.address) if rec else None
        return conn if conn and not conn.removed else None

    def generate(
        self, worker_id: WorkerId, request: worker_pb2.WorkerGenerateRequest, timeout: float | None
    ) -> grpc.aio.UnaryStreamCall | SessionCall | None:
        """Send one request to the worker (`WorkerSender`: over its Session stream where `workers.session` is on
        and the worker serves it). None: not connected."""
        conn = self._conn_of(worker_id)
        return None if conn is None else conn.sender.send(request, timeout)

    def find(self, ref: str) -> WorkerConn:
        """By worker id, else by address; NOT_FOUND otherwise."""
        for conn in self._conns.values():
            if conn.worker_id == ref:
                return conn
        if ref in self._conns:
            return self._conns[ref]
        raise ApiError(grpc.StatusCode.NOT_FOUND, f"no worker {ref!r} is registered")

    def status(self, conn: WorkerConn) -> router_pb2.WorkerStatus:
        out = router_pb2.WorkerStatus(worker_id=conn.worker_id or "", address=conn.address)
        rec = self._fleet.get(conn.worker_id) if conn.worker_id else None
        if conn.removed:
            out.state = "removed"
        elif rec is None:
            out.state = "unhealthy" if conn.ever_failed else "starting"
        else:
            out.model = rec.model
            out.healthy = rec.healthy
            out.state = "unhealthy" if not rec.healthy else rec.state.value
            out.in_flight = rec.in_flight
            out.num_running = rec.num_running
            out.num_waiting = rec.num_waiting
            out.kv_usage_frac = rec.kv_usage_frac
            out.stats_age_s = max(0.0, self._clock.now() - rec.stats_at) if rec.stats_at > float("-inf") else -1.0
            index = self._fleet.prefix_index(rec.model)
            out.num_resident_blocks = index.num_blocks(rec.worker_id) if index else 0
            out.peer_in_flight = rec.peer_in_flight
        return out

    def statuses(self) -> list[router_pb2.WorkerStatus]:
        return [self.status(c) for c in self._conns.values()]

    # ------------------------------------------------------------------ membership
    async def start(self, addresses: tuple[str, ...]) -> None:
        """Add the static workers and wait (up to the connect timeout) for each one's first connect attempt."""
        conns = [self._add(a) for a in addresses]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._cfg.connect_timeout_s + 1.0):
                await asyncio.gather(*(c.first_attempt.wait() for c in conns))

    def _add(self, address: str) -> WorkerConn:
        channel = aio_channel(address, self.tls, self._cfg.channel_options())
        conn = WorkerConn(address=address, channel=channel, stub=worker_pb2_grpc.WorkerStub(channel),
                          tls_generation=self.tls.generation if self.tls is not None else 0)
        self._new_sender(conn)
        self._conns[address] = conn
        conn.tasks.append(asyncio.create_task(self._run(conn), name=f"worker-loop {address}"))
        conn.tasks.append(asyncio.create_task(self._kv_loop(conn), name=f"kv-events {address}"))
        return conn

    async def register(self, address: str) -> router_pb2.WorkerStatus:
        """Admin.RegisterWorker: idempotent for a known address; waits for the first connect attempt."""
        address = address.strip()
        if not address or ":" not in address:
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"address must be host:port, got {address!r}")
        conn = self._conns.get(address)
        if conn is not None and not conn.removed:
            return self.status(conn)
        conn = self._add(address)
        await conn.first_attempt.wait()
        if conn.removed:
            raise ApiError(grpc.StatusCode.ABORTED, f"worker at {address} was deregistered while it registered")
        if conn.info is None or conn.worker_id is None or self._fleet.get(conn.worker_id) is None:
            error = conn.last_error or "no answer"
            await self._remove(conn)
            code = grpc.StatusCode.FAILED_PRECONDITION if conn.rejected else grpc.StatusCode.UNAVAILABLE
            raise ApiError(code, f"worker at {address} could not be registered: {error}")
        return self.status(conn)

    async def deregister(self, ref: str) -> router_pb2.WorkerStatus:
        conn = self.find(ref)
        await self._remove(conn)
        return self.status(conn)

    def drain(self, ref: str) -> router_pb2.WorkerStatus:
        """Stop routing to the worker; its in-flight requests finish normally."""
        conn = self.find(ref)
        conn.drained = True
        if conn.worker_id and self._fleet.get(conn.worker_id):
            self._fleet.set_state(conn.worker_id, WorkerState.DRAINING)
            self._changed(conn.worker_id)
        log.info("worker %s (%s) draining", conn.worker_id, conn.address)
        return self.status(conn)

    async def _remove(self, conn: WorkerConn) -> None:
        conn.removed = True
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]
        for t in conn.tasks:
            t.cancel()
        await asyncio.gather(*conn.tasks, return_exceptions=True)
        conn.first_attempt.set()  # a RegisterWorker waiting on the cancelled first attempt ends (ABORTED)
        wid = conn.worker_id
        if wid and self._fleet.get(wid) is not None and self._fleet.get(wid).info.address == conn.address:  # type: ignore[union-attr]
            self._fleet.remove_worker(wid)
            self._metrics.forget_worker(wid)
            self._changed(wid)
        # Requests still streaming from it may finish within the grace period.
        self._spawn(conn.channel.close(grace=self._close_grace_s))
        log.info("worker %s (%s) removed", wid, conn.address)

    async def close(self) -> None:
        conns = list(self._conns.values())
        for conn in conns:
            conn.removed = True
            for t in conn.tasks:
                t.cancel()
        await asyncio.gather(*(t for c in conns for t in c.tasks), return_exceptions=True)
        await asyncio.gather(*(c.channel.close() for c in conns), return_exceptions=True)
        for t in list(self._background):
            t.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        self._conns.clear()

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _changed(self, worker_id: WorkerId) -> None:
        now = self._clock.now()
        rec = self._fleet.get(worker_id)
        if rec is None or not rec.healthy:  # its stream resumes with a snapshot, which re-announces its open requests
            self.mirror.forget_worker(worker_id, now)
            if rec is not None:  # a removed worker's series are gone (`RouterMetrics.forget_worker`)
                self._metrics.worker_peer_in_flight.labels(worker_id).set(rec.peer_in_flight)
        self._policy.on_worker_change(worker_id, now)
        if rec is not None:
            self._metrics.worker_healthy.labels(worker_id).set(1.0 if rec.is_routable else 0.0)
        self._notify()

    # ------------------------------------------------------------------ connect + health
    def _check_joinable(self, info: WorkerInfo) -> None:
        if not info.model:
            raise RejectedWorker("rejected: the worker reports no model")
        unset = [f"{k}={v}" for k, v in (("block_size", info.block_size), ("max_model_len", info.max_model_len),
                                         ("kv_capacity_blocks", info.kv_capacity_blocks)) if v <= 0]
        if unset:  # a field its Info left at the proto default: hashing and every cost would divide by it
            raise RejectedWorker(f"rejected: the worker reports {', '.join(unset)}; each must be > 0")
        try:
            tokenizer = self._tokenizer_for(info.model)
        except (OSError, RuntimeError) as e:
            raise RejectedWorker(f"rejected: cannot load the router's tokenizer for {info.model!r}: {e}") from None
        if not same_tokenizer(info.tokenizer_id, tokenizer.tokenizer_id):
            raise RejectedWorker(
                f"rejected: tokenizer mismatch for model {info.model!r}: worker has {info.tokenizer_id!r}, "
                f"router has {tokenizer.tokenizer_id!r}"
            )
        for other in self._fleet.workers(info.model):
            if other.info.address == info.address:
                continue
            if other.worker_id == info.worker_id:
                raise RejectedWorker(f"rejected: worker id {info.worker_id!r} is already used by {other.info.address}")
            recipe = (info.block_size, info.block_hash_algo, info.block_hash_seed)
            theirs = (other.info.block_size, other.info.block_hash_algo, other.info.block_hash_seed)
            if recipe != theirs:
                raise RejectedWorker(
                    f"rejected: block hash recipe (block_size, algo, seed)={recipe} differs from {theirs} of "
                    f"{other.worker_id}, another worker of model {info.model!r}"
                )
        clash = self._fleet.get(info.worker_id)
        if clash is not None and clash.info.address != info.address:
            raise RejectedWorker(f"rejected: worker id {info.worker_id!r} is already used by {clash.info.address}")
        limit = self._policy.max_workers
        others = sum(1 for rec in self._fleet.all_workers() if rec.info.address != info.address)
        if limit is not None and others >= limit:  # past it, the policy's hooks raise for the joining worker
            raise RejectedWorker(
                f"rejected: policy {self._policy.name!r} holds state for at most {limit} workers and {others} are "
                f"registered; serve the rest from another router, or use a policy without that limit"
            )

    def _new_sender(self, conn: WorkerConn) -> None:
        """On the connection's stub; sessions wait for the worker's Info to say it serves them."""
        conn.sender = WorkerSender(conn.stub, f"worker at {conn.address}", sessions=False,
                                   on_open=lambda: self._metrics.worker_sessions.labels(conn.worker_id).inc())

    def _renew_channel(self, conn: WorkerConn) -> None:
        """Before a worker is dialled again: when the router's client TLS files were rotated since its channel was
        built, a new channel with the new certificate replaces it (the old one closes after the grace period, as
        a removed worker's). Live connections keep the certificate they were made with, as the servers' reload
        does: a rotation reaches a worker at its next (re)join, not by cutting a working connection."""
        tls = self.tls
        if tls is None or (not tls.reload() and conn.tls_generation == tls.generation):
            return
        old = conn.channel
        conn.channel = aio_channel(conn.address, tls, self._cfg.channel_options())
        conn.stub = worker_pb2_grpc.WorkerStub(conn.channel)
        self._new_sender(conn)  # the open session runs on the old channel until it closes
        conn.tls_generation = tls.generation
        self._spawn(old.close(grace=self._close_grace_s))
        log.info("worker at %s: new channel with the rotated client TLS files", conn.address)

    async def _connect(self, conn: WorkerConn, first: bool) -> bool:
        """Info, checks, then join the fleet (or rejoin it). False on failure, with `last_error` set."""
        self._renew_channel(conn)
        try:
            raw = await conn.stub.Info(
                worker_pb2.InfoRequest(), timeout=self._cfg.connect_timeout_s, wait_for_ready=first
            )
            info = api.info_from_proto(raw, conn.address)
            self._check_joinable(info)
        except (grpc.aio.AioRpcError, RejectedWorker) as e:
            msg = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else str(e)
            if isinstance(e, grpc.aio.AioRpcError) and e.code() in NO_CONNECTION:
                msg += (f" (no answer: the worker is down or unreachable, or its TLS setting differs from this "
                        f"router's workers.tls = {'true' if self.tls else 'false'})")
            if msg != conn.last_error or first:
                level = logging.ERROR if isinstance(e, RejectedWorker) else logging.WARNING
                log.log(level, "worker at %s not joined: %s", conn.address, msg)
            conn.last_error, conn.ever_failed = msg, True
            conn.rejected = isinstance(e, RejectedWorker)
            return False
        old = self._fleet.get(conn.info.worker_id) if conn.info else None
        if old is not None and old.info != info:  # restarted with a new identity or config: start over
            self._fleet.remove_worker(old.worker_id)
            self._metrics.forget_worker(old.worker_id)
            old = None
        if old is None:
            self._fleet.add_worker(info, state=state_of(raw.state, conn.drained), healthy=True)
        else:
            self._fleet.set_healthy(info.worker_id, True)
            self._fleet.set_state(info.worker_id, state_of(raw.state, conn.drained))
        conn.info, conn.connected, conn.num_failures, conn.last_error, conn.rejected = info, True, 0, "", False
        conn.sender.sessions = self._cfg.session and raw.session
        conn.sender.name = f"worker {info.worker_id} ({conn.address})"
        conn.kv_ready.set()
        log.info(
            "worker %s at %s joined: model=%s max_model_len=%d block_size=%d hash=%s max_num_seqs=%d",
            info.worker_id, conn.address, info.model, info.max_model_len, info.block_size, info.block_hash_algo,
            info.max_num_seqs,
        )
        self._changed(info.worker_id)
        return True

    def _mark_unhealthy(self, conn: WorkerConn, reason: str) -> None:
        if not conn.connected:
            return
        conn.connected = False
        conn.ever_failed = True
        conn.last_error = reason
        conn.kv_ready.clear()
        wid = conn.worker_id
        log.warning("worker %s at %s unhealthy: %s", wid, conn.address, reason)
        if wid and self._fleet.get(wid) is not None:
            self._fleet.set_healthy(wid, False)  # also forgets its cached blocks; the KV stream re-snapshots
            self._changed(wid)

    async def _poll_stats(self, conn: WorkerConn) -> bool:
        try:
            raw = await conn.stub.Stats(worker_pb2.StatsRequest(), timeout=self._cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            conn.num_failures += 1
            if conn.num_failures >= self._cfg.unhealthy_after_failures:
                self._mark_unhealthy(conn, f"Stats failed {conn.num_failures}x: {e.code().name} {e.details()}")
            return False
        conn.num_failures = 0
        wid = conn.worker_id
        if wid is None or self._fleet.get(wid) is None:
            return False
        known = conn.info.incarnation if conn.info else ""
        if raw.incarnation and known and raw.incarnation != known:
            # restarted between polls, too quickly for failed polls to show it: its cache, counters and KV
            # sequence numbers began again, so reconnect (Info) and rebuild its view from a fresh snapshot
            self._mark_unhealthy(conn, f"restarted (incarnation {known} -> {raw.incarnation})")
            return False
        now = self._clock.now()
        sample = api.stats_from_proto(raw)
        self._fleet.apply_stats(wid, sample, now)
        state = state_of(raw.state, conn.drained)
        rec = self._fleet.get(wid)
        assert rec is not None
        if rec.state is not state:
            self._fleet.set_state(wid, state)
            self._changed(wid)
        self._metrics.observe_worker_stats(
            wid, rec.kv_usage_frac, sample.num_running, sample.num_waiting,
            sample.prefix_cache_queries, sample.prefix_cache_hits,
        )
        self._notify()
        return True

    async def probe(self, worker_id: WorkerId, reason: str) -> None:
        """A request saw this worker fail: check it now instead of waiting for the next polls."""
        rec = self._fleet.get(worker_id)
        conn = self._conns.get(rec.info.address) if rec else None
        if conn is None or not conn.connected:
            return
        try:
            await conn.stub.Stats(worker_pb2.StatsRequest(), timeout=self._cfg.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            self._mark_unhealthy(conn, f"{reason}; probe: {e.code().name}")

    def report_failure(self, worker_id: WorkerId, reason: str) -> None:
        self._spawn(self.probe(worker_id, reason))

    async def _run(self, conn: WorkerConn) -> None:
        """Connect, then poll Stats every `poll_interval_s`; reconnect every `health_interval_s` when down."""
        first = True
        while not conn.removed:
            if not conn.connected:
                ok = await self._connect(conn, first)
                first = False
                conn.first_attempt.set()
                if not ok:
                    await asyncio.sleep(self._cfg.health_interval_s)
                    continue
            await self._poll_stats(conn)
            await asyncio.sleep(self.poll_interval_s)

    # ------------------------------------------------------------------ KV events
    async def _kv_loop(self, conn: WorkerConn) -> None:
        """One KvEvents subscription per worker, resumed after the last applied seq (0 after a health loss,
        which makes the worker send a fresh snapshot)."""
        while not conn.removed:
            await conn.kv_ready.wait()
            wid = conn.worker_id
            rec = self._fleet.get(wid) if wid else None
            if wid is None or rec is None:
                conn.kv_ready.clear()
                continue
            call = conn.stub.KvEvents(
                worker_pb2.KvEventsRequest(start_after_seq=rec.last_kv_seq, incarnation=rec.info.incarnation)
            )
            self._metrics.kv_streams.labels(wid).inc()
            try:
                async for raw in call:
                    batch = api.kv_batch_from_proto(raw, self.origin if self.mirror.active else None)
                    rec = self._fleet.get(wid)
                    if rec is None or not rec.healthy:
                        break
                    if batch.seq and batch.seq <= rec.last_kv_seq:
                        continue  # replay overlap
                    if batch.snapshot:  # its requests are every one open there: forget what a gap may have left
                        self.mirror.forget_worker(wid, self._clock.now())
                    if batch.requests:  # before the blocks: an admission precedes what its prefill stores
                        self.mirror.apply(wid, rec.model, batch.requests, self._clock.now())
                    if batch.requests or batch.snapshot:
                        self._metrics.worker_peer_in_flight.labels(wid).set(rec.peer_in_flight)
                    self._fleet.apply_kv_events(wid, batch)
                    self._policy.on_kv_events(wid, batch)
                    self._metrics.observe_kv_batch(wid, batch, time.time())
            except grpc.aio.AioRpcError as e:
                if e.code() is grpc.StatusCode.UNIMPLEMENTED:
                    log.warning("worker %s has no KvEvents: prefix view stays empty for it", wid)
                    return
                if e.code() is not grpc.StatusCode.CANCELLED:
                    log.info("KV event stream of %s ended: %s %s", wid, e.code().name, e.details())
            finally:
                call.cancel()
            # Back off one stats period so a dead worker does not spin this loop; the poll loop decides health.
            await asyncio.sleep(self._cfg.stats_interval_s)


def state_of(lifecycle: int, drained: bool) -> WorkerState:
    return WorkerState.DRAINING if drained else api.state_from_proto(lifecycle)
