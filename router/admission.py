"""Admission: validate a request, tokenize it with its model's tokenizer, and hash its prompt blocks.

Runs before the queue, so every error a client can fix (or that no waiting will fix) is reported at once with an
explicit status. Plain data in (`GenerateParams`, a `ModelCatalog`), plain data out (`AdmittedRequest`), so it is
tested without sockets. Once the prompt is known to fit, it starts the output-length prediction (an enqueue), so
inference overlaps hashing and the queue wait.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import grpc

from switchyard.ext.blockhash import block_digests, event_hashes
from switchyard.router.policies.base import RoutingContext, WorkerId
from switchyard.workers.tokenizer import ChatMessage, Tokenizer

if TYPE_CHECKING:
    from switchyard.router.predictor.service import Prediction, PredictorService

log = logging.getLogger(__name__)


class ApiError(Exception):
    """Ends a request with an explicit gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.trailing = trailing  # trailing metadata, e.g. (("retry-after-ms", "500"),)


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float | None = None
    top_p: float | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False
    extra: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """A GenerateRequest as plain data (api.py converts). Exactly one of chat / prompt / token_ids is set."""

    request_id: str
    model: str
    sampling: Sampling
    chat: tuple[ChatMessage, ...] | None = None
    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    lora_name: str = ""
    cache_salt: str = ""
    priority: int = 0
    session_id: str = ""
    app_id: str = ""
    predicted_output_tokens_hint: int = 0


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What admission needs to know about a served model, derived from its workers' Info."""

    model: str
    max_model_len: int  # min over the model's workers
    block_size: int  # the workers' hashing recipe (all of a model's workers agree; the registry enforces it)
    block_hash_algo: str
    block_hash_seed: str
    num_routable: int  # healthy, ready, not draining


class ModelCatalog(Protocol):
    def spec(self, model: str) -> ModelSpec | None: ...


@dataclass(frozen=True, slots=True)
class AdmittedRequest:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    block_hashes: tuple[int, ...]
    sampling: Sampling
    arrival_s: float  # router clock
    priority: int = 0
    lora_name: str = ""
    cache_salt: str = ""
    session_id: str = ""
    app_id: str = ""
    predicted_output_tokens: int | None = None  # the client's hint; None = unknown
    tokenize_s: float = 0.0  # tokenization + hashing time
    prediction: Prediction | None = None  # the length prediction started at admission; None = no predictor
    tenant: str = ""  # the caller's API key's name ("" without keys): the other router replicas charge it too

    def routing_context(
        self,
        attempt: int = 0,
        excluded: frozenset[WorkerId] = frozenset(),
        predicted_output_tokens: int | None = None,
    ) -> RoutingContext:
        """`predicted_output_tokens`: the settled prediction; None = the client's hint (or unknown)."""
        if predicted_output_tokens is None:
            predicted_output_tokens = self.predicted_output_tokens
        return RoutingContext(
            request_id=self.request_id,
            model=self.model,
            prompt_token_ids=self.prompt_token_ids,
            block_hashes=self.block_hashes,
            max_tokens=self.sampling.max_tokens,
            arrival_s=self.arrival_s,
            priority=self.priority,
            predicted_output_tokens=predicted_output_tokens,
            lora_name=self.lora_name or None,
            cache_salt=self.cache_salt or None,
            session_id=self.session_id or None,
            app_id=self.app_id or None,
            attempt=attempt,
            excluded_workers=excluded,
        )


def _invalid(message: str) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message)


def validate_sampling(s: Sampling, max_tokens_cap: int) -> None:
    if s.max_tokens <= 0:
        raise _invalid(f"sampling.max_tokens must be > 0, got {s.max_tokens}")
    if s.max_tokens > max_tokens_cap:
        raise _invalid(f"sampling.max_tokens={s.max_tokens} exceeds this router's limit of {max_tokens_cap}")
    if s.temperature is not None and not (s.temperature >= 0 and math.isfinite(s.temperature)):
        raise _invalid(f"sampling.temperature must be >= 0, got {s.temperature}")
    if s.top_p is not None and not (0 < s.top_p <= 1):
        raise _invalid(f"sampling.top_p must be in (0, 1], got {s.top_p}")


def tokenize(params: GenerateParams, tokenizer: Tokenizer) -> list[int]:
    if params.chat is not None:
        try:
            return tokenizer.apply_chat_template(params.chat)
        except ValueError as e:
            raise _invalid(f"chat: {e}") from None
    if params.prompt is not None:
        if not params.prompt:
            raise _invalid("prompt is empty")
        return tokenizer.encode(params.prompt)
    if params.token_ids is not None:
        if not params.token_ids:
            raise _invalid("tokens.ids is empty")
        bad = next((t for t in params.token_ids if not 0 <= t < tokenizer.vocab_size), None)
        if bad is not None:
            raise _invalid(f"token id {bad} is outside the vocabulary [0, {tokenizer.vocab_size})")
        return list(params.token_ids)
    raise _invalid("request has no input: set one of chat, prompt or tokens")


