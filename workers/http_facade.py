"""An OpenAI/vLLM-compatible HTTP facade on the simulated worker, so real peer routers (smg, vllm-router) can
route to the very same worker processes Switchyard routes to over gRPC.

It runs on the worker's event loop next to the gRPC server and drives the same `SimWorker` (same engine, same
request streams, same `--timings-log`). Endpoints: everything specs/vllm-and-peer-routers.md section 2 lists as
needed for routability, plus the usual vLLM / SGLang probes:

    GET  /health /health_generate /v1/models /version /load /get_load /v1/loads /metrics /kv_event_sources
    GET  /server_info /get_server_info /model_info /get_model_info     (model_path/tokenizer_path: a LOCAL dir)
    POST /v1/completions /v1/chat/completions                          (JSON or SSE; stream_options.include_usage)
    POST /v1/completions/render /v1/chat/completions/render            (vLLM shape: [{"token_ids": [...], ...}])
    POST /tokenize /detokenize /flush_cache /reset_prefix_cache

Prompts: `"prompt"` is a string or a list of token ids (a one-element batch of either is accepted too); chat
requests go through the router's chat template (`Tokenizer.apply_chat_template`). The extra SGLang fields the
routers add (`echo`, `no_stop_trim`, `ignore_eos`, `skip_special_tokens`, `return_hidden_states`,
`max_completion_tokens`, `continue_final_message`, `separate_reasoning`, ...) are accepted; `ignore_eos`,
`echo` and `max_completion_tokens` are honoured, and so is vLLM's `stream_interval` (SSE events of at least that
many tokens after the first, raised to the worker's `--stream-interval`, as vLLM does).

Request ids: the engine and the timings log use the HTTP request's id: the `X-Request-Id` header when present,
else a generated `cmpl-<hex>` (`chatcmpl-<hex>` for chat). The client learns it from the response's `id` field
(every SSE chunk and the JSON body carry it) and from the `X-Request-Id` response header; `bench live --peers`
matches client samples to worker timings by the response `id`, which works whether or not a router forwards
the client's header.

aiohttp is an optional dependency (the `router` extra): this module is imported only when the worker is started
with `--http-port`, so the worker's minimal install (e.g. inside vLLM's environment) is unaffected.
smg probes each worker with an HTTP/2 preface (its gRPC detection); aiohttp answers it with a 400 and logs a
`BadHttpMessage`, which is harmless.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from switchyard.v1 import common_pb2, worker_pb2
from switchyard.workers.engine.types import EngineRequest
from switchyard.workers.sim_worker import ChunkGatherer, effective_stream_interval
from switchyard.workers.tokenizer import ChatMessage

if TYPE_CHECKING:
    from switchyard.workers.sim_worker import SimWorker
    from switchyard.workers.zmq_kv_publisher import ZmqKvPublisher

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's / vLLM's default for /v1/completions
_FINISH = {
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_ABORT: "abort",
}
_dumps = json.JSONEncoder(separators=(",", ":")).encode


class BadRequest(Exception):
    pass


def _error(status: int, message: str, kind: str = "BadRequestError") -> web.Response:
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return web.json_response(body, status=status, dumps=_dumps)


def _is_int(value: Any) -> bool:
    """A JSON integer (Python's bool is an int; JSON's true is not)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return _is_int(value) or isinstance(value, float)


