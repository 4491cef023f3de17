"""Sweep configs of the MoE 4-bit layer (`moe_w4a16_matmul`) against grouped bf16, in one run (CUDA only).

A config is (BN, BK, num_warps, num_stages, SPLIT, maxnreg, programs per SM): programs per SM 0
launches one program per (16-row block, N tile), more launches the persistent kernel on that many
programs per SM. Each config runs nvfp4 and int4 on Qwen3-30B-A3B's expert shapes (128 experts,
top-8 random routing; gate_up 2048 -> 2x768, down 768 -> 2048) at T = 1, 4, 16, 64 tokens, next to
`torch._grouped_mm` bf16 measured in the same run, and is checked: close to the reference dequantize +
fp32 matmul, a token's rows the same bits at T = 1 as at T = 64 (batch invariance), the same bits on a
repeat, and a persistent config bit-equal to the one-program-per-item launch of the same tile.
"floor": `bench_kernels.stream_floor` over all 128 experts' words and scales with the config's tile
(the loads alone, no x, no dequant, no dot), scaled to the experts T = 64 routes: the best a kernel
with that memory pattern could do at T = 64.
Timing is `bench_kernels.bench` (CUDA graphs, L2 cleared before every run). A config's times include
the routing metadata (`moe_align_fast`, 3-11 us) and the baseline's leave out its sort, so the ratios
here are lower than `bench_kernels.py`'s, which times the metadata apart.

    PYTHONPATH=. python bench/tune_moe.py [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch
from targets import MOE_X, check  # bench/targets.py, beside this script

CONFIGS = [
    (32, 256, 2, 3, 1),  # the table's entry for both shapes (H200, 2026-11-29)
    (32, 256, 2, 4, 1),
    (64, 256, 2, 3, 1),
    (64, 256, 4, 3, 1),
    (32, 128, 2, 4, 1),
    (64, 128, 2, 4, 1),  # 258 instructions per KB of nvfp4 codes, 106 registers (bench/sass_census.py)
    (64, 128, 2, 3, 1),
    (32, 256, 2, 3, 2),  # split K in two: twice the programs at small T (fixed per shape, never per T)
    (32, 128, 2, 4, 2),
    (32, 256, 2, 3, 1, 0, 4),
    (32, 256, 2, 3, 1, 0, 6),
    (32, 256, 2, 3, 1, 0, 8),  # 124 / 128 registers, 26.6 KB shared (sass_census): eight fit an SM
    (32, 256, 2, 4, 1, 0, 4),
    (32, 256, 2, 4, 1, 0, 6),
    (32, 128, 2, 6, 1, 0, 6),
    (64, 256, 2, 3, 1, 0, 4),
    (64, 128, 2, 4, 1, 0, 6),
    (64, 256, 4, 3, 1, 0, 3),
    (64, 256, 4, 4, 1, 0, 2),
]
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}
TS = (1, 4, 16, 64)
EXPERTS, TOPK = 128, 8
FORMATS = ("nvfp4", "int4")


def _ids(t: int) -> torch.Tensor:
    g = torch.Generator(device="cpu").manual_seed(t)
    return torch.stack([torch.randperm(EXPERTS, generator=g)[:TOPK] for _ in range(t)]).cuda()


def _weights(n: int, k: int, seed: int = 0):
    import policy.kernels as K
    import rollout.kernels as RK

    torch.manual_seed(seed)
    w = torch.randn(EXPERTS, n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    packed = {
        fmt: RK.pack_experts([K.quantize(fmt, w[e], **kw) for e in range(EXPERTS)])
        for fmt, kw in (("nvfp4", {"scope": "tensor"}), ("int4", {"group_size": 32}))
    }
    return w, packed


def _run(x, w, ids, cfg):
    from rollout.kernels import matmul_triton as mt

    fid = mt.FMT_NVFP4 if w.fmt == "nvfp4" else mt.FMT_INT4
    return mt.moe_w4a16_matmul(x, w.codes, w.scales, w.global_scale, ids, fid, w.group_size, config=cfg)


def _compile_one(job) -> str:
    """Run one config at T = 1 and 4 (Triton's M specializations) on random codes so its binaries are cached."""
    fmt, cfg, n, k = job
    from rollout.kernels import matmul_triton as mt

    try:
        words = torch.randint(-(2**31), 2**31 - 1, (EXPERTS, n, k // 8), dtype=torch.int32, device="cuda")
        if fmt == "nvfp4":
            scales = torch.randint(0, 120, (EXPERTS, n, k // 16), dtype=torch.uint8, device="cuda")
            fid, gs = mt.FMT_NVFP4, torch.ones(EXPERTS, device="cuda")
        else:
            scales = torch.rand(EXPERTS, n, k // 32, device="cuda").to(torch.bfloat16)
            fid, gs = mt.FMT_INT4, None
        for t in (1, 4):
            x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16)
            mt.moe_w4a16_matmul(x, words, scales, gs, _ids(t), fid, 32, config=cfg)
        torch.cuda.synchronize()
        return ""
    except Exception as e:  # reported, and the config is dropped from the sweep
        return f"{fmt} {cfg}: {type(e).__name__}: {str(e)[:200]}"


def _check(w, ref_w, xs, cfg) -> tuple[float, bool]:
    """(relative error at T = 16, batch-invariant and repeatable at T = 64 and, if persistent, equal
    to the per-item launch of the same tile)."""
    x16, ids16 = xs[16]
    ref = torch.einsum("tk,tjnk->tjn", x16.float(), ref_w[ids16])
    err = float((_run(x16, w, ids16, cfg).float() - ref).norm() / ref.norm())
    x64, ids64 = xs[64]
    y = _run(x64, w, ids64, cfg)
    ok = torch.equal(_run(x64[:1], w, ids64[:1], cfg)[0], y[0]) and torch.equal(_run(x64, w, ids64, cfg), y)
    if len(cfg) > 6 and cfg[6]:
        ok &= torch.equal(_run(x64, w, ids64, cfg[:5]), y)
    return err, ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, ".")
    import policy.kernels as K
    import rollout.kernels as RK
    from bench.bench_kernels import bench, stream_floor
    from bench.tune_qmatmul import compile_all

    t0 = time.time()
    bad = compile_all(
        _compile_one, [(f, c, n, k) for c in CONFIGS for f in FORMATS for n, k in SHAPES.values()], args.workers
    )

    out = {"device": torch.cuda.get_device_name(), "grouped_bf16_us": {}, "rows": []}
    for name, (n, k) in SHAPES.items():
        w, packed = _weights(n, k)
        refs = {fmt: torch.stack([K.dequantize(RK.unpack(p, e)) for e in range(EXPERTS)]) for fmt, p in packed.items()}
        xs = {t: (torch.randn(t, k, device="cuda", dtype=torch.bfloat16), _ids(t)) for t in TS}
        t_grp = {}
        for t, (x, ids) in xs.items():
            flat = ids.flatten()
            xg = x[torch.sort(flat, stable=True).indices // TOPK].contiguous()
            offs = torch.cumsum(torch.bincount(flat, minlength=EXPERTS), 0).to(torch.int32)
            wt = w.transpose(1, 2)
            t_grp[t] = bench(
                lambda xg=xg, offs=offs, wt=wt: torch._grouped_mm(xg, wt, offs=offs, out_dtype=torch.bfloat16)
            )
        out["grouped_bf16_us"][name] = t_grp
        active = len(torch.unique(xs[64][1])) / EXPERTS
        flat = dataclasses.replace(packed["nvfp4"], codes=packed["nvfp4"].codes.flatten(0, 1),
                                   scales=packed["nvfp4"].scales.flatten(0, 1), num_experts=0)  # fmt: skip
        floors = {}
        print(f"\n{name} {n}x{k}, grouped bf16: " + " ".join(f"T={t} {v:.1f}us" for t, v in t_grp.items()), flush=True)
        for cfg in CONFIGS:
            if k % cfg[1]:
                continue
            row = {"shape": name, "cfg": list(cfg), "us": {}, "ok": True}
            for fmt in FORMATS:
                if f"{fmt} {cfg}" in bad:
                    row["ok"] = False
                    continue
                err, ok = _check(packed[fmt], refs[fmt], xs, cfg)
                row["err_" + fmt], row["ok"] = err, row["ok"] and ok and err < 8e-3
                for t, (x, ids) in xs.items():
                    row["us"][f"{fmt}{t}"] = bench(lambda x=x, ids=ids, w=packed[fmt]: _run(x, w, ids, cfg))
            if cfg[:5] not in floors:
                floors[cfg[:5]] = stream_floor(flat, cfg[:5]) * active
            row["floor_us"] = floors[cfg[:5]]
            if len(row["us"]) == 2 * len(TS):
                row["score"] = sum(row["us"][f"{f}{t}"] / t_grp[t] for f in FORMATS for t in TS)
                out["rows"].append(row)
                sp = " ".join(
                    f"{row['us'][f'{f}{t}']:6.1f}/{t_grp[t] / row['us'][f'{f}{t}']:5.3f}x" for f in FORMATS for t in TS
                )
                floor = f"floor {row['floor_us']:6.1f}/{t_grp[64] / row['floor_us']:5.3f}x"
                print(f"{str(cfg):28s} ok={row['ok']!s:5s} | {sp} | {floor}", flush=True)
        w = packed = refs = None
        torch.cuda.empty_cache()

    best = {}
    for name in SHAPES:
        ranked = sorted((r for r in out["rows"] if r["shape"] == name and r["ok"]), key=lambda r: r["score"])
        print(f"\nbest on {name} (us / x grouped bf16; nvfp4 T={TS} then int4):", flush=True)
        for r in ranked[:5]:
            t_grp = out["grouped_bf16_us"][name]
            print(
                f"  {str(tuple(r['cfg'])):28s} "
                + " ".join(
                    f"{r['us'][f'{f}{t}']:6.1f}/{t_grp[t] / r['us'][f'{f}{t}']:5.3f}x" for f in FORMATS for t in TS
                ),
                flush=True,
            )
        if ranked:
            best[SHAPES[name]] = tuple(ranked[0]["cfg"])
            t_grp = out["grouped_bf16_us"][name]
            for f in FORMATS:
                for t in TS:
                    speedup = t_grp[t] / ranked[0]["us"][f"{f}{t}"]
                    print(check(f"{f} MoE {name} T={t} vs grouped bf16, best config", speedup, MOE_X), flush=True)
    print("MOE_CONFIGS = " + repr(best), flush=True)
    print(f"total {time.time() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
