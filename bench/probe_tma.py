"""A/B of the decode matmul's weight loads: per-thread cp.async (default) against one TMA bulk
tensor copy per tile (`w4a16_matmul(..., tma=True)`), same configs, same run, on 8192x8192 at
M = 1, 4, 16, with torch bf16 F.linear as the baseline and a correctness check per config.

    PYTHONPATH=. python bench/probe_tma.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import policy.kernels as K
from bench.bench_kernels import bench, make_weights
from policy.kernels import matmul_triton as mt

CONFIGS = [(64, 128, 2, 2, 8, 128), (64, 128, 2, 3, 8, 128), (64, 128, 2, 4, 8, 128), (32, 256, 2, 2, 4),
           (32, 256, 2, 3, 4), (64, 256, 2, 3, 4, 168), (128, 128, 4, 3, 8), (128, 128, 4, 4, 8)]
MS = (1, 4, 16)


def main() -> None:
    n = k = 8192
    ws = make_weights(n, k)
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in MS}
    t_bf = {m: bench(lambda: F.linear(xs[m], ws["bf16"])) for m in MS}
    print("bf16 " + " ".join(f"M={m} {t_bf[m]:.1f}us" for m in MS), flush=True)
    for fmt in ("nvfp4", "int4"):
        w = ws[fmt]
        fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
        ref = xs[16].float() @ K.dequantize(K.unpack(w)).T
        for cfg in CONFIGS:
            row = []
            for tma in (False, True):
                def run(x, cfg=cfg, tma=tma):
                    return mt.w4a16_matmul(x, w.codes, w.scales, w.global_scale, fid, w.group_size, config=cfg, tma=tma)
                try:
                    y = run(xs[16])
                    err = float((y.float() - ref).norm() / ref.norm())
                    ts = [bench(lambda: run(xs[m])) for m in MS]
                    row.append(f"{'tma' if tma else 'cp.async'} err {err:.1e} " +
                               " ".join(f"{t:5.1f}/{t_bf[m] / t:4.2f}x" for t, m in zip(ts, MS)))
                except Exception as e:  # a config that does not compile is reported, not fatal
                    row.append(f"{'tma' if tma else 'cp.async'} failed: {type(e).__name__}: {str(e)[:120]}")
            print(f"{fmt} {str(cfg):26s} | " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