def prediction_text(params: GenerateParams) -> str | None:
    """What the length predictor reads: a completion's prompt; for chat, the last user message's content alone
    (PreServe trained on the user turn, without a template, system prompt or earlier turns; contract A's samples
    are the same); None for token ids (no text: the fallback answers)."""
    if params.chat is not None:
        return next((m.content for m in reversed(params.chat) if m.role == "user"), None)
    return params.prompt


def block_hashes(token_ids: Sequence[int], spec: ModelSpec, lora_name: str, cache_salt: str) -> tuple[int, ...]:
    """The uint64 event ids of the prompt's full blocks, with the model's workers' recipe."""
    digests = block_digests(
        token_ids,
        spec.block_size,
        spec.block_hash_algo,
        lora_name=lora_name or None,
        cache_salt=cache_salt or None,
        seed=spec.block_hash_seed,
    )
    return tuple(event_hashes(digests))


# Inputs larger than this (characters of text, or token ids) are tokenized off the event loop
# (`api.RouterService`): SentencePiece releases the GIL and takes ~2 ms per 4k characters, so a 100k-token prompt
# held every other stream for ~0.3 s; a thread hand-off costs ~0.1 ms.
LONG_INPUT = 8192


def input_size(params: GenerateParams) -> int:
    """What tokenization reads: characters of text (a prompt, or the chat's contents), or token ids to check."""
    if params.chat is not None:
        return sum(len(m.content) for m in params.chat)
    if params.token_ids is not None:
        return len(params.token_ids)
    return len(params.prompt or "")


def check(params: GenerateParams, catalog: ModelCatalog, max_tokens_cap: int) -> ModelSpec:
    """The checks that need no tokenizer, in the order a client meets their errors; the model's spec."""
    if not params.model:
        raise _invalid("model is required")
    validate_sampling(params.sampling, max_tokens_cap)
    if params.predicted_output_tokens_hint < 0:
        raise _invalid(f"predicted_output_tokens_hint must be >= 0 (0 = none), got {params.predicted_output_tokens_hint}")
    spec = catalog.spec(params.model)
    if spec is None:
        raise ApiError(grpc.StatusCode.NOT_FOUND, f"model {params.model!r} is not served by any registered worker")
    if spec.num_routable == 0:
        raise ApiError(grpc.StatusCode.UNAVAILABLE, f"no healthy worker for model {params.model!r}")
    return spec


def admit(
    params: GenerateParams,
    catalog: ModelCatalog,
    tokenizer_for: Callable[[str], Tokenizer],
    max_tokens_cap: int,
    arrival_s: float,
    predictor: PredictorService | None = None,
    token_ids: Sequence[int] | None = None,
    tokenize_s: float = 0.0,
    tenant: str = "",
) -> AdmittedRequest:
    """Validate, tokenize, start the length prediction and hash; raises ApiError with the status the client
    should see (always before a prediction is started). `token_ids`: the input already tokenized elsewhere
    (`tokenize`, off the event loop for a long input), in `tokenize_s` seconds."""
    spec = check(params, catalog, max_tokens_cap)
    t0 = time.perf_counter()
    if token_ids is None:
        token_ids = tokenize(params, tokenizer_for(params.model))
    if not token_ids:
        raise _invalid("prompt is empty after tokenization")
    if len(token_ids) > spec.max_model_len:
        raise _invalid(
            f"prompt has {len(token_ids)} tokens, more than model {params.model!r}'s max length {spec.max_model_len}"
        )
    token_ids = tuple(token_ids)
    prediction = None
    if predictor is not None:
        prediction = predictor.start(
            params.model, prediction_text(params), len(token_ids), params.predicted_output_tokens_hint,
            params.sampling.max_tokens, token_ids=token_ids, adapter=params.lora_name,
        )
    hashes = block_hashes(token_ids, spec, params.lora_name, params.cache_salt)
    tokenize_s += time.perf_counter() - t0
    return AdmittedRequest(
        request_id=params.request_id,
        model=params.model,
        prompt_token_ids=token_ids,
        block_hashes=hashes,
        sampling=params.sampling,
        arrival_s=arrival_s,
        priority=params.priority,
        lora_name=params.lora_name,
        cache_salt=params.cache_salt,
        session_id=params.session_id,
        app_id=params.app_id,
        # a hint past max_tokens cannot come true: the engine stops there (the predictor clamps its answers alike)
        predicted_output_tokens=min(params.predicted_output_tokens_hint, params.sampling.max_tokens) or None,
        tokenize_s=tokenize_s,
        prediction=prediction,
        tenant=tenant,
    )
