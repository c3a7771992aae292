"""The router daemon's lifecycle (uvicorn-style): startup -> serve -> graceful shutdown.

Startup: config, logging, length predictor (ONNX model or fallback), metrics exporter, worker registry (waits for
each static worker's first connect), public gRPC server (Router + health + reflection) and loopback Admin server;
then prints `READY <host>:<port> admin=<host>:<port> metrics=<host>:<port> predictor=<name>|fallback
[predictor_providers=<list>]` on stdout. Shutdown on SIGTERM/SIGINT (the handler only sets an event): health
NOT_SERVING -> stop accepting and drain in-flight up to `grace_s` -> close worker channels -> stop the predictor
thread -> stop the exporter. A second SIGINT forces an immediate stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import logging.config
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from switchyard.auth import ApiKeyInterceptor, ApiKeys, AuthError, KeyLimits
from switchyard.grpc_options import server_options
from switchyard.router.api import AdminService, RouterService
from switchyard.router.clock import RealClock
from switchyard.router.config import ConfigError, RouterConfig, load_config, parse_assignments, to_toml
from switchyard.router.dispatch import Dispatcher
from switchyard.router.fleet import Fleet
from switchyard.router.gc_watch import GcWatch
from switchyard.router.metrics import KeyMetrics, RouterMetrics
from switchyard.router.peer_keys import PeerKeyCharges
from switchyard.router.policies.registry import make_policy
from switchyard.router.predictor.onnx_predictor import PredictorLoadError
from switchyard.router.predictor.service import load_predictor, make_service
from switchyard.router.queue import RequestQueue
from switchyard.router.registry import WorkerRegistry
from switchyard.router.stream_governor import LOOP_LAG_PERIOD_S, StreamIntervalGovernor, watch_loop_lag
from switchyard.sd_notify import ServiceNotifier
from switchyard.tls import ServerTls, TlsError, add_port
from switchyard.v1 import router_pb2, router_pb2_grpc
from switchyard.workers.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)

# Named exit codes for startup failures.
EXIT_OK = 0
EXIT_CONFIG = 2
EXIT_BIND = 3
EXIT_FORCED = 130

class StartupError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# ---------------------------------------------------------------------- command line
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard serve", description="Run the Switchyard router daemon.")
    p.add_argument(
        "--config",
        help="TOML config file (sections: server, workers, routing, queue, limits, tokenizer, retries, predictor)",
    )
    p.add_argument("--host", help="server.host")
    p.add_argument("--port", type=int, help="server.port (0 = any free port)")
    p.add_argument("--admin-host", help="server.admin_host")
    p.add_argument("--admin-port", type=int, help="server.admin_port (0 = any free port)")
    p.add_argument("--metrics-port", type=int, help="server.metrics_port (0 = any free port)")
    p.add_argument("--no-metrics", action="store_true", help="server.metrics_enabled = false")
    p.add_argument("--grace-s", type=float, help="server.grace_s")
    p.add_argument("--log-level", help="server.log_level")
    p.add_argument("--worker", action="append", default=[], metavar="HOST:PORT", help="workers.addresses (repeatable)")
    p.add_argument("--policy", help="routing.policy")
    p.add_argument("--queue-max-size", type=int, help="queue.max_size")
    p.add_argument("--max-tokens", type=int, help="limits.max_tokens")
    p.add_argument("--tokenizer", help="tokenizer.default (a SentencePiece .model path)")
    p.add_argument(
        "--predictor", metavar="NAME|PATH|auto|none",
        help="predictor.model: an exported length predictor (auto = the default one when trained; none = fallback)",
    )
    p.add_argument("--predictor-threads", type=int, help="predictor.threads (ONNX Runtime intra-op threads)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="any config key")
    p.add_argument("--print-config", action="store_true", help="print the effective configuration as TOML and exit")
    return p


_FLAG_TO_KEY = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "admin_host": ("server", "admin_host"),
    "admin_port": ("server", "admin_port"),
    "metrics_port": ("server", "metrics_port"),
    "grace_s": ("server", "grace_s"),
    "log_level": ("server", "log_level"),
    "policy": ("routing", "policy"),
    "queue_max_size": ("queue", "max_size"),
    "max_tokens": ("limits", "max_tokens"),
    "tokenizer": ("tokenizer", "default"),
    "predictor": ("predictor", "model"),
    "predictor_threads": ("predictor", "threads"),
}


def config_from_args(argv: Sequence[str], environ: dict[str, str] | None = None) -> RouterConfig:
    return _config_from(build_parser().parse_args(list(argv)), environ)


def _config_from(args: argparse.Namespace, environ: dict[str, str] | None) -> RouterConfig:
    overrides: dict[str, dict[str, Any]] = parse_assignments(args.set)  # --set first: named flags win
    for flag, (section, key) in _FLAG_TO_KEY.items():
        value = getattr(args, flag)
        if value is not None:
            overrides.setdefault(section, {})[key] = value
    if args.worker:
        overrides.setdefault("workers", {})["addresses"] = [a for w in args.worker for a in w.split(",") if a]
    if args.no_metrics:
        overrides.setdefault("server", {})["metrics_enabled"] = False
    return load_config(args.config, environ, overrides)


def configure_logging(level: str) -> None:
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
            "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "plain"}},
            "root": {"level": level.upper(), "handlers": ["stderr"]},
            "loggers": {"grpc": {"level": "WARNING"}},
        }
    )


# ---------------------------------------------------------------------- the daemon
def make_tokenizer_for(config: RouterConfig) -> Callable[[str], Tokenizer]:
    paths = config.tokenizer.models
    default = config.tokenizer.default or None

    def tokenizer_for(model: str) -> Tokenizer:
        return load_tokenizer(paths.get(model, default))

    return tokenizer_for


@dataclass
class Bound:
    host: str
    port: int
    admin: str
    metrics: str
    predictor: str = "fallback"  # the length predictor's name, or "fallback"
    predictor_providers: tuple[str, ...] = ()  # ONNX Runtime's, as the session reports them

    def ready_line(self) -> str:
        line = f"READY {self.host}:{self.port} admin={self.admin} metrics={self.metrics} predictor={self.predictor}"
        if self.predictor_providers:
            line += f" predictor_providers={','.join(self.predictor_providers)}"
        return line


class RouterDaemon:
    """All components of one router, wired together; `start()`, then `stop()`."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.clock = RealClock()
        self.metrics = RouterMetrics()
        self.fleet = Fleet()
        self.policy = make_policy(config.routing.policy, config.routing.params)
        self.tokenizer_for = make_tokenizer_for(config)
        self.registry = WorkerRegistry(
            config.workers, self.fleet, self.policy, self.tokenizer_for, self.clock, self.metrics,
            channel_close_grace_s=config.server.grace_s,
        )
        self.queue = RequestQueue(config.queue.max_size)
        # Fallback-only until start() attaches the model (a load failure is a startup error, reported there).
        self.predictor = make_service(config.predictor, self.metrics)
        self.dispatcher = Dispatcher(
            self.fleet, self.registry, self.policy, config.routing.policy, self.queue, self.metrics, self.clock,
            kv_usage_hold_frac=config.queue.kv_usage_hold_frac,
            max_attempts=config.retries.max_attempts,
            retry_after_ms=config.queue.retry_after_ms,
            rpc_timeout_s=config.workers.rpc_timeout_s,
            stream_idle_timeout_s=config.workers.stream_idle_timeout_s,
            predictor=self.predictor,
        )
        self.registry.add_listener(self.dispatcher.schedule_pump)
        self.key_limits = KeyLimits()  # the Router service's API keys' calls in flight, rates and token buckets
        self.health = health.aio.HealthServicer()
        self.gc_watch = GcWatch(self.metrics.gc_pauses, config.server.gc_warn_ms / 1000)
        self.server: grpc.aio.Server | None = None
        self.admin_server: grpc.aio.Server | None = None
        self._tick_task: asyncio.Task[None] | None = None
        cfg = config.server
        self.stream_governor = StreamIntervalGovernor(
            cfg.stream_interval_tokens, max(cfg.stream_interval_max_tokens, cfg.stream_interval_tokens),
            cfg.stream_lag_target_ms / 1000,
        )
        self.metrics.stream_interval.set(cfg.stream_interval_tokens)
        self._lag_task: asyncio.Task[None] | None = None

    async def start(self) -> Bound:
        cfg = self.config.server
        for model, path in {"(default)": self.config.tokenizer.default, **self.config.tokenizer.models}.items():
            try:
                load_tokenizer(path or None)
            except (OSError, RuntimeError) as e:
                raise StartupError(f"cannot load tokenizer {path!r} for {model}: {e}", EXIT_CONFIG) from None
        self._start_predictor()
        metrics_addr = "disabled"
        if cfg.metrics_enabled:
            try:
                bound = self.metrics.serve(cfg.metrics_host, cfg.metrics_port, cfg.tls() if cfg.metrics_tls else None)
                metrics_addr = f"{cfg.metrics_host}:{bound}"
            except TlsError as e:
                raise StartupError(str(e), EXIT_CONFIG) from None
            except OSError as e:
                raise StartupError(f"cannot bind metrics on {cfg.metrics_host}:{cfg.metrics_port}: {e}", EXIT_BIND) from None

        if self.registry.tls is not None:
            try:  # read and check its files now, not at the first handshake (the servers' are, by _bind)
                self.registry.tls.credentials  # noqa: B018
            except TlsError as e:
                raise StartupError(str(e), EXIT_CONFIG) from None
        server_tls = cfg.tls()
        router_events = KeyMetrics(self.metrics, "switchyard.v1.Router")
        keys, router_keys = self._api_keys(cfg.api_keys_file, self.key_limits, router_events)
        admin_keys, _ = self._api_keys(cfg.admin_api_keys_file, KeyLimits(), KeyMetrics(self.metrics, "switchyard.v1.Admin"))
        if router_keys is not None:  # the other replicas' requests count toward their keys' limits here too
            gauge = self.metrics.key_peer_in_flight
            self.registry.mirror.keys = PeerKeyCharges(
                self.key_limits, router_keys.named, lambda name, n: gauge.labels(name).set(n)
            )

        options = server_options(cfg.keepalive_time_s, cfg.keepalive_timeout_s)
        self.server = grpc.aio.server(options=options, interceptors=keys)
        router_pb2_grpc.add_RouterServicer_to_server(
            RouterService(self.registry, self.dispatcher, self.tokenizer_for, self.config.limits.max_tokens,
                          self.clock, self.metrics, self.predictor, self.key_limits, router_events,
                          self.stream_governor),
            self.server,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (
            router_pb2.DESCRIPTOR.services_by_name["Router"].full_name,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        )
        reflection.enable_server_reflection(names, self.server)
        port = self._bind(self.server, cfg.host, cfg.port, server_tls)

        self.admin_server = grpc.aio.server(options=options, interceptors=admin_keys)
        router_pb2_grpc.add_AdminServicer_to_server(AdminService(self.registry), self.admin_server)
        admin_port = self._bind(self.admin_server, cfg.admin_host, cfg.admin_port, server_tls)

        await self.registry.start(self.config.workers.addresses)
        self._tick_task = asyncio.create_task(
            self.dispatcher.run_ticks(self.config.routing.tick_interval_ms / 1000), name="policy-tick"
        )
        self._lag_task = asyncio.create_task(watch_loop_lag(LOOP_LAG_PERIOD_S, self._on_loop_lag), name="loop-lag")
        await self.server.start()
        await self.admin_server.start()
        for name in ("", names[0]):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.gc_watch.start(freeze=cfg.gc_freeze_at_start)  # last: everything startup loaded is alive now
        model = self.predictor.predictor
        bound = Bound(
            cfg.host, port, f"{cfg.admin_host}:{admin_port}", metrics_addr,
            predictor=model.name if model is not None else "fallback",
            predictor_providers=tuple(model.providers) if model is not None else (),
        )
        log.info(
            "serving on %s:%d (admin %s, metrics %s) policy=%s%s workers=%d predictor=%s",
            cfg.host, port, bound.admin, metrics_addr, self.config.routing.policy,
            "".join(f" {k}={v}" for k, v in self.config.routing.params.items()), len(self.fleet.all_workers()),
            self.predictor.describe(),
        )
        return bound

    def _on_loop_lag(self, lag_s: float) -> None:
        self.metrics.loop_lag.observe(lag_s)
        governor = self.stream_governor
        if governor.adaptive:
            before = governor.interval
            governor.observe(lag_s, self.clock.now())
            if governor.interval != before:
                self.metrics.stream_interval.set(governor.interval)
                log.info("stream interval %d -> %d tokens (event loop lag %.1f ms over the last %.1f s)",
                         before, governor.interval, governor.last_lag_s * 1e3, governor.window_s)

    def _start_predictor(self) -> None:
        """Load the configured length predictor into the service the dispatcher already holds."""
        try:
            model = load_predictor(self.config.predictor)
        except PredictorLoadError as e:
            raise StartupError(str(e), EXIT_CONFIG) from None
        if model is not None:
            self.predictor.attach(model)

    @staticmethod
    def _api_keys(
        path: str, limits: KeyLimits, events: KeyMetrics
    ) -> tuple[list[ApiKeyInterceptor], ApiKeys | None]:
        """(The interceptor that checks a service's API keys, the keys): none without a file; a bad file stops
        startup."""
        if not path:
            return [], None
        try:
            keys = ApiKeys(path)
        except AuthError as e:
            raise StartupError(str(e), EXIT_CONFIG) from None
        return [ApiKeyInterceptor(keys, events, limits)], keys

    @staticmethod
    def _bind(server: grpc.aio.Server, host: str, port: int, server_tls: ServerTls | None) -> int:
        try:
            bound = add_port(server, f"{host}:{port}", server_tls)
        except TlsError as e:
            raise StartupError(str(e), EXIT_CONFIG) from None
        except RuntimeError as e:
            raise StartupError(f"cannot bind {host}:{port}: {e}", EXIT_BIND) from None
        if bound == 0:
            raise StartupError(f"cannot bind {host}:{port}", EXIT_BIND)
        return bound

    async def stop(self, grace_s: float) -> None:
        log.info("shutting down: %d requests in flight, grace %.1fs", self.dispatcher.num_active, grace_s)
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING
        if self.server is not None:
            await self.server.stop(grace_s)  # stop accepting; in-flight streams get `grace_s`, then are cancelled
        for task in (self._tick_task, self._lag_task):
            if task is not None:
                task.cancel()
        await self.dispatcher.close()
        if self.admin_server is not None:
            await self.admin_server.stop(0)
        await self.registry.close()
        self.predictor.close()
        self.gc_watch.stop()
        self.metrics.close()
        log.info("stopped")


async def serve(config: RouterConfig, ready: Callable[[Bound], None] | None = None) -> int:
    """Run until SIGTERM/SIGINT. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    shutdown = asyncio.Event()
    force = asyncio.Event()
    num_signals = 0

    def on_signal(sig: signal.Signals) -> None:  # only flips events (uvicorn)
        nonlocal num_signals
        num_signals += 1
        if num_signals > 1 and sig is signal.SIGINT:
            force.set()
        shutdown.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)

    daemon = RouterDaemon(config)
    notifier = ServiceNotifier()  # systemd's Type=notify (deploy/systemd); nothing outside systemd
    try:
        try:
            bound = await daemon.start()
        except StartupError:
            await daemon.stop(0)
            raise
        if ready is not None:
            ready(bound)
        notifier.ready(f"serving on {bound.host}:{bound.port} (admin {bound.admin}, metrics {bound.metrics})")
        notifier.start_watchdog()
        await shutdown.wait()
        notifier.stopping(f"draining {daemon.dispatcher.num_active} requests (grace {config.server.grace_s:g} s)")
        stopper = asyncio.create_task(daemon.stop(config.server.grace_s))
        forced = asyncio.create_task(force.wait())
        await asyncio.wait({stopper, forced}, return_when=asyncio.FIRST_COMPLETED)
        if not stopper.done():
            log.warning("second SIGINT: forcing shutdown")
            stopper.cancel()
            await asyncio.gather(stopper, return_exceptions=True)
            if daemon.server is not None:
                await daemon.server.stop(0)
            await daemon.registry.close()
            daemon.predictor.close()
            daemon.metrics.close()
            return EXIT_FORCED
        forced.cancel()
        return EXIT_OK
    finally:
        notifier.close()


def _print_ready(bound: Bound) -> None:
    print(bound.ready_line(), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        config = _config_from(args, None)
    except ConfigError as e:
        print(f"switchyard serve: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(to_toml(config), end="")
        return EXIT_OK
    configure_logging(config.server.log_level)
    try:
        import uvloop

        runner: Callable[..., int] = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is in the router extra
        log.warning("uvloop not installed; using the default asyncio loop")
        runner = asyncio.run
    try:
        return runner(serve(config, _print_ready))
    except StartupError as e:
        log.error("startup failed: %s", e)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(main())