def _as_text(content: Any) -> str:
    """OpenAI message content: a string, None, or a list of parts (only text parts are kept)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise BadRequest("message content must be a string or a list of parts")


def _usage(chunk: worker_pb2.WorkerGenerateChunk) -> dict[str, Any]:
    u = chunk.usage
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_prompt_tokens},
    }


class HttpFacade:
    """The aiohttp application over a `SimWorker`; `start()` binds and returns the port."""

    def __init__(
        self,
        worker: SimWorker,
        host: str = "127.0.0.1",
        port: int = 0,
        publisher: ZmqKvPublisher | None = None,
    ) -> None:
        self.w = worker
        self.host = host
        self.port = port
        self.publisher = publisher
        # smg loads a tokenizer from the reported model_path; a local directory keeps it off the HF hub.
        self.model_dir = str(Path(worker.tokenizer.path).resolve().parent)
        self.created = int(time.time())
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/ping", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/version", self.version)
        for path in ("/server_info", "/get_server_info"):
            r.add_get(path, self.server_info)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_load", self.get_load)
        r.add_get("/v1/loads", self.v1_loads)
        r.add_get("/load", self.load)
        r.add_get("/metrics", self.metrics)
        r.add_get("/kv_event_sources", self.kv_event_sources)
        for path in ("/flush_cache", "/reset_prefix_cache"):
            r.add_post(path, self.flush_cache)
        r.add_get("/flush_cache", self.flush_cache)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions/render", self.render_completions)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        return app

    async def start(self) -> int:
        access_log = logging.getLogger(f"{__name__}.access")
        self._runner = web.AppRunner(
            self.app, access_log=access_log if access_log.isEnabledFor(logging.DEBUG) else None
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        server = site._server  # noqa: SLF001 - aiohttp exposes the bound port only here
        assert server is not None and server.sockets
        self.port = server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # ---------------------------------------------------------------- probes and info

    def _ready(self) -> bool:
        return self.w.state == worker_pb2.LIFECYCLE_STATE_READY

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200) if self._ready() else web.Response(status=503, text="draining")

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "switchyard-sim"})

    async def models(self, request: web.Request) -> web.Response:
        w = self.w
        card = {
            "id": w.model,
            "object": "model",
            "created": self.created,
            "owned_by": "switchyard",
            "root": self.model_dir,
            "parent": None,
            "max_model_len": w.core.config.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    def _info(self) -> dict[str, Any]:
        w = self.w
        cfg = w.core.config
        return {
            "model_path": self.model_dir,
            "tokenizer_path": self.model_dir,
            "served_model_name": w.model,
            "model_id": w.model,
            "is_generation": True,
            "max_model_len": cfg.max_model_len,
            "context_length": cfg.max_model_len,
            "block_size": cfg.block_size,
            "page_size": cfg.block_size,
            "max_num_seqs": cfg.max_num_seqs,
            "max_running_requests": cfg.max_num_seqs,
            "max_num_batched_tokens": cfg.max_num_batched_tokens,
            "max_total_num_tokens": w.core.stats().kv_blocks_total * cfg.block_size,
            "vocab_size": w.tokenizer.vocab_size,
            "dp_size": 1,
            "tp_size": 1,
            "worker_id": w.worker_id,
            "engine": "switchyard-sim",
            "perf_profile": w.perf_profile,
            "block_hash_algo": w.core.block_hash_algo,
            "enable_prefix_caching": True,
            "kv_events": self._kv_sources().get("0"),
        }

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response(self._info(), dumps=_dumps)

    async def model_info(self, request: web.Request) -> web.Response:
        info = self._info()
        keys = ("model_path", "tokenizer_path", "served_model_name", "is_generation", "max_model_len")
        return web.json_response({k: info[k] for k in keys}, dumps=_dumps)

    def _kv_sources(self) -> dict[str, Any]:
        p = self.publisher
        if p is None:
            return {}
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": p.endpoint,
                "replay_endpoint": p.replay_endpoint,
                "topic": p.topic,
                "block_size": self.w.core.config.block_size,
            }
        }

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        return web.json_response(self._kv_sources(), dumps=_dumps)

    def _load(self) -> dict[str, Any]:
        s = self.w.stats()
        cfg = self.w.core.config
        used_tokens = s.kv_blocks_used * cfg.block_size
        total_tokens = s.kv_blocks_total * cfg.block_size
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        return {
            "dp_rank": 0,
            "num_running_reqs": s.num_running,
            "num_waiting_reqs": s.num_waiting,
            "num_total_reqs": s.num_running + s.num_waiting,
            "num_used_tokens": used_tokens,
            "max_total_num_tokens": total_tokens,
            "token_usage": usage,
            "active_token_usage": usage,
            "gen_throughput": s.generation_tokens_per_s,
            "cache_hit_rate": s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0,
            "utilization": min(1.0, s.num_running / cfg.max_num_seqs) if cfg.max_num_seqs else 0.0,
            "max_running_requests": cfg.max_num_seqs,
            "num_waiting_uncached_tokens": s.num_waiting_uncached_tokens,
        }

    async def get_load(self, request: web.Request) -> web.Response:
        """SGLang's legacy /get_load: one entry per DP rank."""
        return web.json_response([self._load()], dumps=_dumps)

    async def v1_loads(self, request: web.Request) -> web.Response:
        """SGLang's /v1/loads (what smg 1.13 polls first)."""
        return web.json_response(
            {"timestamp": time.time(), "dp_rank_count": 1, "loads": [self._load()]}, dumps=_dumps
        )

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's /load."""
        return web.json_response({"server_load": len(self.w.streams)})

    async def metrics(self, request: web.Request) -> web.Response:
        w = self.w
        s = w.stats()
        cfg = w.core.config
        lbl = f'engine="0",model_name="{w.model}"'
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        core = w.core.stats()
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{lbl}}} {float(s.num_running)}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{lbl}}} {float(s.num_waiting)}",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{lbl}}} {usage}",
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{lbl}}} {float(s.prefix_cache_queries)}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{lbl}}} {float(s.prefix_cache_hits)}",
            "# TYPE vllm:prompt_tokens counter",
            f"vllm:prompt_tokens_total{{{lbl}}} {float(core.prompt_tokens_total)}",
            "# TYPE vllm:generation_tokens counter",
            f"vllm:generation_tokens_total{{{lbl}}} {float(core.generation_tokens_total)}",
            "# TYPE vllm:num_preemptions counter",
            f"vllm:num_preemptions_total{{{lbl}}} {float(s.num_preemptions)}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{cfg.block_size}",enable_prefix_caching="True",'
            f'num_gpu_blocks="{s.kv_blocks_total}",prefix_caching_hash_algo="{w.core.block_hash_algo}"}} 1.0',
            "",
        ]
        return web.Response(text="\n".join(lines), content_type="text/plain", charset="utf-8")

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.w.core.reset_prefix_cache():
            return web.Response(text="Cache flushed.\n")
        return web.Response(status=400, text="Cache not flushed: requests are running.\n")

    # ---------------------------------------------------------------- tokenizer endpoints

    async def _json(self, request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BadRequest(f"invalid JSON body: {e}") from e
        if not isinstance(body, dict):
            raise BadRequest("the JSON body must be an object")
        return body

    def _chat_ids(self, body: dict[str, Any]) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("messages must be a non-empty list")
        out = []
        for m in msgs:
            if not isinstance(m, dict):
                raise BadRequest("each message must be an object")
            role = m.get("role", "user")
            out.append(ChatMessage("system" if role == "developer" else role, _as_text(m.get("content"))))
        try:
            return self.w.tokenizer.apply_chat_template(out)
        except ValueError as e:
            raise BadRequest(str(e)) from e

    def _prompt_ids(self, prompt: Any, add_bos: bool = True) -> tuple[list[int], str | None]:
        """(token ids, prompt text or None) for a completions prompt: str, [int...], or a 1-batch of either."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.w.tokenizer.encode(prompt, add_bos=add_bos), prompt
        if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
            return list(prompt), None
        if isinstance(prompt, list):
            raise BadRequest("batched prompts are not supported; send one prompt per request")
        raise BadRequest("prompt must be a string or a list of token ids")

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            add_special = body.get("add_special_tokens", True)
            if "messages" in body:
                ids = self._chat_ids(body)
            else:
                ids, _ = self._prompt_ids(body.get("prompt", ""), add_bos=bool(add_special))
        except BadRequest as e:
            return _error(400, str(e))
        strs = [self.w.tokenizer.id_to_piece(t) for t in ids] if body.get("return_token_strs") else None
        out = {"count": len(ids), "max_model_len": self.w.core.config.max_model_len, "tokens": ids,
               "token_strs": strs}  # fmt: skip
        return web.json_response(out, dumps=_dumps)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            tokens = body.get("tokens")
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise BadRequest("tokens must be a list of token ids")
        except BadRequest as e:
            return _error(400, str(e))
        return web.json_response({"prompt": self.w.tokenizer.decode(tokens)}, dumps=_dumps)

    # ---------------------------------------------------------------- generation

    def _sampling(self, body: dict[str, Any], prompt_len: int, chat: bool) -> dict[str, Any]:
        cfg = self.w.core.config
        max_tokens = body.get("max_completion_tokens")
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = cfg.max_model_len - prompt_len if chat else DEFAULT_COMPLETION_MAX_TOKENS
        if not _is_int(max_tokens) or max_tokens <= 0:
            raise BadRequest(f"max_tokens must be a positive integer (got {max_tokens!r})")
        if (body.get("n") or 1) != 1:
            raise BadRequest("only n=1 is supported")
        temperature = body.get("temperature")
        if temperature is not None and (not _is_number(temperature) or temperature < 0):
            raise BadRequest(f"temperature must be a number >= 0 (got {temperature!r})")
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise BadRequest(f"stop must be a string or a list of strings (got {stop!r})")
        seed = body.get("seed")
        return {
            "max_tokens": max_tokens,
            "ignore_eos": bool(body.get("ignore_eos", False)),
            "stop": stop,
            "seed": seed if isinstance(seed, int) else None,
            "temperature": temperature,
        }

    def _options(self, body: dict[str, Any]) -> dict[str, Any]:
        """The request's fields besides the prompt and sampling: priority, adapter, cache salt, stream options."""
        priority = body.get("priority") or 0
        if not _is_int(priority):
            raise BadRequest(f"priority must be an integer (got {priority!r})")
        names = {k: body.get(k) or None for k in ("lora_name", "cache_salt")}
        for k, v in names.items():
            if v is not None and not isinstance(v, str):
                raise BadRequest(f"{k} must be a string (got {v!r})")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise BadRequest(f"stream_options must be an object (got {opts!r})")
        interval = body.get("stream_interval")  # vLLM's: token ids per streamed chunk, at least
        if interval is not None and (not _is_int(interval) or interval < 1):
            raise BadRequest(f"stream_interval must be an integer >= 1 (got {interval!r})")
        return {"priority": priority, **names, "include_usage": bool(opts.get("include_usage")),
                "stream_interval": interval or 0}  # fmt: skip

    def _validate_prompt(self, ids: list[int]) -> None:
        cfg = self.w.core.config
        if not ids:
            raise BadRequest("the prompt is empty")
        if len(ids) > cfg.max_model_len:
            raise BadRequest(f"prompt has {len(ids)} tokens; max_model_len is {cfg.max_model_len}")
        if not 0 <= min(ids) <= max(ids) < self.w.tokenizer.vocab_size:
            raise BadRequest(f"prompt token ids must be in [0, {self.w.tokenizer.vocab_size})")

    async def _generate(
        self, rid: str, ids: list[int], sp: dict[str, Any], opts: dict[str, Any], received_at: float
    ) -> AsyncIterator[worker_pb2.WorkerGenerateChunk]:
        """Run one request on the engine; yields the same chunks the gRPC Generate stream does."""
        w = self.w
        engine_request = EngineRequest(
            request_id=rid,
            prompt_token_ids=tuple(ids),
            max_tokens=sp["max_tokens"],
            arrival_s=w.engine_now(),
            ignore_eos=sp["ignore_eos"],
            seed=sp["seed"] if sp["seed"] is not None else w.request_seed(rid),
            priority=opts["priority"],
            lora_name=opts["lora_name"],
            cache_salt=opts["cache_salt"],
        )
        try:
            stream = w.add(engine_request, sp["stop"], received_at)
        except ValueError as e:
            raise BadRequest(str(e)) from e
        gather = ChunkGatherer(effective_stream_interval(opts["stream_interval"], w.stream_interval))
        try:
            while True:
                items = await stream.take()
                chunk = stream.consume(items)  # RuntimeError if the engine loop failed
                if chunk is not None:
                    chunk = gather.add(chunk, stream.is_finished)
                if chunk is not None:
                    yield chunk
                if stream.is_finished:
                    return
        finally:
            w.release(stream)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received_at = time.time()
        if not self._ready():
            return _error(503, "worker is not accepting requests (draining)", "ServiceUnavailableError")
        prefix = "chatcmpl" if chat else "cmpl"
        rid = request.headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
        if rid in self.w.streams:
            return _error(409, f"request {rid!r} is already running", "ConflictError")
        try:
            body = await self._json(request)
            if chat:
                ids, prompt_text = self._chat_ids(body), None
            else:
                ids, prompt_text = self._prompt_ids(body.get("prompt"))
            self._validate_prompt(ids)
            sp = self._sampling(body, len(ids), chat)
            opts = self._options(body)
        except BadRequest as e:
            return _error(400, str(e))
        echo = "" if chat or not body.get("echo") else (prompt_text or self.w.tokenizer.decode(ids))
        want_ids = bool(body.get("return_token_ids"))
        model = body.get("model") or self.w.model
        created = int(received_at)
        gen = self._generate(rid, ids, sp, opts, received_at)
        if body.get("stream"):
            return await self._stream(request, gen, rid, model, created, chat, echo, want_ids, opts["include_usage"])
        text_parts = [echo]
        token_ids: list[int] = []
        last = None
        try:
            async for chunk in gen:
                text_parts.append(chunk.text)
                token_ids.extend(chunk.token_ids)
                last = chunk
        except BadRequest as e:
            return _error(400, str(e))
        except RuntimeError as e:
            return _error(500, str(e), "InternalServerError")
        finally:
            await gen.aclose()  # releases the stream (aborts the request if it did not finish)
        assert last is not None
        finish = _FINISH.get(last.finish_reason, "stop")
        text = "".join(text_parts)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": finish, "stop_reason": None}  # fmt: skip
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        if want_ids:
            choice["token_ids"] = token_ids
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
               "model": model, "choices": [choice], "usage": _usage(last)}  # fmt: skip
        return web.json_response(out, dumps=_dumps, headers={"X-Request-Id": rid})

    async def _stream(
        self,
        request: web.Request,
        gen: AsyncIterator[worker_pb2.WorkerGenerateChunk],
        rid: str,
        model: str,
        created: int,
        chat: bool,
        echo: str,
        want_ids: bool,
        include_usage: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Request-Id": rid}
        )
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'{{"id":{_dumps(rid)},"object":"{obj}","created":{created},"model":{_dumps(model)},"choices":'

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            tail = f',"usage":{_dumps(usage)}}}' if usage is not None else "}"
            return f"data: {head}{_dumps(choices)}{tail}\n\n".encode()

        started = False
        first = True
        try:
            async for chunk in gen:
                if not started:
                    await resp.prepare(request)
                    started = True
                    if chat:  # vLLM's first chat chunk announces the role
                        delta0 = {"role": "assistant", "content": ""}
                        await resp.write(event([{"index": 0, "delta": delta0, "logprobs": None,
                                                 "finish_reason": None}]))  # fmt: skip
                text = chunk.text
                if first and echo:
                    text = echo + text
                first = False
                finish = _FINISH.get(chunk.finish_reason)  # UNSPECIFIED (0): not finished
                if chat:
                    choice: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None,
                                              "finish_reason": finish}  # fmt: skip
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
                if finish is not None:
                    choice["stop_reason"] = None
                if want_ids:
                    choice["token_ids"] = list(chunk.token_ids)
                await resp.write(event([choice]))
                if finish is not None and include_usage:
                    await resp.write(event([], _usage(chunk)))
        except BadRequest as e:
            if not started:
                return _error(400, str(e))
            await resp.write(f"data: {_dumps({'error': {'message': str(e), 'code': 400}})}\n\n".encode())
        except RuntimeError as e:
            if not started:
                return _error(500, str(e), "InternalServerError")
            await resp.write(f"data: {_dumps({'error': {'message': str(e), 'code': 500}})}\n\n".encode())
        finally:
            await gen.aclose()  # a client that went away (ConnectionResetError) aborts the request here
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        try:
            body = await self._json(request)
            ids = self._chat_ids(body) if chat else self._prompt_ids(body.get("prompt"))[0]
            self._validate_prompt(ids)
            sp = self._sampling(body, len(ids), chat)
        except BadRequest as e:
            return _error(400, str(e))
        rid = request.headers.get("X-Request-Id") or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        out = [{"request_id": rid, "token_ids": ids, "sampling_params": sp,
                "model": body.get("model") or self.w.model, "output_mode": "tokens"}]  # fmt: skip
        return web.json_response(out, dumps=_dumps)

    async def render_completions(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def render_chat(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)
