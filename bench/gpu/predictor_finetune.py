"""The ShareGPT length predictor's teacher (`LengthRegressor`) trained on a GPU under recipes the 2-core CPU box
cannot afford, scored on the whole 30% test split with `evaluate.length_metrics` (issue #4's accuracy gap).

Variant A replicates `switchyard predictor train`'s CPU recipe as the same-run baseline; the others lengthen the
input to the spec's 512 - M tokens, train longer, and train every block instead of the last one only. The machine
needs torch, safetensors and numpy, not Switchyard: the repo's router/predictor/{model,convert,train,evaluate}.py
are imported through a namespace shim. Inputs come from `predictor_prepare.py`, run on the CPU box first:

    .venv/bin/python bench/gpu/predictor_prepare.py               # writes .gpu/ (git-ignored, ~47 MB)
    python3 bench/gpu/predictor_finetune.py --out DIR [--variants A,C,B,D,C10] [--budget-s 380]
                                                                   # on the GPU machine, .gpu carried beside the repo

Each variant's row is written to DIR/results.{json,md} as it finishes; `--budget-s` skips the variants that would not
end in time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / ".gpu"  # predictor_prepare.py's output


def shim() -> None:
    """/tmp/ns/switchyard -> the repo's package layout (pyproject's package-dir), first on sys.path."""
    ns = Path(os.environ.get("SHIM_DIR", "/tmp/ns_switchyard")) / "switchyard"
    if ns.parent.exists():
        shutil.rmtree(ns.parent)
    ns.mkdir(parents=True)
    shutil.copy(REPO / "switchyard" / "__init__.py", ns / "__init__.py")
    (ns / "router").symlink_to(REPO / "router", target_is_directory=True)
    sys.path.insert(0, str(ns.parent))


shim()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from switchyard.router.predictor import model as model_mod  # noqa: E402
from switchyard.router.predictor.evaluate import length_metrics  # noqa: E402
from switchyard.router.predictor.model import LengthRegressor, RegressorConfig  # noqa: E402
from switchyard.router.predictor.train import TrainConfig, length_batches, warmup_decay  # noqa: E402
from switchyard.router.predictor.train import collate as train_collate  # noqa: E402
from switchyard.router.predictor.train import predict as train_predict  # noqa: E402

assert model_mod.__file__.startswith(str(REPO)) or "ns_switchyard" in model_mod.__file__, model_mod.__file__

# name -> recipe. trainable: "last" = TrainConfig's teacher (model.freeze(): last block + prompts + head);
# "all" = every block + embeddings' positions/LayerNorm + prompts + head (word table frozen, as train.py's student).
DEFAULTS = TrainConfig()
VARIANTS = {
    "A": dict(max_input=128, epochs=2, trainable="last", target="linear", batch=32, lr=DEFAULTS.lr,
              desc="CPU recipe (TrainConfig defaults): 128 tok, 2 ep, last block, linear, L1, bs 32"),
    "C": dict(max_input=492, epochs=5, trainable="all", target="linear", batch=32, lr=DEFAULTS.lr,
              desc="full fine-tune, 492 tok, 5 ep, linear, bs 32"),
    "B": dict(max_input=492, epochs=5, trainable="last", target="linear", batch=32, lr=DEFAULTS.lr,
              desc="spec recipe: 492 tok, 5 ep, last block, linear, bs 32"),
    "D": dict(max_input=492, epochs=5, trainable="all", target="log", batch=32, lr=DEFAULTS.lr,
              desc="C with log target"),
    "C10": dict(max_input=492, epochs=10, trainable="all", target="linear", batch=32, lr=DEFAULTS.lr,
                desc="C with 10 epochs"),
    "C_lr3e-5": dict(max_input=492, epochs=5, trainable="all", target="linear", batch=32, lr=3e-5,
                     desc="C with lr 3e-5 (blocks/head)"),
    "C_bs128": dict(max_input=492, epochs=5, trainable="all", target="linear", batch=128, lr=DEFAULTS.lr,
                    desc="C with batch 128"),
    "C_emb": dict(max_input=492, epochs=5, trainable="all+word", target="linear", batch=32, lr=DEFAULTS.lr,
                  desc="C with the word-embedding table trainable too"),
}


def unpack(flat: np.ndarray, off: np.ndarray) -> list[np.ndarray]:
    flat = flat.astype(np.int64)
    return [flat[off[i]: off[i + 1]] for i in range(len(off) - 1)]


def truncate(rows: list[np.ndarray], max_input: int) -> list[np.ndarray]:
    """WordPiece head truncation as the tokenizer does it: [CLS] first max_input-2 tokens [SEP] (checked on the CPU
    box: identical to tokenize(texts, 128) for every train and test row)."""
    return [r if len(r) <= max_input else np.concatenate([r[: max_input - 1], r[-1:]]) for r in rows]


def collate(rows, device):
    ids, mask = train_collate(rows)  # train.py's padding
    return ids.to(device, non_blocking=True), mask.to(device, non_blocking=True)


def build_model(target: str, init_tokens: float, enc_state: dict) -> LengthRegressor:
    """LengthRegressor(pretrained=False) + the carried encoder weights, prompts drawn from them as pretrained=True
    draws them."""
    cfg = RegressorConfig(layers=DEFAULTS.teacher_layers, num_prompt_tokens=DEFAULTS.num_prompt_tokens,
                          target=target, target_scale=DEFAULTS.target_scale, init_tokens=init_tokens)
    m = LengthRegressor(cfg, pretrained=False)
    missing, unexpected = m.encoder.load_state_dict(enc_state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"state mismatch: missing={missing} unexpected={unexpected}")
    m.init_prompts()  # the rows pretrained=True draws, now from the loaded table
    return m


def set_trainable(m: LengthRegressor, how: str) -> None:
    if how == "last":
        m.freeze()
    elif how == "all":
        m.unfreeze()
        m.encoder.embeddings.word_embeddings.weight.requires_grad_(False)
    elif how == "all+word":
        m.unfreeze()
    else:
        raise ValueError(how)


def predict(m, ids, device):
    """train.py's predict (fp32, length-sorted batches of 128) on `device`: clamped tokens."""
    return train_predict(m, ids, batch_size=128, device=device)[1]


