"""Sweep configs of the weight-only 4-bit decode matmul against torch bf16, in one run (CUDA only).

For each config (BN, BK, num_warps, num_stages, SPLIT[, maxnreg]) of `matmul_triton._w4a16_kernel`
this times nvfp4 and int4 on 8192x8192 (and the best three on 4096x4096) at M = 1, 4, 16, next to
torch bf16 `F.linear` measured in the same run, and checks each config's output: close to the
reference dequantize + fp32 matmul, and row-for-row identical between M = 1 and M = 16 (batch
invariance). Timing is `bench_kernels.bench` (CUDA graphs, L2 cleared before every run).

Compilation is the slow part of a sweep, so a pool of processes compiles every (config, format,
M == 1 or not) specialization first, in parallel, into Triton's on-disk cache.

    PYTHONPATH=. python bench/tune_qmatmul.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time

import torch
import torch.nn.functional as F

CONFIGS = [  # earlier sweeps (23 + 7 configs) found nothing faster: docs/design-decisions.md
    (64, 128, 2, 2, 8, 128),  # the table's 8192x8192 entry on 2026-11-29
    (64, 128, 2, 2, 16, 128),
    # four warps per 64 rows, wider K tiles, more splits: the fastest weight-read floors of
    # `bench_kernels.py --floor-sweep` (22.5 us against the table entry's 28.9 us on the H100);
    # none beat the table entry on the H100 either (2026-12-05, docs/benchmarks.md)
    (64, 256, 4, 4, 16),
    (64, 256, 4, 2, 16),
    (64, 256, 4, 4, 8),
    (64, 256, 4, 2, 8),
    (64, 128, 4, 2, 16),
    (64, 128, 4, 4, 16),
    (64, 512, 4, 4, 4),
    (128, 256, 4, 2, 16),
]
MS = (1, 4, 16)


def _compile_one(job) -> str:
    """Run one config once per specialization (M == 1 and M > 1) so Triton caches its binary."""
    fmt, cfg, n, k = job
    from rollout.kernels import matmul_triton as mt

    try:
        words = torch.randint(-(2**31), 2**31 - 1, (n, k // 8), dtype=torch.int32, device="cuda")
        if fmt == mt.FMT_NVFP4:
            scales = torch.randint(0, 120, (n, k // 16), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
            gs = torch.ones(1, device="cuda")
        else:
            scales = torch.rand(n, k // 32, device="cuda").to(torch.bfloat16)
            gs = None
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            mt.w4a16_matmul(x, words, scales, gs, fmt, 32, config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported, and the config is dropped from the sweep
        return f"{fmt} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def compile_all(compile_one, jobs: list, workers: int) -> set[str]:
    """compile_one(job) over jobs in a pool of spawned processes, so Triton's on-disk cache holds every
    binary before the timing starts; prints the failures. -> the failed jobs' keys (an error's text
    before its first colon: "fmt config")."""
    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.map(compile_one, jobs, chunksize=1) if e]
    print(f"compiled {len(jobs)} jobs in {time.time() - t0:.0f} s; failures: {len(errors)}", flush=True)
    for e in errors:
        print("  compile failed:", e, flush=True)
    return {e.split(":")[0] for e in errors}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, ".")
    import policy.kernels as K
    import rollout.kernels as RK
    from bench.bench_kernels import bench, make_weights
    from rollout.kernels import matmul_triton as mt

    t0 = time.time()
    bad = compile_all(
        _compile_one, [(f, c, 8192, 8192) for c in CONFIGS for f in (mt.FMT_NVFP4, mt.FMT_INT4)], args.workers
    )

    out = {"rows": [], "bf16": {}}
    for (n, k), cfgs in (((8192, 8192), CONFIGS), ((4096, 4096), None)):
        ws = make_weights(n, k)
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in MS}
        t_bf = {m: bench(lambda: F.linear(xs[m], ws["bf16"])) for m in MS}
        out["bf16"][f"{n}x{k}"] = t_bf
        print(f"\n{n}x{k} torch bf16: " + " ".join(f"M={m} {t_bf[m]:.1f}us" for m in MS), flush=True)
        if cfgs is None:  # the smaller shape: the 3 best configs of the big one
            ranked = sorted((r for r in out["rows"] if r["shape"] == "8192x8192" and r["ok"]), key=lambda r: r["score"])
            cfgs = [tuple(r["cfg"]) for r in ranked[:3]]
        for cfg in cfgs:
            row = {"shape": f"{n}x{k}", "cfg": list(cfg), "us": {}, "ok": True}
            for fmt in ("nvfp4", "int4"):
                fid = mt.FMT_NVFP4 if fmt == "nvfp4" else mt.FMT_INT4
                if f"{fid} {cfg}" in bad:
                    row["ok"] = False
                    continue
                w = ws[fmt]

                def run(x, w=w, fid=fid, cfg=cfg):
                    return mt.w4a16_matmul(x, w.codes, w.scales, w.global_scale, fid, w.group_size, config=cfg)

                y16 = run(xs[16])
                ref = xs[16].float() @ K.dequantize(RK.unpack(w)).T
                err = float((y16.float() - ref).norm() / ref.norm())
                same = torch.equal(run(xs[16][:1])[0], y16[0]) and torch.equal(run(xs[16][3:7]), y16[3:7])
                repeat = torch.equal(run(xs[16]), y16)
                row["err_" + fmt] = err
                row["ok"] &= err < 8e-3 and same and repeat
                for m in MS:
                    row["us"][f"{fmt}{m}"] = bench(lambda: run(xs[m]))
            if len(row["us"]) == 2 * len(MS):
                row["score"] = sum(row["us"].values())
                out["rows"].append(row)
                sp = " ".join(
                    f"{row['us'][f'{f}{m}']:5.1f}/{t_bf[m] / row['us'][f'{f}{m}']:4.2f}x"
                    for f in ("nvfp4", "int4")
                    for m in MS
                )
                print(
                    f"{str(cfg):26s} ok={row['ok']!s:5s} err {row['err_nvfp4']:.1e}/{row['err_int4']:.1e} | {sp}",
                    flush=True,
                )

    for shape in ("8192x8192", "4096x4096"):
        ranked = sorted((r for r in out["rows"] if r["shape"] == shape and r["ok"]), key=lambda r: r["score"])
        t_bf = out["bf16"][shape]
        print(f"\nbest on {shape} (us / speedup vs bf16; nvfp4 M=1,4,16 then int4 M=1,4,16):", flush=True)
        for r in ranked[:6]:
            print(
                f"  {str(tuple(r['cfg'])):26s} "
                + " ".join(
                    f"{r['us'][f'{f}{m}']:5.1f}/{t_bf[m] / r['us'][f'{f}{m}']:4.2f}x"
                    for f in ("nvfp4", "int4")
                    for m in MS
                ),
                flush=True,
            )
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
