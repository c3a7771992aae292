"""Build a tiny random Llama that vLLM's CPU backend serves, for CI and demos (no Hugging Face hub).

Runs in vLLM's environment (it needs torch and transformers):

    .venv-vllm/bin/python -m switchyard.workers.tiny_model --out build/tiny-llama

The tokenizer is the SentencePiece model the router already ships (`workers/data/mistral-7b-v1.model`, 32k
vocab), copied in as `tokenizer.model` with a Llama tokenizer config. The router loads that same file
(`switchyard serve --tokenizer build/tiny-llama/tokenizer.model`), so both sides report the same tokenizer_id
and produce the same token ids. The shapes satisfy vLLM's CPU attention: head_dim 32 (it rejects 16) and
the worker's block size is a multiple of 32. Weights are float32 (bf16 + AMX crashed on a first tiny prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from switchyard.workers.tokenizer import DEFAULT_TOKENIZER, Tokenizer

HIDDEN = 128
HEADS = 4  # head_dim 32
LAYERS = 2
INTERMEDIATE = 256
MAX_POSITIONS = 4096
SEED = 0
STAMP = "switchyard-tiny-llama-v2"  # bump when the recipe changes (v2: files readable by others)


def is_built(out: Path) -> bool:
    try:
        return json.loads((out / "switchyard.json").read_text()).get("recipe") == STAMP
    except (OSError, ValueError):
        return False


def build(out: Path, tokenizer_path: Path = DEFAULT_TOKENIZER) -> Path:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(tokenizer_path)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_path, out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizer",
                "bos_token": tok.id_to_piece(tok.bos_id),
                "eos_token": tok.id_to_piece(tok.eos_id),
                "unk_token": tok.id_to_piece(0),
                "add_bos_token": True,
                "add_eos_token": False,
                "legacy": True,
                "model_max_length": MAX_POSITIONS,
            },
            indent=2,
        )
    )
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=tok.vocab_size,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id).save_pretrained(out)
    (out / "switchyard.json").write_text(
        json.dumps({"recipe": STAMP, "tokenizer_id": tok.tokenizer_id}) + "\n"
    )
    # save_pretrained writes model.safetensors 0600 (a temporary file renamed): as readable as the umask allows,
    # so a service user (switchyard-worker-vllm@'s) loads a model that root built
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        f.chmod(0o666 & ~umask)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m switchyard.workers.tiny_model", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="build/tiny-llama")
    p.add_argument("--force", action="store_true", help="rebuild even if the directory holds this recipe")
    args = p.parse_args(argv)
    out = Path(args.out)
    if is_built(out) and not args.force:
        print(f"{out} is up to date")
        return 0
    build(out)
    print(f"built {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