def train_variant(name, v, data, enc_state, device, args, deadline):
    torch.manual_seed(DEFAULTS.seed)
    random.seed(DEFAULTS.seed)
    train_ids = truncate(data["train_ids"], v["max_input"])
    test_ids = truncate(data["test_ids"], v["max_input"])
    orig_ids = train_ids[: data["n_orig"]]
    m = build_model(v["target"], data["median"], enc_state).to(device)
    set_trainable(m, v["trainable"])
    y = m.normalise(torch.from_numpy(data["y_train"])).to(device)
    opt = torch.optim.AdamW(m.param_groups(v["lr"], DEFAULTS.prompt_lr))
    bs = v["batch"]
    epochs = v["epochs"]
    steps_per_epoch = math.ceil(len(train_ids) / bs)
    total = max(1, epochs * steps_per_epoch)
    if args.max_steps:
        total = min(total, args.max_steps)
    sched = warmup_decay(opt, total)
    trainable = [p for p in m.parameters() if p.requires_grad]
    lengths = [len(r) for r in train_ids]
    rng = random.Random(DEFAULTS.seed)
    use_bf16 = device.type == "cuda" or args.cpu_bf16
    res = {"variant": name, "desc": v["desc"], **{k: v[k] for k in ("max_input", "epochs", "trainable", "target",
                                                                     "batch", "lr")},
           "prompt_lr": DEFAULTS.prompt_lr, "train_samples": len(train_ids), "test_samples": len(test_ids),
           "mean_input_tokens": round(float(np.mean(lengths)), 1),
           "trainable_params": m.num_parameters(True), "epoch_loss": [], "epoch_test": []}
    step = 0
    train_s = 0.0
    tokens_seen = 0
    samples_seen = 0
    stopped = None
    for epoch in range(epochs):
        m.train()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        ep_loss = torch.zeros((), device=device)
        n = 0
        for batch in length_batches(lengths, bs, rng):
            a, b = collate([train_ids[i] for i in batch], device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=use_bf16):
                raw = m.forward_raw(a, b)
            loss = F.l1_loss(raw.float(), y[torch.as_tensor(batch, device=device)])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            opt.step()
            sched.step()
            ep_loss += loss.detach()
            tokens_seen += len(batch) * (a.shape[1])  # padded width, incl. padding
            samples_seen += len(batch)
            n += 1
            step += 1
            if args.max_steps and step >= args.max_steps:
                break
        if device.type == "cuda":
            torch.cuda.synchronize()
        train_s += time.perf_counter() - t0
        res["epoch_loss"].append(round(float(ep_loss) / max(1, n), 5))
        te = length_metrics(predict(m, test_ids, device), data["y_test"])
        res["epoch_test"].append({k: round(x, 3) for k, x in te.items()})
        print(f"  [{name}] epoch {epoch + 1}/{epochs}: loss {res['epoch_loss'][-1]:.5f}, test MAE {te['mae']:.2f} "
              f"Acc-50 {te['acc50']:.2f}% ({train_s:.1f} s train, {time.time() - T_START:.0f} s since start)",
              flush=True)
        if args.max_steps and step >= args.max_steps:
            break
        if time.time() > deadline and epoch + 1 < epochs:
            stopped = f"stopped after epoch {epoch + 1}/{epochs}: wall-time guard"
            print("  " + stopped, flush=True)
            break
    done_epochs = len(res["epoch_loss"])
    res["epochs_done"] = done_epochs
    res["stopped"] = stopped
    res["train_seconds"] = round(train_s, 2)
    res["train_samples_per_s"] = round(samples_seen / train_s, 1)  # incl. the per-step host work, not the evals
    res["padded_tokens_per_s"] = round(tokens_seen / train_s, 0)
    t0 = time.perf_counter()
    res["test"] = length_metrics(predict(m, test_ids, device), data["y_test"])
    res["train_orig_fit"] = length_metrics(predict(m, orig_ids, device), data["y_train"][: data["n_orig"]])
    res["eval_seconds"] = round(time.perf_counter() - t0, 2)
    return res


