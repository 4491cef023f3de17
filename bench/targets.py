"""The targets the benches print: a measured ratio against its bound, to three decimals (or a
hundredth of a percent) so that a miss never reads as a pass, then met or missed.

    check(label, value, bound, at_least=True, pct=False) -> one line
    kernel_targets(results)                   -> lines, from bench_kernels.py's RESULTS
    trainer_targets(steps)                    -> lines, from bench_trainer.py's {(backend, recipe): step_s}

Kernels: the 4-bit decode matmul at 8192 x 8192 and M <= 16 runs >= 3.0x cuBLAS bf16 (nvfp4 and
int4); the MoE layer at T <= 64 >= 3.0x torch's grouped bf16 GEMM; NVFP4 tensor-scope activation
quantization >= 75% of a device copy's GB/s. Trainer: a QAT step (nvfp4_moe, int4_qat) <= 1.2x the
plain bf16 step of the same backend. The engine's (bench_engine.py): nvfp4_moe and int4_qat >= 2.5x
bf16's tok/s at batch 64, >= 60% of the HBM roofline.
"""

from __future__ import annotations

import math

MATMUL_X = 3.0
MOE_X = 3.0
TENSOR_QUANT_PCT_COPY = 75.0
QAT_STEP_X = 1.2
ENGINE_X = 2.5
ENGINE_ROOFLINE = 0.60


def check(label: str, value: float, bound: float, *, at_least: bool = True, pct: bool = False) -> str:
    if value is None or math.isnan(value):
        return f"  {label}: not measured -> missed"
    ok = value >= bound if at_least else value <= bound
    shown, bound_shown = (f"{value:.2%}", f"{bound:.0%}") if pct else (f"{value:.3f}x", f"{bound:g}x")
    return f"  {label}: {shown} ({'>=' if at_least else '<='} {bound_shown}) -> {'met' if ok else 'missed'}"


def kernel_targets(results: dict) -> list[str]:
    lines = []
    for r in results.get("matmul", []):
        if (r["n"], r["k"]) == (8192, 8192) and r["m"] <= 16:
            for fmt in ("nvfp4", "int4"):
                lines.append(
                    check(f"{fmt} matmul 8192x8192 M={r['m']} vs bf16", r["bf16_us"] / r[f"{fmt}_us"], MATMUL_X)
                )
    for r in results.get("moe", []):
        if r["tokens"] <= 64:
            for fmt in ("nvfp4", "int4"):
                label = f"{fmt} MoE {r['layer']} T={r['tokens']} vs grouped bf16"
                lines.append(check(label, r["grouped_bf16_us"] / r[f"{fmt}_us"], MOE_X))
    for r in results.get("quant", []):
        if r["kernel"].startswith("nvfp4 tensor") and "pct_copy" in r:
            lines.append(check(f"{r['kernel']} of a copy", r["pct_copy"] / 100, TENSOR_QUANT_PCT_COPY / 100, pct=True))
    return lines


def trainer_targets(steps: dict) -> list[str]:
    lines = []
    for (backend, recipe), step_s in steps.items():
        plain = steps.get((backend, "bf16"))
        if recipe in ("nvfp4_moe", "int4_qat") and plain:
            lines.append(check(f"{backend} {recipe} QAT step vs plain", step_s / plain, QAT_STEP_X, at_least=False))
    return lines
