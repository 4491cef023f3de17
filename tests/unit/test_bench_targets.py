"""bench/targets.py: the lines the benches print against their targets, by hand."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from targets import check, kernel_targets, trainer_targets  # noqa: E402


def test_a_ratio_just_under_its_bound_reads_as_missed():
    assert check("x", 1.996, 2.0) == "  x: 1.996x (>= 2x) -> missed"
    assert check("x", 3.0, 3.0) == "  x: 3.000x (>= 3x) -> met"
    assert check("q", 0.7496, 0.75, pct=True) == "  q: 74.96% (>= 75%) -> missed"
    assert check("s", 1.2004, 1.2, at_least=False) == "  s: 1.200x (<= 1.2x) -> missed"
    assert check("n", float("nan"), 3.0) == "  n: not measured -> missed"


def test_kernel_targets_pick_the_issue_shapes():
    results = {
        "matmul": [
            {"n": 8192, "k": 8192, "m": 1, "bf16_us": 30.0, "nvfp4_us": 10.0, "int4_us": 15.0},
            {"n": 8192, "k": 8192, "m": 64, "bf16_us": 30.0, "nvfp4_us": 30.0, "int4_us": 30.0},  # M > 16
            {"n": 4096, "k": 4096, "m": 1, "bf16_us": 9.0, "nvfp4_us": 9.0, "int4_us": 9.0},  # another shape
        ],
        "moe": [{"layer": "down", "tokens": 64, "grouped_bf16_us": 90.0, "nvfp4_us": 30.0, "int4_us": float("nan")}],
        "quant": [{"kernel": "nvfp4 tensor (amax + quant)", "pct_copy": 41.0}, {"kernel": "mxfp8", "pct_copy": 90.0}],
    }
    assert kernel_targets(results) == [
        "  nvfp4 matmul 8192x8192 M=1 vs bf16: 3.000x (>= 3x) -> met",
        "  int4 matmul 8192x8192 M=1 vs bf16: 2.000x (>= 3x) -> missed",
        "  nvfp4 MoE down T=64 vs grouped bf16: 3.000x (>= 3x) -> met",
        "  int4 MoE down T=64 vs grouped bf16: not measured -> missed",
        "  nvfp4 tensor (amax + quant) of a copy: 41.00% (>= 75%) -> missed",
    ]


def test_trainer_targets_compare_each_backend_with_its_own_plain_step():
    steps = {
        ("torch", "bf16"): 1.0,
        ("torch", "nvfp4_moe"): 1.73,
        ("megatron", "bf16"): 2.0,
        ("megatron", "int4_qat"): 2.3,
    }
    assert trainer_targets(steps) == [
        "  torch nvfp4_moe QAT step vs plain: 1.730x (<= 1.2x) -> missed",
        "  megatron int4_qat QAT step vs plain: 1.150x (<= 1.2x) -> met",
    ]
