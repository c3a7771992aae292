"""Admission: every client error gets its status and a message before the request reaches the queue."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from switchyard.ext.blockhash import block_digests, to_event_hash
from switchyard.router.admission import (
    ApiError,
    GenerateParams,
    ModelSpec,
    Sampling,
    admit,
    check,
    input_size,
    tokenize,
)
from switchyard.workers.tokenizer import ChatMessage, load_tokenizer

TOK = load_tokenizer(None)
SPEC = ModelSpec(model="m", max_model_len=64, block_size=4, block_hash_algo="xxhash", block_hash_seed="", num_routable=2)


class Catalog:
    def __init__(self, *specs: ModelSpec) -> None:
        self._specs = {s.model: s for s in specs}

    def spec(self, model: str) -> ModelSpec | None:
        return self._specs.get(model)


CATALOG = Catalog(SPEC)


def run(catalog: Catalog = CATALOG, **kw) -> object:  # type: ignore[no-untyped-def]
    sampling = kw.pop("sampling", Sampling(max_tokens=8))
    params = GenerateParams(request_id="r1", model=kw.pop("model", "m"), sampling=sampling, **kw)
    return admit(params, catalog, lambda _m: TOK, max_tokens_cap=100, arrival_s=1.5)


@pytest.mark.parametrize(
    ("kw", "code", "message"),
    [
        ({"prompt": ""}, grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        ({"token_ids": ()}, grpc.StatusCode.INVALID_ARGUMENT, "tokens.ids is empty"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "no input"),
        ({"token_ids": (1, 40000)}, grpc.StatusCode.INVALID_ARGUMENT, r"token id 40000 is outside the vocabulary \[0, 32000\)"),
        # 65 tokens > max_model_len 64
        ({"token_ids": tuple(range(10, 75))}, grpc.StatusCode.INVALID_ARGUMENT, r"prompt has 65 tokens, more than model 'm'.s max length 64"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0, got 0"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=-3)}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=101)}, grpc.StatusCode.INVALID_ARGUMENT, "exceeds this router's limit of 100"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=5, temperature=-0.1)}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=5, temperature=float("nan"))}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=5, top_p=0.0)}, grpc.StatusCode.INVALID_ARGUMENT, r"top_p must be in \(0, 1\]"),
        ({"prompt": "hi", "sampling": Sampling(max_tokens=5, top_p=1.01)}, grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        ({"chat": ()}, grpc.StatusCode.INVALID_ARGUMENT, "chat: chat input has no messages"),
        ({"chat": (ChatMessage("assistant", "hi"),)}, grpc.StatusCode.INVALID_ARGUMENT, "last chat message must be from the user"),
        ({"prompt": "hi", "model": "other"}, grpc.StatusCode.NOT_FOUND, "model 'other' is not served"),
        ({"prompt": "hi", "model": ""}, grpc.StatusCode.INVALID_ARGUMENT, "model is required"),
        ({"prompt": "hi", "predicted_output_tokens_hint": -1}, grpc.StatusCode.INVALID_ARGUMENT, "hint must be >= 0"),
    ],
)
def test_rejections(kw: dict, code: grpc.StatusCode, message: str) -> None:
    with pytest.raises(ApiError, match=message) as e:
        run(**kw)
    assert e.value.code is code


def test_no_healthy_worker_is_unavailable() -> None:
    down = ModelSpec("m", 64, 4, "xxhash", "", num_routable=0)
    with pytest.raises(ApiError, match="no healthy worker for model 'm'") as e:
        run(Catalog(down), prompt="hi")
    assert e.value.code is grpc.StatusCode.UNAVAILABLE


def test_prompt_at_exactly_max_model_len_is_accepted() -> None:
    ids = tuple(range(10, 74))  # 64 tokens = max_model_len
    assert len(run(token_ids=ids).prompt_token_ids) == 64  # type: ignore[attr-defined]


def test_prompt_text_gets_bos_and_block_hashes_use_the_workers_recipe() -> None:
    a = run(prompt="The quick brown fox jumps over the lazy dog", lora_name="l", cache_salt="s")
    ids = list(a.prompt_token_ids)  # type: ignore[attr-defined]
    assert ids[0] == TOK.bos_id and ids == TOK.encode("The quick brown fox jumps over the lazy dog")
    expected = [to_event_hash(d) for d in block_digests(ids, 4, "xxhash", lora_name="l", cache_salt="s")]
    assert list(a.block_hashes) == expected  # type: ignore[attr-defined]
    assert len(expected) == len(ids) // 4  # full blocks only
    assert a.arrival_s == 1.5 and a.sampling.max_tokens == 8  # type: ignore[attr-defined]


def test_chat_uses_the_template_and_token_ids_pass_through() -> None:
    msgs = (ChatMessage("system", "be brief"), ChatMessage("user", "hello"))
    assert list(run(chat=msgs).prompt_token_ids) == TOK.apply_chat_template(msgs)  # type: ignore[attr-defined]
    assert run(token_ids=(5, 6, 7)).prompt_token_ids == (5, 6, 7)  # type: ignore[attr-defined]


def test_salt_changes_hashes() -> None:
    ids = tuple(range(100, 116))  # 16 tokens = 4 blocks
    plain = run(token_ids=ids).block_hashes  # type: ignore[attr-defined]
    salted = run(token_ids=ids, cache_salt="tenant-a").block_hashes  # type: ignore[attr-defined]
    assert len(plain) == len(salted) == 4
    assert set(plain).isdisjoint(salted)  # the salt is in block 0's key, and the chain carries it on


def test_the_output_length_hint_is_capped_at_max_tokens() -> None:
    """Policies price a request's decode by the hint; one past max_tokens cannot come true (the engine stops at
    max_tokens), and 0 means none."""
    assert run(prompt="hi", predicted_output_tokens_hint=50).predicted_output_tokens == 8  # type: ignore[attr-defined]
    assert run(prompt="hi", predicted_output_tokens_hint=5).predicted_output_tokens == 5  # type: ignore[attr-defined]
    assert run(prompt="hi").predicted_output_tokens is None  # type: ignore[attr-defined]


def test_input_tokenized_elsewhere_admits_as_tokenized_here() -> None:
    """The router tokenizes a long input in a thread and hands the ids to `admit`: the same request comes out, the
    tokenizer is not asked again, and the checks that need no tokenizer still come first."""
    text = "The quick brown fox jumps over the lazy dog"
    params = GenerateParams(request_id="r1", model="m", sampling=Sampling(max_tokens=8), prompt=text)
    here = admit(params, CATALOG, lambda _m: TOK, max_tokens_cap=100, arrival_s=1.5)

    def no_tokenizer(_model: str):  # type: ignore[no-untyped-def]
        raise AssertionError("tokenized twice")

    ids = tokenize(params, TOK)
    elsewhere = admit(params, CATALOG, no_tokenizer, 100, 1.5, token_ids=ids, tokenize_s=0.25)
    assert (elsewhere.prompt_token_ids, elsewhere.block_hashes) == (here.prompt_token_ids, here.block_hashes)
    assert elsewhere.tokenize_s >= 0.25
    with pytest.raises(ApiError, match="not served"):
        check(dataclasses.replace(params, model="other"), CATALOG, 100)
    assert (input_size(params), input_size(dataclasses.replace(params, prompt=None, token_ids=(1, 2, 3)))) == (len(text), 3)
    chat = dataclasses.replace(params, prompt=None, chat=(ChatMessage("system", "ab"), ChatMessage("user", "cde")))
    assert input_size(chat) == 5
