"""The vLLM worker: vLLM's v1 `AsyncLLM`, in-process, behind the gRPC `switchyard.v1.Worker` service.

Runs from vLLM's own environment (`make vllm-env` builds `.venv-vllm`):

    .venv-vllm/bin/switchyard worker vllm --model build/tiny-llama --dtype float32 --block-size 32 \\
        --enforce-eager --port 0          # prints `READY 127.0.0.1:<port> worker_id=... model=...`

- Generate: token-id prompts only (vLLM runs with `skip_tokenizer_init`); deltas are detokenized and stop
  strings applied here with the same SentencePiece tokenizer the router uses, as the simulated worker does.
  The priority is passed through when `--scheduling-policy priority`.
- KvEvents: vLLM's ZMQ KV-event publisher -> `VllmKvSubscriber` (binds; vLLM connects; gaps replayed) ->
  the same `KvEventHub` as the simulated worker (sequence numbers, replay buffer, snapshot for new streams).
- Stats: vLLM's own scheduler and iteration counters, through a stat logger plugged into AsyncLLM.
- Info: model, block size, max model length, KV capacity (blocks), hash algorithm and NONE_HASH seed.

vLLM starts its EngineCore with multiprocessing 'spawn', so this module's entry points must stay behind
`if __name__ == "__main__"` (the console script and `python -m switchyard` have it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from switchyard.ext.blockhash import block_digests, event_hashes
from switchyard.grpc_options import add_keepalive_args
from switchyard.sd_notify import ServiceNotifier
from switchyard.tls import add_server_args
from switchyard.v1 import worker_pb2, worker_pb2_grpc
from switchyard.workers import sim_worker
from switchyard.workers.engine import kv_events as kv
from switchyard.workers.engine.types import FinishReason, RequestOutput
from switchyard.workers.sim_worker import (
    EXIT_OK,
    EXIT_USAGE,
    SERVICE_NAME,
    IncrementalDetokenizer,
    KvEventHub,
    _Aborted,
    _Lifecycle,
    _Stream,
    bind_server,
)
from switchyard.workers.tokenizer import Tokenizer, load_tokenizer
from switchyard.workers.vllm_kv_subscriber import VllmKvSubscriber

log = logging.getLogger(__name__)

EXIT_ENGINE_FAILED = 4
HASH_ALGOS = ("sha256", "xxhash")  # the recipes switchyard.ext reproduces
_FINISH = {"length": FinishReason.LENGTH, "stop": FinishReason.STOP, "abort": FinishReason.ABORT}


# Run in a small child process: vLLM's EngineCore does not notice its parent's death, so a SIGKILLed worker
# would leave it running (and its shared memory behind). The guard waits for this process to vanish, then kills
# the processes it was given (pid + start time, so a reused pid is never hit): the EngineCore and the model runners
# under it, which notice the EngineCore's death by themselves only (20 s late once, on a loaded 2-core host), and
# hold their device memory until then.
_ORPHAN_GUARD = """
import os, signal, sys, time
parent = int(sys.argv[1])
targets = [tuple(map(int, a.split(":"))) for a in sys.argv[2:]]
def start_time(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except OSError:
        return None
while os.getppid() == parent:
    time.sleep(0.5)
for pid, started in targets:
    if start_time(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def _descendants() -> list[tuple[int, int]]:
    """(pid, start time) of this process's descendants, parents first, from /proc; not multiprocessing's resource
    trackers, which unlink the shared memory themselves once the processes that made it are gone."""
    procs: dict[int, tuple[int, int]] = {}  # pid -> (parent, start time)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"resource_tracker" in f.read():
                    continue
        except OSError:
            continue
        procs[int(entry)] = (int(fields[1]), int(fields[19]))
    out: list[tuple[int, int]] = []
    parents = [os.getpid()]
    while parents:
        children = [pid for pid, (ppid, _) in procs.items() if ppid in parents]
        out += [(pid, procs[pid][1]) for pid in children]
        parents = children
    return out


def start_orphan_guard() -> Any:
    """Start the guard over the current descendants (vLLM's EngineCore and its model runners; the resource tracker
    then exits too)."""
    import subprocess

    targets = [f"{pid}:{started}" for pid, started in _descendants()]
    if not targets or not os.path.isdir("/proc"):
        return None
    return subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_GUARD, str(os.getpid()), *targets],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )


def stop_resource_tracker() -> None:
    """Have multiprocessing's resource tracker unlink the shared memory vLLM's processes registered with it and did
    not free, and exit, before this process does. Left to itself it does so after: under the unit's KillMode=mixed
    systemd SIGKILLs whatever outlives the main process, and a killed tracker leaves the segments in /dev/shm.
    `_stop` is CPython's own (3.8+); there is no public way."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


class _Error:
    """Queued to a stream when vLLM rejected or failed the request."""

    __slots__ = ("code", "message")

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message


class EngineCounters:
    """A vLLM stat logger that keeps the engine's own counters for the Stats RPC.

    vLLM calls `record` once per engine output batch with the scheduler's snapshot (running/waiting, KV usage,
    prefix-cache queries/hits of the step, in tokens: the same numbers as vllm:prefix_cache_*_total) and the
    iteration's token counts.
    """

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prompt_tokens = 0  # computed (not cached) prompt tokens, as vLLM's throughput log
        self.generation_tokens = 0
        self.num_iterations = 0
        self.num_preemptions = 0

    def factory(self):  # type: ignore[no-untyped-def]
        """A `StatLoggerFactory` for AsyncLLM(stat_loggers=[...]) whose loggers write into this object."""
        from vllm.v1.metrics.loggers import StatLoggerBase

        counters = self

        class _Logger(StatLoggerBase):
            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):  # type: ignore[no-untyped-def]
                counters.record(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Logger

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            self.num_iterations += 1
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            pcs = scheduler_stats.prefix_cache_stats
            if pcs is not None:
                self.prefix_cache_queries += pcs.queries
                self.prefix_cache_hits += pcs.hits
        if iteration_stats is not None:
            self.prompt_tokens += iteration_stats.prompt_token_stats.computed
            self.generation_tokens += iteration_stats.num_generation_tokens
            self.num_preemptions += iteration_stats.num_preempted_reqs


class VllmWorker:
    """AsyncLLM, the request streams, the KV event hub and the counters; the servicer is a thin shell."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Tokenizer,
        worker_id: str,
        model: str,
        counters: EngineCounters,
        subscriber: VllmKvSubscriber,
        hub: KvEventHub,
        hash_algo: str,
        hash_seed: str,
        priority_scheduling: bool,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.model = model
        self.counters = counters
        self.subscriber = subscriber
        self.hub = hub
        self.hash_algo = hash_algo
        self.hash_seed = hash_seed
        self.priority_scheduling = priority_scheduling
        self.stream_interval = 1  # token ids per streamed chunk, at least (`--stream-interval`)
        cfg = engine.vllm_config
        self.block_size = int(cfg.cache_config.block_size)
        self.num_blocks = int(cfg.cache_config.num_gpu_blocks or 0)
        self.max_model_len = int(cfg.model_config.max_model_len)
        self.max_num_seqs = int(cfg.scheduler_config.max_num_seqs)
        self.max_num_batched_tokens = int(cfg.scheduler_config.max_num_batched_tokens)
        self.vocab_size = min(tokenizer.vocab_size, int(cfg.model_config.get_vocab_size()))
        self.state = worker_pb2.LIFECYCLE_STATE_STARTING
        self.streams: dict[str, _Stream] = {}
        self.pumps: dict[str, asyncio.Task[None]] = {}
        self.idle = asyncio.Event()
        self.idle.set()
        self.engine_dead = asyncio.Event()
        self.rates = sim_worker.TokenRateMeter()
        self.num_requests_received = 0  # Stats: every router's requests (fleet arrival rate)

    # ---------------------------------------------------------------- requests

    def sampling_params(self, sp: Any) -> Any:
        """proto SamplingParams -> vLLM's (stop strings are applied here, on our detokenized text)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kwargs: dict[str, Any] = {
            "max_tokens": sp.max_tokens,
            "ignore_eos": sp.ignore_eos,
            "output_kind": RequestOutputKind.DELTA,
            "detokenize": False,
        }
        if sp.HasField("temperature"):
            kwargs["temperature"] = sp.temperature
        if sp.HasField("top_p"):
            kwargs["top_p"] = sp.top_p
        if sp.HasField("seed"):
            kwargs["seed"] = sp.seed
        for key, raw in sp.extra.items():
            if key in kwargs or key in ("stop", "output_kind", "detokenize", "n"):
                raise ValueError(f"sampling.extra[{key!r}] is not allowed (use the dedicated field)")
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
            kwargs[key] = value
        try:
            return SamplingParams(**kwargs)
        except TypeError as e:
            raise ValueError(f"bad sampling.extra: {e}") from None

    def add(
        self,
        rid: str,
        prompt_ids: Sequence[int],
        params: Any,
        stops: list[str],
        priority: int,
        received_at: float,
        origin: str = "",
        predicted_output_tokens: int = 0,
        tenant: str = "",
    ) -> _Stream:
        stream = _Stream(rid, received_at, IncrementalDetokenizer(self.tokenizer, prompt_ids), stops)
        stream.num_prompt_tokens = len(prompt_ids)
        stream.origin = origin
        # every KV event subscriber (the router replicas that did not send it) learns of it at once; the hashes are
        # the ones vLLM's BlockStored will carry (its recipe, reported in Info)
        hashes = tuple(event_hashes(block_digests(list(prompt_ids), self.block_size, self.hash_algo,
                                                  seed=self.hash_seed)))
        self.hub.announce(kv.RequestAdmitted(
            rid, origin, hashes, len(prompt_ids), params.max_tokens, predicted_output_tokens, tenant=tenant,
        ))
        self.hub.flush_requests(time.time())
        self.streams[rid] = stream
        self.num_requests_received += 1
        self.idle.clear()
        self.pumps[rid] = asyncio.get_running_loop().create_task(
            self._pump(stream, list(prompt_ids), params, priority if self.priority_scheduling else 0),
            name=f"pump-{rid}",
        )
        return stream

    async def _pump(self, stream: _Stream, prompt_ids: list[int], params: Any, priority: int) -> None:
        """engine.generate -> the stream's queue, as the engine types the shared _Stream folds into chunks."""
        from vllm import TokensPrompt
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        rid = stream.request_id
        num_out = 0
        try:
            async for out in self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt_ids), params, rid, priority=priority
            ):
                co = out.outputs[0]
                new = tuple(co.token_ids)
                num_out += len(new)
                if new and not stream.first_token_at:
                    stream.first_token_at = time.time()
                    self.hub.announce(kv.RequestFirstToken(rid, stream.origin))
                    self.hub.flush_requests(stream.first_token_at)
                finish = None
                if out.finished:
                    finish = _FINISH.get(co.finish_reason or "stop", FinishReason.STOP)
                    if co.finish_reason == "error":
                        stream.queue.put_nowait(_Error(grpc.StatusCode.INTERNAL, "vLLM failed the request"))
                        return
                stream.queue.put_nowait(
                    RequestOutput(
                        request_id=rid,
                        new_token_ids=new,
                        finish_reason=finish,
                        num_prompt_tokens=len(prompt_ids),
                        num_cached_tokens=out.num_cached_tokens or 0,
                        num_output_tokens=num_out,
                    )
                )
        except asyncio.CancelledError:
            raise
        except (ValueError, VLLMClientError) as e:
            stream.queue.put_nowait(_Error(grpc.StatusCode.INVALID_ARGUMENT, str(e)))
        except EngineDeadError as e:
            log.error("vLLM's engine died: %s", e)
            stream.queue.put_nowait(_Error(grpc.StatusCode.UNAVAILABLE, "vLLM's engine died"))
            self.engine_dead.set()
        except Exception as e:
            log.exception("request %s failed in vLLM", rid)
            stream.queue.put_nowait(_Error(grpc.StatusCode.INTERNAL, f"vLLM failed the request: {e}"))

    def release(self, stream: _Stream) -> None:
        """The RPC ended: if vLLM still runs the request (client gone, stop string, error), cancel the pump,
        which makes AsyncLLM.generate abort it in the engine."""
        rid = stream.request_id
        pump = self.pumps.pop(rid, None)
        if pump is not None and not pump.done():
            pump.cancel()
        self.streams.pop(rid, None)
        self.hub.announce(stream.ended())
        self.hub.flush_requests(time.time())
        if not self.streams:
            self.idle.set()

    def abort(self, request_ids: Sequence[str]) -> int:
        num_aborted = 0
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is None or stream.is_finished or stream.is_engine_done:
                continue
            pump = self.pumps.get(rid)
            if pump is not None and not pump.done():
                pump.cancel()  # AsyncLLM.generate aborts the request in the engine
            stream.queue.put_nowait(_Aborted())
            num_aborted += 1
        return num_aborted

    # ---------------------------------------------------------------- kv events

    def on_kv_events(self, events: list[kv.KvEvent], ts: float) -> None:
        self.hub.publish(events, ts)

    # ---------------------------------------------------------------- info and stats

    def info(self) -> worker_pb2.WorkerInfo:
        return worker_pb2.WorkerInfo(
            worker_id=self.worker_id,
            model=self.model,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            kv_capacity_blocks=self.num_blocks,
            tokenizer_id=self.tokenizer.tokenizer_id,
            block_hash_algo=self.hash_algo,
            block_hash_seed=self.hash_seed,
            role=worker_pb2.WORKER_ROLE_MIXED,
            state=self.state,
            perf_profile="",
            engine="vllm",
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            incarnation=self.hub.incarnation,
            session=True,
        )

    def stats(self) -> worker_pb2.WorkerStats:
        t = time.time()
        c = self.counters
        prompt_rate, gen_rate = self.rates.rates(t, c.prompt_tokens, c.generation_tokens)
        # vLLM reports its scheduler only when it steps: once the last request left (an abort does not step)
        # its last snapshot is stale, so with no request open here the engine is idle by construction.
        busy = any(not s.is_finished for s in self.streams.values())
        running = c.num_running if busy else 0
        waiting = c.num_waiting if busy else 0
        used = round(c.kv_cache_usage * self.num_blocks)
        return worker_pb2.WorkerStats(
            num_running=running,
            num_waiting=waiting,
            kv_blocks_used=used,
            kv_blocks_total=self.num_blocks,
            prefix_cache_queries=c.prefix_cache_queries,
            prefix_cache_hits=c.prefix_cache_hits,
            prompt_tokens_per_s=prompt_rate,
            generation_tokens_per_s=gen_rate,
            num_iterations=c.num_iterations,
            num_preemptions=c.num_preemptions,
            timestamp=t,
            state=self.state,
            num_requests_received=self.num_requests_received,
            incarnation=self.hub.incarnation,
        )