def write(out: Path, results: list, env: dict) -> None:
    (out / "results.json").write_text(json.dumps({"env": env, "results": results}, indent=1) + "\n")
    lines = [f"device: {env.get('device')}; torch {env.get('torch')}; transformers {env.get('transformers')}", "",
             "| variant | recipe | MAE | Acc-25 | Acc-50 | Acc-100 | train MAE (orig) | epochs | train samples/s | "
             "train s | wall s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "test" not in r:
            lines.append(f"| {r['variant']} | {r.get('desc', '')} | {r.get('error', r.get('skipped', ''))} |")
            continue
        t = r["test"]
        lines.append(f"| {r['variant']} | {r['desc']} | {t['mae']:.2f} | {t['acc25']:.2f}% | {t['acc50']:.2f}% | "
                     f"{t['acc100']:.2f}% | {r['train_orig_fit']['mae']:.2f} | {r['epochs_done']}/{r['epochs']} | "
                     f"{r['train_samples_per_s']} | {r['train_seconds']} | {r['wall_seconds']} |")
    (out / "results.md").write_text("\n".join(lines) + "\n")


T_START = time.time()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="A,C,B,D,C10,C_lr3e-5,C_bs128,C_emb")
    ap.add_argument("--budget-s", type=float, default=380.0, help="wall seconds for the whole script")
    ap.add_argument("--limit-train", type=int, default=0)
    ap.add_argument("--limit-test", type=int, default=0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=0, help="override every variant's epochs (local tests)")
    ap.add_argument("--cpu-bf16", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "numpy": np.__version__,
           "python": sys.version.split()[0],
           "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
           "model_py": model_mod.__file__}
    print(env, flush=True)

    z = np.load(DATA / "data.npz")
    train_ids = unpack(z["train_ids"], z["train_off"])
    test_ids = unpack(z["test_ids"], z["test_off"])
    y_train = z["y_train"].astype(np.float32)
    y_test = z["y_test"].astype(np.float32)
    y_orig = z["y_train_orig"].astype(np.float32)
    n_orig = len(y_orig)
    assert np.array_equal(y_train[:n_orig], y_orig)
    median = float(np.median(y_orig))  # train.py: init_tokens = median of the (unaugmented) train labels
    if args.limit_train:
        train_ids, y_train, n_orig = train_ids[: args.limit_train], y_train[: args.limit_train], min(
            n_orig, args.limit_train)
    if args.limit_test:
        test_ids, y_test = test_ids[: args.limit_test], y_test[: args.limit_test]
    data = {"train_ids": train_ids, "test_ids": test_ids, "y_train": y_train, "y_test": y_test, "n_orig": n_orig,
            "median": median}
    env.update(train=len(train_ids), train_orig=n_orig, test=len(test_ids), init_median=median)
    env["median_baseline_test"] = length_metrics(np.full_like(y_test, median), y_test)
    print(f"data: {len(train_ids)} train ({n_orig} originals), {len(test_ids)} test; median {median}; "
          f"median baseline {env['median_baseline_test']}", flush=True)
    enc_state = {k: v.float() for k, v in load_file(str(DATA / "minilm_distilbert_fp16.safetensors")).items()}

    end = T_START + args.budget_s
    results: list = []
    rate: dict[tuple, float] = {}  # samples/s by (max_input, trainable) family, measured
    for name in args.variants.split(","):
        v = dict(VARIANTS[name])
        if args.epochs:
            v["epochs"] = args.epochs
        remaining = end - time.time()
        key = ("short" if v["max_input"] <= 128 else "long", v["trainable"] == "last")
        est = None
        if key in rate:
            est = v["epochs"] * len(train_ids) / rate[key] + 3 * v["epochs"] + 10
        elif (key[0], not key[1]) in rate:  # the other trainable set: "last" ~1.5x the rate of "all"
            est = v["epochs"] * len(train_ids) / (rate[(key[0], not key[1])] * (1.5 if key[1] else 1 / 1.5)) + \
                3 * v["epochs"] + 10
        if remaining < 25 or (est is not None and est > remaining * 1.3):
            r = {"variant": name, "desc": v["desc"], "skipped": f"skipped: {remaining:.0f} s left, est {est}"}
            print(r["skipped"], flush=True)
            results.append(r)
            write(out, results, env)
            continue
        print(f"== {name}: {v['desc']} ({remaining:.0f} s left, est {est})", flush=True)
        t0 = time.time()
        try:
            r = train_variant(name, v, data, enc_state, device, args, deadline=end - 20)
        except Exception as e:  # keep the other variants
            import traceback

            traceback.print_exc()
            r = {"variant": name, "desc": v["desc"], "error": f"{type(e).__name__}: {e}"}
        r["wall_seconds"] = round(time.time() - t0, 1)
        if "test" in r:
            rate.setdefault(key, r["train_samples_per_s"])
            t = r["test"]
            print(f"== {name} done: test MAE {t['mae']:.2f} Acc-25 {t['acc25']:.2f}% Acc-50 {t['acc50']:.2f}% "
                  f"Acc-100 {t['acc100']:.2f}% | {r['train_samples_per_s']} samples/s, {r['wall_seconds']} s",
                  flush=True)
        results.append(r)
        write(out, results, env)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print((out / "results.md").read_text(), flush=True)
    print(f"total {time.time() - T_START:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
