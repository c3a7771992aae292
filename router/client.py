"""Python clients for the router: `AsyncRouterClient` (grpc.aio) and `RouterClient` (blocking), with admin calls.

    async with AsyncRouterClient("127.0.0.1:50051", admin_address="127.0.0.1:50052") as c:
        async for chunk in c.generate("mistral-7b", prompt="Hello", max_tokens=32):
            print(chunk.text, end="")
        print((await c.complete("mistral-7b", prompt="Hi", max_tokens=8)).timings)

Over TLS, give `tls=ClientTls(ca="ca.pem")` (and `cert=`/`key=` where the router requires client certificates);
both addresses use it. Where the router requires API keys (`server.api_keys_file`), give `api_key=` (and
`admin_api_key=` when the Admin service has keys of its own; it defaults to `api_key`).

Errors surface as `grpc.RpcError` / `grpc.aio.AioRpcError` with the router's status code and message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc

from switchyard.auth import aio_bearer_key, bearer_key
from switchyard.tls import ClientTls, aio_channel, channel
from switchyard.v1 import common_pb2, router_pb2, router_pb2_grpc

Message = tuple[str, str] | Mapping[str, str]  # (role, content) or {"role": ..., "content": ...}


def make_request(
    model: str,
    *,
    prompt: str | None = None,
    messages: Sequence[Message] | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int = 16,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop: Sequence[str] = (),
    request_id: str = "",
    lora_name: str = "",
    cache_salt: str = "",
    priority: int = 0,
    session_id: str = "",
    predicted_output_tokens_hint: int = 0,
    stream_interval_tokens: int = 0,
) -> router_pb2.GenerateRequest:
    """Build a GenerateRequest; give exactly one of prompt / messages / token_ids. `stream_interval_tokens`: token
    ids per streamed chunk (the first goes alone); 0 = the router's default."""
    sampling = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, stop=list(stop))
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    req = router_pb2.GenerateRequest(
        request_id=request_id, model=model, sampling=sampling, lora_name=lora_name, cache_salt=cache_salt,
        priority=priority, session_id=session_id, predicted_output_tokens_hint=predicted_output_tokens_hint,
        stream_interval_tokens=stream_interval_tokens,
    )
    if sum(x is not None for x in (prompt, messages, token_ids)) > 1:
        raise ValueError("give only one of prompt, messages, token_ids")
    if prompt is not None:
        req.prompt = prompt
    elif messages is not None:
        for m in messages:
            role, content = (m["role"], m["content"]) if isinstance(m, Mapping) else m
            req.chat.messages.add(role=role, content=content)
    elif token_ids is not None:
        req.tokens.ids.extend(token_ids)
    return req


def _request(model: str | None, request: router_pb2.GenerateRequest | None, kw: dict[str, Any]) -> router_pb2.GenerateRequest:
    if request is not None:
        return request
    if model is None:
        raise ValueError("give a model (and request fields) or a prebuilt request")
    return make_request(model, **kw)


