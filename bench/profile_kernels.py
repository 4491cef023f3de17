"""Run each hot kernel once, for Nsight Compute (no timing here):

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats python3 bench/profile_kernels.py
"""

from __future__ import annotations

import torch

import policy.kernels as K
import rollout.kernels as RK
from policy.kernels import quant_triton as qt
from rollout.kernels import matmul_triton as mt


def main() -> None:
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    pw = RK.pack(K.quantize("nvfp4", w, scope="tensor"))
    torch.cuda.synchronize()
    qt.nvfp4_quantize(x, "row")
    for m in (1, 16):
        xa = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
        mt.w4a16_matmul(xa, pw.codes, pw.scales, pw.global_scale, mt.FMT_NVFP4, 0)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
