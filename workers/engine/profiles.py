"""The named performance profiles: limits, KV capacity from the architecture, and iteration-time coefficients
fitted once from `shared/data` (stored here, so workers run without the CSVs; `tests/workers/engine/
test_perf_model.py` refits and checks them). Refit: `switchyard bench profiles --refit`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from switchyard.workers.engine.perf_model import (
    ModelSpec,
    PerfCoeffs,
    PerfProfile,
    Table,
    load_batch_table,
    load_prefill_curve,
)

GIB = 1 << 30

LLAMA31_8B = ModelSpec(
    "Llama-3.1-8B", num_layers=32, num_q_heads=32, num_kv_heads=8, head_dim=128, num_params=8.03e9
)
LLAMA2_70B = ModelSpec(
    "Llama-2-70B", num_layers=80, num_q_heads=64, num_kv_heads=8, head_dim=128, num_params=68.98e9
)


def kv_capacity_tokens(
    model: ModelSpec,
    num_gpus: int,
    gpu_mem_gib: float = 80.0,
    utilization: float = 0.9,
    reserve_gib_per_gpu: float = 2.0,
) -> int:
    """KV slots: (GPUs x memory x utilisation - weights - activation reserve) / KV bytes per token."""
    free = num_gpus * gpu_mem_gib * GIB * utilization - model.num_params * model.dtype_bytes
    return int((free - num_gpus * reserve_gib_per_gpu * GIB) // model.kv_bytes_per_token)


def _sageserve_8b_tp2(data_dir: Path) -> list[Table]:
    pre, dec = load_batch_table(
        data_dir / "sageserve-profiles/Llama-3.1-8B-tp-2.csv",
        model=None,
        hardware=None,
        tp=2,
        units_s=True,
        decode_total=True,
        prefill_batch1_only=True,
        name="sageserve Llama-3.1-8B TP2",
        exclude_decode={
            (8192, 1, 128): "18.8 ms/iteration, twice the 9.4 ms measured at larger contexts "
            "(prompt 512, 8192 tokens): an outlier"
        },
    )
    return [pre, dec]


def _sageserve_8b_tp4_curve(data_dir: Path) -> list[Table]:
    return [
        load_prefill_curve(
            data_dir / "sageserve-profiles/llama-3.1-8B-tp-4-test.csv",
            "sageserve Llama-3.1-8B TP4 prefill curve",
        )
    ]


def _splitwise_70b_tp4(hardware: str, label: str, batch1_reason: str = "") -> Callable[[Path], list[Table]]:
    """Splitwise's llama2-70b TP4 rows on one GPU type: the prefill prompt sweep (and its batch sweep, unless a
    `batch1_reason` says why not), the decode batch and length sweeps."""

    def load(data_dir: Path) -> list[Table]:
        pre, dec = load_batch_table(
            data_dir / "splitwise-sim/perf_model.csv",
            model="llama2-70b",
            hardware=hardware,
            tp=4,
            units_s=False,
            decode_total=False,
            prefill_batch1_only=bool(batch1_reason),
            name=f"splitwise llama2-70b {label} TP4",
            batch1_reason=batch1_reason,
        )
        return [pre, dec]

    return load


# table key -> loader(data_dir) -> tables
TABLE_LOADERS: dict[str, Callable[[Path], list[Table]]] = {
    "sageserve-8b-tp2": _sageserve_8b_tp2,
    "sageserve-8b-tp4-curve": _sageserve_8b_tp4_curve,
    "splitwise-70b-h100-tp4": _splitwise_70b_tp4("h100-80gb", "H100"),
    "splitwise-70b-a100-tp4": _splitwise_70b_tp4(
        "a100-80gb", "A100", "slower than one prompt of the same tokens (4 x 512: 571 ms, one 2,048-token prompt: "
        "403 ms), which no per-iteration token model fits"
    ),
}


# Llama-3.1-8B, 2 x A100-80GB:
#   2 x 80 GiB x 0.9 = 144 GiB = 154,618,822,656 B; weights 8.03e9 x 2 B = 16,060,000,000 B;
#   activation reserve 2 x 2 GiB = 4,294,967,296 B; KV = 134,263,855,360 B / 131,072 B per token
#   (2 x 32 layers x 8 KV heads x 128 x 2 B) = 1,024,351 tokens (after float rounding) = 64,021 blocks of 16.
LLAMA3_8B_A100 = PerfProfile(
    name="llama3-8b-a100",
    description=(
        "Llama-3.1-8B (bf16) on A100-80GB, TP2, vLLM: fitted to SageServe's TP-2 table (prefill from the batch-1 "
        "rows, decode from all rows) and its TP-4 single-request prefill curve. Prompts beyond 8k tokens and "
        "decode contexts beyond ~8.7k are extrapolation (first-principles attention terms)."
    ),
    model=LLAMA31_8B,
    max_model_len=131072,  # the Mooncake trace has 126k-token prompts
    kv_capacity_tokens=kv_capacity_tokens(LLAMA31_8B, num_gpus=2),
    # fitted by perf_model.fit_coeffs (knee grid step 16) on the tables below
    coeffs=PerfCoeffs(
        step_ms=8.2374,
        prefill_ms=16.194,
        per_decode_ms=0.16575,
        decode_ctx_ms_per_ktok=0.14055,
        lin_ms_per_tok=0.058188,
        knee_tokens=400,
    ),
    # 131,072 B per token / (2 GPUs x 2.0e12 B/s) = 3.28e-8 s per token = 0.0328 ms per 1000 tokens
    decode_ctx_floor_ms_per_ktok=131072 / (2 * 2.0e12) * 1e6,
    tables=("sageserve-8b-tp2", "sageserve-8b-tp4-curve"),
    notes="excluded: SageServe batch>1 prompt_time (not a batch prefill), the prompt-8192 decode outlier",
)

# Llama-2-70B, 4 x H100-80GB:
#   4 x 80 GiB x 0.9 = 288 GiB = 309,237,645,312 B; weights 68.98e9 x 2 B = 137,960,000,000 B;
#   activation reserve 4 x 2 GiB = 8,589,934,592 B; KV = 162,687,710,720 B / 327,680 B per token
#   (2 x 80 layers x 8 KV heads x 128 x 2 B) = 496,483 tokens = 31,030 blocks of 16.
LLAMA2_70B_H100_TP4 = PerfProfile(
    name="llama2-70b-h100-tp4",
    description=(
        "Llama-2-70B (fp16) on H100-80GB, TP4: fitted to Splitwise's perf_model.csv (llama2-70b, h100-80gb, TP4; "
        "prefill prompt and batch sweeps, decode batch and length sweeps). Beyond 8k tokens / batch 64 is "
        "extrapolation."
    ),
    model=LLAMA2_70B,
    max_model_len=4096,
    kv_capacity_tokens=kv_capacity_tokens(LLAMA2_70B, num_gpus=4),
    # fitted by perf_model.fit_coeffs (knee grid step 16) on the table below
    coeffs=PerfCoeffs(
        step_ms=28.823,
        prefill_ms=21.074,
        per_decode_ms=0.26419,
        decode_ctx_ms_per_ktok=0.10077,
        lin_ms_per_tok=0.10308,
        knee_tokens=464,
    ),
    # 327,680 B per token / (4 GPUs x 3.35e12 B/s) = 2.45e-8 s per token = 0.0245 ms per 1000 tokens
    decode_ctx_floor_ms_per_ktok=327680 / (4 * 3.35e12) * 1e6,
    tables=("splitwise-70b-h100-tp4",),
    notes="no rows excluded (the anomalous batch-64 rows are TP2, not used)",
)

# Llama-2-70B, 4 x A100-80GB: the same memory as the H100 profile, so the same KV capacity (496,483 tokens); the
# slower GPU beside it, for mixed fleets (`bench sim --profile llama2-70b-h100-tp4:4,llama2-70b-a100-tp4:4`).
LLAMA2_70B_A100_TP4 = PerfProfile(
    name="llama2-70b-a100-tp4",
    description=(
        "Llama-2-70B (fp16) on A100-80GB, TP4: fitted to Splitwise's perf_model.csv (llama2-70b, a100-80gb, TP4; "
        "prefill from the prompt sweep at batch 1, decode batch and length sweeps). Beyond 8k tokens / batch 64 is "
        "extrapolation. About 2x the H100's prefill and 1.5x its decode iteration."
    ),
    model=LLAMA2_70B,
    max_model_len=4096,
    kv_capacity_tokens=kv_capacity_tokens(LLAMA2_70B, num_gpus=4),
    # fitted by perf_model.fit_coeffs (knee grid step 16) on the tables below
    coeffs=PerfCoeffs(
        step_ms=43.317,
        prefill_ms=20.769,
        per_decode_ms=0.18254,
        decode_ctx_ms_per_ktok=0.37156,
        lin_ms_per_tok=0.21122,
        knee_tokens=208,
    ),
    # 327,680 B per token / (4 GPUs x 2.039e12 B/s) = 4.02e-8 s per token = 0.0402 ms per 1000 tokens
    decode_ctx_floor_ms_per_ktok=327680 / (4 * 2.039e12) * 1e6,
    tables=("splitwise-70b-a100-tp4",),
    notes=(
        "excluded: the prefill batch sweep (prompt 512 x batch 2-64), slower than one prompt of the same tokens "
        "(4 x 512: 571 ms, one 2,048-token prompt: 403 ms; 16 x 512: 2,893 ms against 2,279 ms); with it the "
        "fit's median prefill error is 12%; on H100 the two sweeps agree within 10%"
    ),
)

PROFILES: dict[str, PerfProfile] = {
    p.name: p for p in (LLAMA3_8B_A100, LLAMA2_70B_H100_TP4, LLAMA2_70B_A100_TP4)
}
DEFAULT_PROFILE = LLAMA3_8B_A100.name


def get_profile(name: str = DEFAULT_PROFILE) -> PerfProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {sorted(PROFILES)}") from None


def load_profile_tables(profile: PerfProfile, data_dir: Path) -> list[Table]:
    return [t for key in profile.tables for t in TABLE_LOADERS[key](data_dir)]
