"""`switchyard bench relay`: the floor of a Python gRPC router, a baseline for `bench live`.

It serves the router's `Generate` on the same stack as the daemon (grpc.aio on uvloop, the daemon's server and
channel options) and does nothing a router decides: no admission, hashing, queue, policy, metrics or hooks. A
token-id request goes round-robin to the next worker as a `WorkerGenerateRequest`, and the worker's chunks come
back as they arrive. Switchyard's router-added latency minus this relay's is what its own logic costs; the
relay's minus the direct-to-worker baseline is what one more Python gRPC hop costs. It reaches the workers as the
daemon does by default, over one Session stream per worker (`router/worker_session.py`), or with `--calls` one
Generate call per request, as a daemon with `workers.session = false`.

Benchmark only (`bench live` starts it beside the router): token-id prompts only, no retries, no Admin service.
Prints `READY host:port` once serving, like `switchyard serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import sys
from collections.abc import AsyncIterator

import grpc

from switchyard.grpc_options import CHANNEL_OPTIONS, server_options
from switchyard.router.worker_session import WorkerSender
from switchyard.v1 import router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc


class Relay(router_pb2_grpc.RouterServicer):
    def __init__(self, stubs: list[worker_pb2_grpc.WorkerStub], session: bool) -> None:
        self._next = itertools.cycle([WorkerSender(stub, f"worker {i}", session) for i, stub in enumerate(stubs)])

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        if request.WhichOneof("input") != "tokens" or not request.tokens.ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the relay takes token-id prompts only")
        call = next(self._next).send(
            worker_pb2.WorkerGenerateRequest(
                request_id=request.request_id, prompt_token_ids=request.tokens.ids, sampling=request.sampling,
                stream_interval_tokens=request.stream_interval_tokens,
            ),
            context.time_remaining(),
        )
        try:
            async for wc in call:
                yield router_pb2.GenerateChunk(
                    request_id=request.request_id, token_ids=wc.token_ids, text=wc.text,
                    finish_reason=wc.finish_reason, usage=wc.usage,
                )
        except grpc.aio.AioRpcError as e:
            await context.abort(e.code(), e.details() or "")
        finally:
            call.cancel()  # the client left early: abort it on the worker (a no-op once it ended)


async def serve(workers: list[str], host: str, port: int, session: bool) -> None:
    channels = [grpc.aio.insecure_channel(w, options=CHANNEL_OPTIONS) for w in workers]
    server = grpc.aio.server(options=server_options())
    router_pb2_grpc.add_RouterServicer_to_server(Relay([worker_pb2_grpc.WorkerStub(c) for c in channels], session), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await asyncio.gather(*(c.channel_ready() for c in channels))
    await server.start()
    print(f"READY {host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=1.0)
    for c in channels:
        await c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="switchyard bench relay", description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="append", required=True, help="worker host:port (repeat)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--calls", action="store_true",
                    help="one Generate call per request instead of one Session stream per worker")
    args = ap.parse_args(argv)
    import uvloop

    uvloop.run(serve(args.worker, args.host, args.port, not args.calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
