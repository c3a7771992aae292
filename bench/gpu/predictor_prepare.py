"""Inputs for `predictor_finetune.py` (run here, on the CPU box; the GPU machine has neither the ShareGPT package nor
the pretrained encoder's): the saved 7:3 split, the train side augmented as `switchyard predictor train` does it,
WordPiece ids at 512 - M tokens packed as uint16, and the converted MiniLM-as-DistilBERT weights in fp16 (the bundle
stays under the 64 MiB a device call carries).

    .venv/bin/python bench/gpu/predictor_prepare.py [--out .gpu]     # ~30 s; then carry .gpu to the GPU machine
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from switchyard.router.predictor.train import TrainConfig, prepare_data

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPT_TOKENS = 20  # M, TrainConfig's default


def pack(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged id lists as one uint16 array and int64 offsets (WordPiece ids are < 30,522)."""
    lens = np.array([len(r) for r in rows], dtype=np.int64)
    off = np.zeros(len(rows) + 1, dtype=np.int64)
    off[1:] = np.cumsum(lens)
    flat = np.concatenate([np.asarray(r, dtype=np.int64) for r in rows])
    assert flat.max() < 65536
    return flat.astype(np.uint16), off


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / ".gpu")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfg = TrainConfig(max_input_tokens=512 - NUM_PROMPT_TOKENS)
    d = prepare_data(cfg)
    tr_flat, tr_off = pack(d["train_ids"])
    te_flat, te_off = pack(d["test_ids"])
    np.savez_compressed(
        args.out / "data.npz", train_ids=tr_flat, train_off=tr_off, test_ids=te_flat, test_off=te_off,
        y_train=d["y_train"], y_test=d["y_test"],
        y_train_orig=np.array([s.output_tokens for s in d["train"]], dtype=np.float32),
    )
    meta = {"train": len(d["train"]), "train_aug": len(d["train_aug"]), "test": len(d["test"]),
            "max_input_tokens": cfg.max_input_tokens,
            "median_train": float(np.median(d["y_train"][: len(d["train"])]))}
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1))

    import torch
    from safetensors.torch import save_file

    from switchyard.router.predictor.convert import pretrained_distilbert

    sd = {k: v.detach().to(torch.float16).contiguous() for k, v in pretrained_distilbert().state_dict().items()}
    save_file(sd, str(args.out / "minilm_distilbert_fp16.safetensors"))
    print(meta, f"{time.time() - t0:.1f} s ->", args.out)


if __name__ == "__main__":
    main()
