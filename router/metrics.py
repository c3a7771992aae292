"""Prometheus metrics of the router (`switchyard_` prefix), on their own registry and HTTP port.

One `RouterMetrics` per daemon; its own `CollectorRegistry` (not the process-global one) so tests can build
several. Latency histograms are in seconds; label sets stay small (model, worker, status, policy).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from switchyard.tls import ServerTls
from switchyard.workers.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch

log = logging.getLogger(__name__)

# 1 ms .. 2 min: TTFT / E2E / queue time of LLM requests
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)
# 1 ms .. 1 s per output token
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
# 1 us .. 100 ms: routing decisions and tokenization are CPU work on the hot path
CPU_BUCKETS_S = (
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1,
)
# 0.5 ms .. 1 s: length prediction (queue to the predictor thread + one batched inference)
PREDICT_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# 10 us .. 1 s: garbage-collector pauses (young generations ~10-100 us, a full one up to hundreds of ms)
GC_BUCKETS_S = (1e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
# 100 us .. 5 s: a KV event batch from its worker's publish to the router applying it
KV_LAG_BUCKETS_S = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 5.0)
# output tokens, and |predicted - observed| output tokens
TOKEN_BUCKETS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter(
            "switchyard_requests", "Finished requests by model, serving worker and gRPC status",
            ["model", "worker", "status"], registry=r,
        )
        self.unauthenticated = Counter(
            "switchyard_unauthenticated", "Calls refused for a missing or unknown API key, by service", ["service"],
            registry=r,
        )
        self.key_calls = Counter(
            "switchyard_api_key_calls", "Calls admitted under each API key (its name), by service", ["service", "key"],
            registry=r,
        )
        self.key_limited = Counter(
            "switchyard_api_key_limited", "Calls refused RESOURCE_EXHAUSTED by their API key's limit (max_in_flight, "
            "rate, tokens_per_min), by service", ["service", "key", "limit"], registry=r,
        )
        self.key_tokens = Counter(
            "switchyard_api_key_tokens", "Model tokens (prompt + output) used by the requests of each API key with a "
            "tokens_per_min limit, by service", ["service", "key"], registry=r,
        )
        self.key_in_flight = Gauge(
            "switchyard_api_key_in_flight", "Calls in flight under each API key, by service", ["service", "key"],
            registry=r,
        )
        self.key_peer_in_flight = Gauge(
            "switchyard_api_key_peer_in_flight", "Requests of each Router-service API key other router replicas have "
            "in flight on the workers (they count toward the key's limits here too)", ["key"], registry=r,
        )
        self.ttft = Histogram(
            "switchyard_ttft_seconds", "Arrival at the router to the first token sent", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.tpot = Histogram(
            "switchyard_tpot_seconds", "Time per output token after the first", ["model"],
            buckets=TPOT_BUCKETS_S, registry=r,
        )
        self.e2e = Histogram(
            "switchyard_e2e_seconds", "Arrival at the router to the last chunk", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.queue_time = Histogram(
            "switchyard_queue_seconds", "Time spent in the router's queue (0 when not held)", ["model"],
            buckets=LATENCY_BUCKETS_S, registry=r,
        )
        self.route_time = Histogram(
            "switchyard_routing_decision_seconds", "Time of one Policy.select call", ["policy"],
            buckets=CPU_BUCKETS_S, registry=r,
        )
        self.tick_time = Histogram(
            "switchyard_policy_tick_seconds", "Time of one Policy.on_tick call (background work: E2's rebalancing, "
            "gc and eviction-order warm-up; the event loop stops meanwhile)", ["policy"],
            buckets=GC_BUCKETS_S, registry=r,
        )
        self.tokenize_time = Histogram(
            "switchyard_tokenization_seconds", "Tokenization (chat template) plus block hashing of a prompt",
            ["model"], buckets=CPU_BUCKETS_S, registry=r,
        )
        self.queue_depth = Gauge("switchyard_queue_depth", "Requests waiting in the router's queue", ["model"], registry=r)
        self.queue_rejected = Counter(
            "switchyard_queue_rejected", "Requests rejected because the queue was full", ["model"], registry=r
        )
        self.deadline_exceeded = Counter(
            "switchyard_deadline_exceeded", "Requests whose gRPC deadline passed, by where they were",
            ["model", "stage"], registry=r,
        )
        self.cancelled = Counter(
            "switchyard_cancelled", "Requests cancelled by the client, by where they were", ["model", "stage"],
            registry=r,
        )
        self.retries = Counter(
            "switchyard_retries", "Dispatch retries after a worker failed before the first token",
            ["model", "reason"], registry=r,
        )
        self.worker_sessions = Counter(
            "switchyard_worker_sessions", "Session streams opened to a worker (`workers.session`): one serves all "
            "the requests sent to it until it ends", ["worker"], registry=r,
        )
        self.gc_pauses = Histogram(
            "switchyard_gc_pause_seconds", "Pauses of the cyclic garbage collector, by generation (the event loop "
            "stops meanwhile)", ["generation"], buckets=GC_BUCKETS_S, registry=r,
        )
        self.loop_lag = Histogram(
            "switchyard_event_loop_lag_seconds", "How late the event loop ran a 50 ms timer: the time every request's "
            "next step waited for other work (sampled 20 times a second)", buckets=GC_BUCKETS_S, registry=r,
        )
        self.stream_interval = Gauge(
            "switchyard_stream_interval_tokens", "Token ids per chunk for Generate requests that do not choose "
            "(server.stream_interval_tokens, raised under loop lag up to server.stream_interval_max_tokens)",
            registry=r,
        )
        self.policy_actions = Counter(
            "switchyard_policy_actions", "Background actions of the routing policy (E2: rebalancing redirects, "
            "hot-prefix replicas; `Policy.counters`)", ["policy", "action"], registry=r,
        )
        self._policy_counts: dict[tuple[str, str], int] = {}
        self.policy_state = Gauge(
            "switchyard_policy_state", "Sizes of what the routing policy holds, at its last tick (E2: tree nodes and "
            "blocks, the block index's bytes, requests in flight; the peers: their trees, tables and indexes; "
            "`Policy.state_sizes`)", ["policy", "quantity"],
            registry=r,
        )
        self.worker_in_flight = Gauge(
            "switchyard_worker_in_flight", "Requests this router has in flight on a worker", ["worker"], registry=r
        )
        self.worker_peer_in_flight = Gauge(
            "switchyard_worker_peer_in_flight", "Requests other router replicas have in flight on a worker, from the "
            "worker's request events (0 unless the policy mirrors them or the Router service has API keys)",
            ["worker"], registry=r,
        )
        self.worker_kv_usage = Gauge(
            "switchyard_worker_kv_usage_ratio", "KV cache usage from the worker's last Stats (0-1)", ["worker"],
            registry=r,
        )
        self.worker_running = Gauge(
            "switchyard_worker_num_running", "Running requests from the worker's last Stats", ["worker"], registry=r
        )
        self.worker_waiting = Gauge(
            "switchyard_worker_num_waiting", "Waiting requests from the worker's last Stats", ["worker"], registry=r
        )
        self.worker_healthy = Gauge(
            "switchyard_worker_healthy", "1 when the worker answers Stats and is routable", ["worker"], registry=r
        )
        self.prefix_hit_ratio = Gauge(
            "switchyard_worker_prefix_cache_hit_ratio",
            "Cumulative prefix-cache hits / queries (tokens) from the worker's Stats", ["worker"], registry=r,
        )
        # the KV event streams: how the router's view of the workers' caches keeps up with them
        self.kv_streams = Counter(
            "switchyard_kv_streams", "KvEvents subscriptions opened to a worker: the first, and one per resume after "
            "its stream ended (a reconnect, or a fresh snapshot after a health loss)", ["worker"], registry=r,
        )
        self.kv_batches = Counter(
            "switchyard_kv_event_batches", "KV event batches applied to the router's view of a worker's cache",
            ["worker"], registry=r,
        )
        self.kv_blocks = Counter(
            "switchyard_kv_event_blocks", "Blocks named by applied KV events: stored, removed; cleared counts "
            "AllBlocksCleared events (one opens every snapshot)", ["worker", "kind"], registry=r,
        )
        self.kv_lag = Histogram(
            "switchyard_kv_event_lag_seconds", "From a worker publishing a KV event batch (its wall clock) to the "
            "router applying it; across hosts only as good as their clock sync", buckets=KV_LAG_BUCKETS_S, registry=r,
        )
        self._kv_children: dict[str, tuple[Any, Any, Any, Any]] = {}
        self.predictions = Counter(
            "switchyard_predictions", "Settled output-length predictions by who answered: model, hint, memo or fallback",
            ["source"], registry=r,
        )
        self.predictor_misses = Counter(
            "switchyard_predictor_misses",
            "Predictions the model did not answer in time for routing: error, timeout, early_bind (queue released "
            "the request first)", ["reason"], registry=r,
        )
        self.predicted_tokens = Histogram(
            "switchyard_predicted_output_tokens", "Predicted output tokens handed to the policy", ["source"],
            buckets=TOKEN_BUCKETS, registry=r,
        )
        self.predictor_abs_error = Histogram(
            "switchyard_predictor_abs_error_tokens", "|predicted - actual| output tokens of finished requests",
            ["source"], buckets=TOKEN_BUCKETS, registry=r,
        )
        self.predictor_latency = Histogram(
            "switchyard_predictor_latency_seconds", "Admission to the model's answer (hand-off, batching, inference)",
            buckets=PREDICT_BUCKETS_S, registry=r,
        )
        self.predictor_inference_time = Histogram(
            "switchyard_predictor_inference_seconds", "One batched predictor call (tokenize + ONNX Runtime)",
            buckets=PREDICT_BUCKETS_S, registry=r,
        )
        self.predictor_batch_size = Histogram(
            "switchyard_predictor_batch_size", "Requests per predictor call", buckets=BATCH_SIZE_BUCKETS, registry=r,
        )
        self._http: Any = None

    def observe_worker_stats(
        self, worker: str, kv_usage_frac: float, num_running: int, num_waiting: int, queries: int, hits: int
    ) -> None:
        self.worker_kv_usage.labels(worker).set(kv_usage_frac)
        self.worker_running.labels(worker).set(num_running)
        self.worker_waiting.labels(worker).set(num_waiting)
        self.prefix_hit_ratio.labels(worker).set(hits / queries if queries else 0.0)

    def observe_kv_batch(self, worker: str, batch: KvEventBatch, now_wall_s: float) -> None:
        """One applied batch: its blocks by kind and its lag (series children kept per worker: a stream's batches
        come one per engine step)."""
        ch = self._kv_children.get(worker)
        if ch is None:
            ch = self._kv_children[worker] = (
                self.kv_batches.labels(worker), self.kv_blocks.labels(worker, "stored"),
                self.kv_blocks.labels(worker, "removed"), self.kv_blocks.labels(worker, "cleared"),
            )
        batches, stored, removed, cleared = ch
        batches.inc()
        n_stored = n_removed = n_cleared = 0
        for e in batch.events:
            if type(e) is BlockStored:
                n_stored += len(e.block_hashes)
            elif type(e) is BlockRemoved:
                n_removed += len(e.block_hashes)
            elif type(e) is AllBlocksCleared:
                n_cleared += 1
        if n_stored:
            stored.inc(n_stored)
        if n_removed:
            removed.inc(n_removed)
        if n_cleared:
            cleared.inc(n_cleared)
        if batch.ts:
            self.kv_lag.observe(max(now_wall_s - batch.ts, 0.0))

    def observe_policy_counters(self, policy: str, counts: dict[str, int]) -> None:
        """Advance `switchyard_policy_actions_total` to the policy's cumulative `counts` (each series shows from
        the first call, at 0 until the policy acts)."""
        for action, n in counts.items():
            series = self.policy_actions.labels(policy, action)
            seen = self._policy_counts.get((policy, action), 0)
            if n > seen:
                series.inc(n - seen)
                self._policy_counts[(policy, action)] = n

    def observe_policy_state(self, policy: str, sizes: dict[str, int]) -> None:
        for quantity, n in sizes.items():
            self.policy_state.labels(policy, quantity).set(n)

    def forget_worker(self, worker: str) -> None:
        for gauge in (
            self.worker_in_flight, self.worker_peer_in_flight, self.worker_kv_usage, self.worker_running,
            self.worker_waiting, self.worker_healthy, self.prefix_hit_ratio,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(worker)
        self._kv_children.pop(worker, None)
        for counter in (self.kv_streams, self.kv_batches, self.worker_sessions):
            with contextlib.suppress(KeyError):
                counter.remove(worker)
        for kind in ("stored", "removed", "cleared"):
            with contextlib.suppress(KeyError):
                self.kv_blocks.remove(worker, kind)

    def serve(self, host: str, port: int, tls: ServerTls | None = None) -> int:
        """Start the HTTP exporter in a daemon thread; returns the bound port (for port 0). With `tls`, HTTPS
        (mTLS with its client CA) whose rotated files serve the next scrape, as the gRPC servers' do; a bad file
        raises TlsError with its name."""
        if tls is None:
            server, _thread = start_http_server(port, addr=host, registry=self.registry)
        else:
            hello = tls.on_hello()  # reads and checks the files: a bad one gets its name here
            server, _thread = start_http_server(
                port, addr=host, registry=self.registry, certfile=tls.cert, keyfile=tls.key,
                client_cafile=tls.client_ca or None, client_auth_required=bool(tls.client_ca),
            )
            server.socket.context.sni_callback = hello
        self._http = server
        return int(server.server_port)

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


class KeyMetrics:
    """The API key interceptor's events (`switchyard.auth.KeyEvents`) for one service, as the metrics above."""

    def __init__(self, metrics: RouterMetrics, service: str) -> None:
        self._m, self._service = metrics, service

    def unauthenticated(self, service: str) -> None:
        self._m.unauthenticated.labels(service).inc()

    def started(self, key: str) -> None:
        self._m.key_calls.labels(self._service, key).inc()
        self._m.key_in_flight.labels(self._service, key).inc()

    def limited(self, key: str, limit: str) -> None:
        self._m.key_limited.labels(self._service, key, limit).inc()

    def ended(self, key: str) -> None:
        self._m.key_in_flight.labels(self._service, key).dec()

    def tokens(self, key: str, n: int) -> None:
        self._m.key_tokens.labels(self._service, key).inc(n)
