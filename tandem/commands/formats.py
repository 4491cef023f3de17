"""`tandem formats`: quantize one tensor with every format and print what each costs and loses.

The default input is weight-like: a Student-t (df=4) matrix in bf16, heavy-tailed like trained
LLM weights, so outliers stress the block scales the way real weights do. `--load FILE --key NAME`
takes a real tensor from a torch file instead (read with weights_only=True: nothing is unpickled).
"""

from __future__ import annotations

import argparse
import time

import torch

from policy import formats

# (label, format, kwargs): every format and scope the recipes use.
VARIANTS = [
    ("bf16", "bf16", {}),
    ("fp8_block 128x128", "fp8_block", {"block": (128, 128)}),
    ("fp8_block 1x128", "fp8_block", {"block": (1, 128)}),
    ("mxfp8", "mxfp8", {}),
    ("nvfp4 tensor", "nvfp4", {"scope": "tensor"}),
    ("nvfp4 row", "nvfp4", {"scope": "row"}),
    ("int4 g32", "int4", {"group_size": 32}),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=2048, help="rows M of the generated input (default 2048)")
    p.add_argument(
        "--cols", type=int, default=2048, help="columns K, the blocked dim (default 2048; a multiple of 128)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated input (default 0)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per format (best is reported)")
    p.add_argument("--load", metavar="FILE", help="a torch file holding a tensor or a dict of tensors")
    p.add_argument("--key", help="which tensor of --load's dict")


def _input(args) -> tuple[torch.Tensor, str]:
    if args.load:
        obj = torch.load(args.load, map_location="cpu", weights_only=True)
        t = obj[args.key] if isinstance(obj, dict) else obj
        if t.dim() != 2:
            raise SystemExit(f"tandem formats: tensor {args.key or args.load!r} is {t.dim()}-D; need 2-D")
        return t, f"{args.load}:{args.key or ''} {tuple(t.shape)} {t.dtype}"
    g = torch.Generator().manual_seed(args.seed)
    df = 4.0
    # Student-t = normal / sqrt(chi2/df); chi2 from a sum of squared normals keeps it torch-only.
    chi2 = torch.randn(int(df), args.rows, args.cols, generator=g).pow(2).sum(0)
    t = torch.randn(args.rows, args.cols, generator=g) / (chi2 / df).sqrt() * 0.02
    return t.to(torch.bfloat16), f"Student-t(df=4) weights {args.rows}x{args.cols} bfloat16"


def measure(x: torch.Tensor, fmt: str, kw: dict, repeats: int) -> dict:
    m = formats.get(fmt)
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        q = m.quantize(x, **kw)
        best = min(best, time.perf_counter() - t0)
    xf = x.float()
    err = (m.dequantize(q) - xf).double()
    nbytes = sum(p.numel() * p.element_size() for p in q.parts().values())
    return {
        "bits_per_value": 8.0 * nbytes / x.numel(),
        "rel_error": (err.norm() / xf.double().norm()).item(),
        "max_abs_error": err.abs().max().item(),
        "mb_per_s": x.numel() * x.element_size() / best / 1e6,
    }


def main(args) -> int:
    x, what = _input(args)
    print(
        f"input: {what}; {torch.get_num_threads()} CPU threads; throughput = input MB / quantize s (best of {args.repeats})"
    )
    print(f"{'format':<20}{'bits/value':>11}{'rel error':>11}{'max |err|':>11}{'MB/s':>9}")
    for label, fmt, kw in VARIANTS:
        r = measure(x, fmt, kw, args.repeats)
        print(
            f"{label:<20}{r['bits_per_value']:>11.3f}{r['rel_error']:>11.4f}{r['max_abs_error']:>11.2e}{r['mb_per_s']:>9.0f}"
        )
    return 0