class VllmServicer(sim_worker.WorkerServicer):
    """proto <-> VllmWorker: the simulated worker's servicer (its checks, Abort, Info, Stats and KvEvents on the
    same hub) with admission and chunking mapped onto AsyncLLM."""

    unavailable_message = "worker is not accepting requests"

    def __init__(self, worker: VllmWorker) -> None:
        super().__init__(worker)  # type: ignore[arg-type]

    def _admit(self, request: worker_pb2.WorkerGenerateRequest, rid: str, received_at: float) -> Any:
        w: VllmWorker = self.w  # type: ignore[assignment]
        try:
            params = w.sampling_params(request.sampling)
        except ValueError as e:
            raise sim_worker.RequestError(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return w.add(
            rid, request.prompt_token_ids, params, list(request.sampling.stop), request.priority, received_at,
            request.origin, max(0, request.predicted_output_tokens), request.tenant,
        )

    def _consume(self, stream: Any, items: list[Any]) -> worker_pb2.WorkerGenerateChunk | None:
        err = next((i for i in items if isinstance(i, _Error)), None)
        if err is not None:
            raise sim_worker.RequestError(err.code, err.message)
        return stream.consume(items)

    def _limits(self) -> tuple[int, int, int]:
        w: VllmWorker = self.w  # type: ignore[assignment]
        return w.max_model_len, w.max_model_len - 1, w.vocab_size  # vLLM keeps room for one output token

    def _validate(self, request: worker_pb2.WorkerGenerateRequest) -> str:
        error = super()._validate(request)
        if error:
            return error
        if request.lora_name:
            return "LoRA adapters are not supported by this worker"
        if request.cache_salt:
            return "cache_salt is not supported by this worker"
        return ""


# ---------------------------------------------------------------- process


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="switchyard worker vllm", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (reported on the READY line)")
    p.add_argument("--worker-id", default="", help="default: vllm-<port>")
    p.add_argument("--model", required=True, help="a local model directory or a Hugging Face model id")
    p.add_argument(
        "--served-model-name", default="", help="the model name requests use (default: the model dir's name)"
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="SentencePiece .model the router also loads (default: <model>/tokenizer.model)",
    )
    p.add_argument("--block-size", type=int, default=None, help="KV block size (CPU: a multiple of 32)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--dtype", default="auto", help="float32 avoids a bf16/AMX crash on vLLM-CPU")
    p.add_argument("--enforce-eager", action="store_true", help="skip torch.compile (starts in ~40 s on CPU)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None, help="cap the KV cache (blocks)")
    p.add_argument(
        "--kv-cache-space-gib",
        type=int,
        default=1,
        help="CPU backend: KV cache size (sets VLLM_CPU_KVCACHE_SPACE unless already set)",
    )
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--hash-algo", default="sha256", choices=HASH_ALGOS, help="--prefix-caching-hash-algo")
    p.add_argument(
        "--hash-seed",
        default=None,
        help="NONE_HASH seed (exported as PYTHONHASHSEED to the engine); required with xxhash, "
        "whose default seed is random per process",
    )
    p.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"))
    p.add_argument("--seed", type=int, default=None, help="vLLM's global seed")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other AsyncEngineArgs field (VALUE parsed as JSON when it parses)",
    )
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="SIGTERM: seconds in-flight requests get"
    )
    p.add_argument("--log-level", default="INFO")
    sim_worker.add_stream_interval_arg(p)
    add_server_args(p)
    add_keepalive_args(p)
    return p


