"""The router's length-prediction service: off-loop micro-batched inference with a deadline and a fallback.

Admission calls `start` right after tokenization (it only enqueues), so inference overlaps hashing and the queue
wait. One worker thread drains the inbox into batches (up to `max_batch`, waiting at most `max_wait_ms` for more;
0 = whatever queued while the previous batch ran) and hands each batch's answers back to the loop in one
`call_soon_threadsafe`. Dispatch then asks `result` (waits until the deadline at most) or `result_nowait` (the
queue's late binding, which cannot wait). Past the deadline, on a predictor error, without a model or without
text, the `LengthFallback` answers. A prompt seen finishing before is answered at once from the `PromptMemo`
(exact repeats; a client hint still comes first). Each prediction settles once; its source is "model", "hint",
"memo" or "fallback".

    loop thread:  start() --put--> inbox --> [worker thread: batch, predict] --call_soon_threadsafe--> future
                  result()/result_nowait() <-- future done? model : (hint | fallback)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from switchyard.router.predictor.fallback import LengthFallback
from switchyard.router.predictor.memo import PromptKey, PromptMemo
from switchyard.router.predictor.paths import DEFAULT_PREDICTOR, predictor_path

if TYPE_CHECKING:
    import numpy as np

    from switchyard.router.config import PredictorConfig
    from switchyard.router.metrics import RouterMetrics

log = logging.getLogger(__name__)

MODEL, HINT, MEMO, FALLBACK = "model", "hint", "memo", "fallback"


class LengthPredictor(Protocol):
    """What the service runs on its thread (OnnxLengthPredictor, or a test double)."""

    name: str
    providers: list[str]

    def predict(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass(eq=False, slots=True)
class Prediction:
    """One request's prediction, from `start` until it settles (then `tokens` and `source` never change)."""

    model: str
    text: str | None  # what the predictor reads; None = nothing to read (token-id input)
    prompt_tokens: int
    hint: int  # the client's predicted_output_tokens_hint; 0 = none
    max_tokens: int  # cap: a request never decodes more; 0 = no cap
    started_at: float  # time.monotonic()
    deadline_at: float  # time.monotonic(): past it nobody waits for the model
    future: asyncio.Future[int | None] | None = (
        None  # the model's answer (None = it failed); None = not asked
    )
    tokens: int = 0
    source: str = ""  # "" until settled
    key: PromptKey | None = None  # the prompt's memo key (None: no memo, or no token ids)

    @property
    def is_settled(self) -> bool:
        return bool(self.source)


_STOP = None  # inbox sentinel