class AsyncRouterClient:
    def __init__(self, address: str, admin_address: str | None = None, *, tls: ClientTls | None = None,
                 api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self._channel = aio_channel(address, tls, interceptors=aio_bearer_key(api_key))
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._admin_channel = (aio_channel(admin_address, tls, interceptors=aio_bearer_key(admin_api_key or api_key))
                               if admin_address else None)
        self._admin = router_pb2_grpc.AdminStub(self._admin_channel) if self._admin_channel else None

    async def __aenter__(self) -> AsyncRouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        if self._admin_channel is not None:
            await self._admin_channel.close()

    def generate_call(
        self, model: str | None = None, *, request: router_pb2.GenerateRequest | None = None,
        timeout: float | None = None, **kw: Any,
    ) -> grpc.aio.UnaryStreamCall:
        """The raw streaming call (iterate it, `cancel()` it, read its status)."""
        return self._stub.Generate(_request(model, request, kw), timeout=timeout)

    async def generate(
        self, model: str | None = None, *, request: router_pb2.GenerateRequest | None = None,
        timeout: float | None = None, **kw: Any,
    ) -> AsyncIterator[router_pb2.GenerateChunk]:
        call = self.generate_call(model, request=request, timeout=timeout, **kw)
        try:
            async for chunk in call:
                yield chunk
        finally:
            call.cancel()

    async def complete(
        self, model: str | None = None, *, request: router_pb2.GenerateRequest | None = None,
        timeout: float | None = None, **kw: Any,
    ) -> router_pb2.CompleteResponse:
        return await self._stub.Complete(_request(model, request, kw), timeout=timeout)

    def _admin_stub(self) -> router_pb2_grpc.AdminStub:
        if self._admin is None:
            raise RuntimeError("this client has no admin_address")
        return self._admin

    async def list_workers(self) -> list[router_pb2.WorkerStatus]:
        return list((await self._admin_stub().ListWorkers(router_pb2.ListWorkersRequest())).workers)

    async def register_worker(self, address: str, timeout: float | None = None) -> router_pb2.WorkerStatus:
        return await self._admin_stub().RegisterWorker(router_pb2.RegisterWorkerRequest(address=address), timeout=timeout)

    async def deregister_worker(self, worker_id: str) -> router_pb2.WorkerStatus:
        return await self._admin_stub().DeregisterWorker(router_pb2.WorkerRef(worker_id=worker_id))

    async def drain_worker(self, worker_id: str) -> router_pb2.WorkerStatus:
        return await self._admin_stub().DrainWorker(router_pb2.WorkerRef(worker_id=worker_id))


class RouterClient:
    """Blocking twin of `AsyncRouterClient` (for scripts and benchmarks that are not async)."""

    def __init__(self, address: str, admin_address: str | None = None, *, tls: ClientTls | None = None,
                 api_key: str | None = None, admin_api_key: str | None = None) -> None:
        self._channel = channel(address, tls, interceptors=bearer_key(api_key))
        self._stub = router_pb2_grpc.RouterStub(self._channel)
        self._admin_channel = (channel(admin_address, tls, interceptors=bearer_key(admin_api_key or api_key))
                               if admin_address else None)
        self._admin = router_pb2_grpc.AdminStub(self._admin_channel) if self._admin_channel else None

    def __enter__(self) -> RouterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        if self._admin_channel is not None:
            self._admin_channel.close()

    def generate(
        self, model: str | None = None, *, request: router_pb2.GenerateRequest | None = None,
        timeout: float | None = None, **kw: Any,
    ) -> Iterator[router_pb2.GenerateChunk]:
        """The streaming call: iterate it for chunks; `.cancel()` it to stop early."""
        return self._stub.Generate(_request(model, request, kw), timeout=timeout)

    def complete(
        self, model: str | None = None, *, request: router_pb2.GenerateRequest | None = None,
        timeout: float | None = None, **kw: Any,
    ) -> router_pb2.CompleteResponse:
        return self._stub.Complete(_request(model, request, kw), timeout=timeout)

    def _admin_stub(self) -> router_pb2_grpc.AdminStub:
        if self._admin is None:
            raise RuntimeError("this client has no admin_address")
        return self._admin

    def list_workers(self) -> list[router_pb2.WorkerStatus]:
        return list(self._admin_stub().ListWorkers(router_pb2.ListWorkersRequest()).workers)

    def register_worker(self, address: str, timeout: float | None = None) -> router_pb2.WorkerStatus:
        return self._admin_stub().RegisterWorker(router_pb2.RegisterWorkerRequest(address=address), timeout=timeout)

    def deregister_worker(self, worker_id: str) -> router_pb2.WorkerStatus:
        return self._admin_stub().DeregisterWorker(router_pb2.WorkerRef(worker_id=worker_id))

    def drain_worker(self, worker_id: str) -> router_pb2.WorkerStatus:
        return self._admin_stub().DrainWorker(router_pb2.WorkerRef(worker_id=worker_id))