def default_model_name(model: str) -> str:
    path = Path(model)
    return path.resolve().name if path.is_dir() else model


def default_tokenizer(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path / "tokenizer.model"
    from huggingface_hub import hf_hub_download  # installed with vLLM

    return Path(hf_hub_download(model, "tokenizer.model"))


def engine_args(args: argparse.Namespace, subscriber: VllmKvSubscriber, served: str) -> Any:
    from vllm.config import KVEventsConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs: dict[str, Any] = {
        "model": args.model,
        "served_model_name": [served],
        "skip_tokenizer_init": True,  # prompts arrive as token ids; we detokenize with the router's tokenizer
        "dtype": args.dtype,
        "enable_prefix_caching": True,
        "prefix_caching_hash_algo": args.hash_algo,
        "enforce_eager": args.enforce_eager,
        "tensor_parallel_size": args.tensor_parallel_size,
        "scheduling_policy": args.scheduling_policy,
        "kv_events_config": KVEventsConfig(**subscriber.kv_events_config()),
        "disable_log_stats": True,  # our EngineCounters logger still gets every stat (custom loggers on)
        "enable_log_requests": False,
    }
    if args.tensor_parallel_size == 1:
        # one device: run the model inside vLLM's EngineCore process instead of a separate worker process
        # (vLLM-CPU defaults to "mp"): one process and ~0.6 GB less per worker, and a faster start
        kwargs["distributed_executor_backend"] = "uni"
    optional = {
        "block_size": args.block_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "num_gpu_blocks_override": args.num_gpu_blocks_override,
        "seed": args.seed,
    }
    kwargs.update({k: v for k, v in optional.items() if v is not None})
    for item in args.engine_arg:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--engine-arg {item!r}: expected KEY=VALUE")
        try:
            kwargs[key.replace("-", "_")] = json.loads(raw)
        except ValueError:
            kwargs[key.replace("-", "_")] = raw
    return AsyncEngineArgs(**kwargs)


def prepare_environment(args: argparse.Namespace) -> str:
    """Environment vLLM reads at engine start; returns the block-hash seed the worker reports."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if args.hash_seed is not None:
        os.environ["PYTHONHASHSEED"] = args.hash_seed  # inherited by the EngineCore process
    seed = os.environ.get("PYTHONHASHSEED")
    if args.hash_algo == "xxhash" and seed is None:
        raise ValueError(
            "--hash-algo xxhash needs --hash-seed (vLLM draws a random seed per process otherwise)"
        )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_space_gib))
    # vLLM derives NONE_HASH from hash_fn(seed), "vllm-none-hash" by default, as switchyard.ext does from ""
    return "" if seed in (None, "vllm-none-hash") else seed


async def serve(args: argparse.Namespace) -> int:
    from vllm.v1.engine.async_llm import AsyncLLM

    served = args.served_model_name or default_model_name(args.model)
    # before the engine starts its processes, which must not inherit $NOTIFY_SOCKET (see sd_notify)
    notifier = ServiceNotifier()
    try:
        tokenizer = load_tokenizer(str(args.tokenizer or default_tokenizer(args.model)))
        hash_seed = prepare_environment(args)
    except (ValueError, OSError) as e:
        log.error("bad worker configuration: %s", e)
        return EXIT_USAGE
    bound = bind_server(args, log)
    if isinstance(bound, int):
        return bound
    server, port = bound

    counters = EngineCounters()
    holder: list[VllmWorker] = []
    subscriber = VllmKvSubscriber(lambda events, ts: holder[0].on_kv_events(events, ts) if holder else None)
    try:
        eargs = engine_args(args, subscriber, served)
    except (ValueError, TypeError) as e:
        log.error("bad engine arguments: %s", e)
        await subscriber.stop()
        return EXIT_USAGE
    subscriber.start()
    notifier.status(f"starting vLLM for {served}")  # minutes for a large model: the unit's TimeoutStartSec
    t0 = time.monotonic()
    try:
        engine = AsyncLLM.from_engine_args(eargs, stat_loggers=[counters.factory()])
    except Exception:
        log.exception("vLLM failed to start")
        await subscriber.stop()
        return EXIT_ENGINE_FAILED
    log.info("vLLM engine up in %.1f s", time.monotonic() - t0)
    guard = start_orphan_guard()
    hub = KvEventHub(subscriber.mirror.capture)
    worker = VllmWorker(
        engine,
        tokenizer,
        args.worker_id or f"vllm-{port}",
        served,
        counters,
        subscriber,
        hub,
        args.hash_algo,
        hash_seed,
        args.scheduling_policy == "priority",
    )
    worker.stream_interval = args.stream_interval
    holder.append(worker)
    servicer = VllmServicer(worker)
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    lifecycle = _Lifecycle(log)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lifecycle.on_signal, sig)

    await server.start()
    worker.state = worker_pb2.LIFECYCLE_STATE_READY
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(
        f"READY {args.host}:{port} worker_id={worker.worker_id} model={served} block_size={worker.block_size} "
        f"kv_blocks={worker.num_blocks} kv_events={subscriber.endpoint}",
        flush=True,
    )
    log.info("worker %s serving %s on %s:%d", worker.worker_id, served, args.host, port)
    notifier.ready(f"worker {worker.worker_id} serving {served} on {args.host}:{port}")
    notifier.start_watchdog()

    dead = asyncio.ensure_future(worker.engine_dead.wait())
    stop = asyncio.ensure_future(lifecycle.stop.wait())
    await asyncio.wait([dead, stop], return_when=asyncio.FIRST_COMPLETED)
    exit_code = EXIT_OK
    if worker.engine_dead.is_set():
        log.error("vLLM's engine is dead; exiting")
        exit_code = EXIT_ENGINE_FAILED
    else:
        notifier.stopping(f"draining {len(worker.streams)} requests")
        worker.state = worker_pb2.LIFECYCLE_STATE_DRAINING
        await health_servicer.enter_graceful_shutdown()
        waiters = [asyncio.ensure_future(worker.idle.wait()), asyncio.ensure_future(lifecycle.force.wait())]
        _, pending = await asyncio.wait(
            waiters, timeout=args.drain_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for fut in pending:
            fut.cancel()
    for fut in (dead, stop):
        fut.cancel()
    if worker.streams:
        log.warning("aborting %d unfinished requests", len(worker.streams))
        worker.abort(list(worker.streams))
    servicer.end_sessions()
    hub.close()
    await server.stop(grace=1.0)
    with notifier.keepalive(), contextlib.suppress(Exception):  # it blocks the loop while its processes exit
        engine.shutdown()
    await subscriber.stop()
    if guard is not None:
        guard.kill()
        guard.wait()
    stop_resource_tracker()
    notifier.close()
    log.info(
        "worker %s stopped (KV batches %d, replayed %d, lost %d)",
        worker.worker_id,
        subscriber.num_batches,
        subscriber.num_replayed,
        subscriber.num_lost,
    )
    return exit_code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # vLLM logs to stdout by default; stdout carries only the READY line (a launcher stops reading it after)
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
