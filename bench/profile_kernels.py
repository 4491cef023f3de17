"""Run each hot kernel once, for Nsight Compute (no timing here):

    ncu --clock-control none --section SpeedOfLight --section Occupancy --section LaunchStats \
        --section WarpStateStats --section SchedulerStats python3 bench/profile_kernels.py [dense|moe]

dense: the nvfp4 row-scope quantizer on 8192x8192 and the 4-bit matmul on 8192x8192 at M = 1, 16.
moe: Qwen3-30B-A3B's routed experts (128 experts, top-8 random routing) at T = 64, gate_up then
down, nvfp4 then int4, each with the config table's entry; routing metadata computed before.
"""

from __future__ import annotations

import sys

import torch

import policy.kernels as K
import rollout.kernels as RK
from policy.kernels import quant_triton as qt
from rollout.kernels import matmul_triton as mt


def dense() -> None:
    w = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    pw = RK.pack(K.quantize("nvfp4", w, scope="tensor"))
    torch.cuda.synchronize()
    qt.nvfp4_quantize(x, "row")
    for m in (1, 16):
        xa = torch.randn(m, 8192, device="cuda", dtype=torch.bfloat16)
        mt.w4a16_matmul(xa, pw.codes, pw.scales, pw.global_scale, mt.FMT_NVFP4, 0)
    torch.cuda.synchronize()


def moe(experts: int = 128, topk: int = 8, tokens: int = 64) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)]).cuda()
    align = mt.moe_align_fast(ids, experts)
    for n, k in ((1536, 2048), (2048, 768)):
        w = torch.randn(experts, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        for fmt, fid, kw in (("nvfp4", mt.FMT_NVFP4, {"scope": "tensor"}), ("int4", mt.FMT_INT4, {"group_size": 32})):
            p = RK.pack_experts([K.quantize(fmt, w[e], **kw) for e in range(experts)])
            mt.moe_w4a16_matmul(x, p.codes, p.scales, p.global_scale, ids, fid, p.group_size, align=align)
        torch.cuda.synchronize()


if __name__ == "__main__":
    {"dense": dense, "moe": moe}[sys.argv[1] if len(sys.argv) > 1 else "dense"]()