class PredictorService:
    """Starts, batches and settles predictions; learns the fallback from finished requests (`observe`).

    Without `attach`, it is fallback-only and has no thread. Everything but the worker thread's batch loop runs on
    the event loop thread (the fallback is not thread-safe and needs no lock).
    """

    def __init__(
        self,
        metrics: RouterMetrics | None = None,
        fallback: LengthFallback | None = None,
        timeout_ms: float = 50.0,
        max_batch: int = 0,
        max_wait_ms: float = 0.0,
        prefer_client_hint: bool = True,
        memo: PromptMemo | None = None,
    ) -> None:
        self.fallback = fallback or LengthFallback()
        self.memo = memo
        self._metrics = metrics
        # Labelled children resolved once: `.labels()` is a locked dict lookup, paid per request otherwise.
        sources = (MODEL, HINT, MEMO, FALLBACK)
        self._settled = (
            {s: (metrics.predictions.labels(s), metrics.predicted_tokens.labels(s)) for s in sources}
            if metrics is not None
            else {}
        )
        self._timeout_s = timeout_ms / 1000
        self._max_batch = max_batch
        self._max_wait_s = max_wait_ms / 1000
        self._prefer_hint = prefer_client_hint
        self.predictor: LengthPredictor | None = None
        self._inbox: queue.SimpleQueue[Prediction | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._logged_error = False

    # ------------------------------------------------------------------ lifecycle
    def attach(self, predictor: LengthPredictor, warm_up: bool = True) -> None:
        """Serve `predictor` from a new worker thread (one warm-up call first, so request 1 pays no set-up)."""
        if self.predictor is not None:
            raise RuntimeError("a predictor is already attached")
        if warm_up:
            predictor.predict(["warm up"])
        if self._max_batch <= 0:
            self._max_batch = auto_max_batch(predictor.providers)
        self.predictor = predictor
        self._thread = threading.Thread(target=self._run, name="length-predictor", daemon=True)
        self._thread.start()

    def describe(self) -> str:
        """For the startup log and the READY line: the model's name and providers, or "fallback"."""
        if self.predictor is None:
            return FALLBACK
        return f"{self.predictor.name} ({','.join(self.predictor.providers)})"

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the worker thread after the batches already queued; later starts get the fallback."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._inbox.put(_STOP)
            thread.join(timeout_s)
            if thread.is_alive():
                log.warning("length predictor thread did not stop within %.1fs", timeout_s)

    # ------------------------------------------------------------------ loop side
    def start(
        self,
        model: str,
        text: str | None,
        prompt_tokens: int,
        hint: int = 0,
        max_tokens: int = 0,
        token_ids: Sequence[int] | None = None,
        adapter: str = "",
    ) -> Prediction:
        """Begin predicting one request (non-blocking: at most one enqueue). Call on the event loop thread.
        `token_ids` (and the LoRA `adapter`) key the memo of exact repeats."""
        now = time.monotonic()
        p = Prediction(model, text, prompt_tokens, max(0, hint), max_tokens, now, now + self._timeout_s)
        if self.memo is not None and token_ids is not None:
            p.key = PromptMemo.key(model, token_ids, adapter)
        if p.hint and self._prefer_hint:
            self._settle(p, p.hint, HINT)
        elif p.key is not None and (seen := self.memo.lookup(p.key)) is not None:  # type: ignore[union-attr]
            self._settle(p, seen, MEMO)
        elif text is not None and self._thread is not None:
            if self._loop is None:
                self._loop = asyncio.get_running_loop()
            p.future = self._loop.create_future()
            self._inbox.put(p)
        return p

    async def result(self, p: Prediction, timeout_s: float | None = None) -> tuple[int, str]:
        """(tokens, source), waiting for the model until its deadline (or `timeout_s`, if sooner) at most."""
        if not p.source and p.future is not None and not p.future.done():
            wait_s = p.deadline_at - time.monotonic()
            if timeout_s is not None:
                wait_s = min(wait_s, timeout_s)
            if wait_s > 0:
                await asyncio.wait((p.future,), timeout=wait_s)
        return self.result_nowait(p)

    def result_nowait(self, p: Prediction) -> tuple[int, str]:
        """(tokens, source) now: the model's answer if it is in, else the hint or the fallback."""
        if p.source:
            return p.tokens, p.source
        fut = p.future
        value = fut.result() if fut is not None and fut.done() else None
        if value is not None:
            return self._settle(p, value, MODEL)
        if fut is not None and self._metrics is not None:
            # the model was asked but has no answer: it failed, missed its deadline, or the queue released first
            reason = (
                "error" if fut.done() else "timeout" if time.monotonic() >= p.deadline_at else "early_bind"
            )
            self._metrics.predictor_misses.labels(reason).inc()
        if p.hint:
            return self._settle(p, p.hint, HINT)
        return self._settle(p, self.fallback.predict(p.model, p.prompt_tokens), FALLBACK)

    def observe(
        self,
        model: str,
        prompt_tokens: int,
        output_tokens: int,
        prediction: Prediction | None = None,
        capped: bool = False,
    ) -> None:
        """A request finished with `output_tokens` (`capped`: cut at max_tokens): teach the fallback, the memo
        (natural finishes only) and record the settled prediction's error."""
        self.fallback.observe(model, prompt_tokens, output_tokens)
        if self.memo is not None and prediction is not None and prediction.key is not None and not capped:
            self.memo.observe(prediction.key, output_tokens)
        if prediction is not None and prediction.source and self._metrics is not None:
            self._metrics.predictor_abs_error.labels(prediction.source).observe(
                abs(prediction.tokens - output_tokens)
            )

    def _settle(self, p: Prediction, tokens: int, source: str) -> tuple[int, str]:
        p.tokens = max(1, min(tokens, p.max_tokens) if p.max_tokens else tokens)
        p.source = source
        if self._settled:
            count, tokens_hist = self._settled[source]
            count.inc()
            tokens_hist.observe(p.tokens)
        return p.tokens, p.source

    def _deliver(self, batch: list[Prediction], values: list[int] | None) -> None:
        """On the loop: resolve the batch's futures (None = the predictor failed)."""
        for i, p in enumerate(batch):
            if p.future is not None and not p.future.done():
                p.future.set_result(None if values is None else int(values[i]))

    # ------------------------------------------------------------------ worker thread
    def _run(self) -> None:
        while True:
            first = self._inbox.get()
            if first is _STOP:
                return
            batch, stop = self._collect(first)
            batch = [
                p for p in batch if not p.source
            ]  # settled meanwhile (fallback): nobody wants the answer
            if batch:
                self._predict(batch)
            if stop:
                return

    def _collect(self, first: Prediction) -> tuple[list[Prediction], bool]:
        batch = [first]
        until = time.monotonic() + self._max_wait_s
        while len(batch) < self._max_batch:
            try:
                if self._max_wait_s > 0:
                    wait_s = until - time.monotonic()
                    if wait_s <= 0:
                        break
                    nxt = self._inbox.get(timeout=wait_s)
                else:
                    nxt = self._inbox.get_nowait()
            except queue.Empty:
                break
            if nxt is _STOP:
                return batch, True
            batch.append(nxt)
        return batch, False

    def _predict(self, batch: list[Prediction]) -> None:
        assert self.predictor is not None
        t0 = time.monotonic()
        values: list[int] | None
        try:
            values = [int(v) for v in self.predictor.predict([p.text or "" for p in batch])]
            if len(values) != len(batch):
                raise ValueError(f"predictor returned {len(values)} values for {len(batch)} texts")
        except Exception:
            values = None
            if not self._logged_error:  # once: a broken model would otherwise log every batch
                self._logged_error = True
                log.exception("length predictor failed on a batch of %d; the fallback answers", len(batch))
        done = time.monotonic()
        if self._metrics is not None:
            self._metrics.predictor_batch_size.observe(len(batch))
            self._metrics.predictor_inference_time.observe(done - t0)
            if values is not None:
                for p in batch:
                    self._metrics.predictor_latency.observe(done - p.started_at)
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed under us (shutdown): nobody waits any more
            self._loop.call_soon_threadsafe(self._deliver, batch, values)


# ---------------------------------------------------------------------- construction from config
def resolve_model_dir(model: str) -> Path | None:
    """The predictor directory `model` names: None for "none", and for "auto" when the default is not trained."""
    if model == "none":
        return None
    if model == "auto":
        path = predictor_path(DEFAULT_PREDICTOR)
        return path if (path / "model.onnx").is_file() else None
    return predictor_path(model)


def auto_max_batch(providers: list[str]) -> int:
    """max_batch 0 = auto. On CPU a padded batch costs more per request than batch 1 (`bench predictor`, student
    int8, 1 thread: 2.75 ms at batch 1, 7.1 ms per request at batch 8), so requests go one by one; a GPU batches."""
    return 16 if any(p != "CPUExecutionProvider" for p in providers) else 1


def make_service(config: PredictorConfig, metrics: RouterMetrics | None = None) -> PredictorService:
    """A fallback-only service with the [predictor] section's knobs; `attach(load_predictor(config))` adds the model."""
    return PredictorService(
        metrics,
        timeout_ms=config.timeout_ms,
        max_batch=config.max_batch,
        max_wait_ms=config.max_wait_ms,
        prefer_client_hint=config.prefer_client_hint,
        memo=PromptMemo(config.memo_entries, config.memo_window) if config.memo_entries else None,
    )


def load_predictor(config: PredictorConfig) -> LengthPredictor | None:
    """The model the [predictor] section names, or None (fallback only). Raises PredictorLoadError when an
    explicitly named model cannot load; "auto" degrades to the fallback with a warning instead."""
    path = resolve_model_dir(config.model)
    if path is None:
        return None
    from switchyard.router.predictor.onnx_predictor import OnnxLengthPredictor, PredictorLoadError

    try:
        return OnnxLengthPredictor(path, threads=config.threads, providers=config.providers or None)
    except (PredictorLoadError, ImportError) as e:
        if config.model != "auto":
            raise PredictorLoadError(f"predictor {config.model!r}: {e}") from None
        log.warning("default predictor at %s did not load (%s); using the fallback", path, e)
        return None
