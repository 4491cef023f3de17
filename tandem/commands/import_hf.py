"""`tandem import-hf DIR --recipe R [--json]`: what Tandem makes of a Hugging Face checkpoint, without
loading it: the model config it maps to (or the field it refuses), the recipe's plan, and the bytes
per format (on disk, and as published under the recipe). Reads config.json and the safetensors
headers only, so a 60 GB checkpoint takes a second.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

from policy.recipe import BUILTINS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="Hugging Face model folder (config.json + *.safetensors)")
    p.add_argument("--recipe", default="nvfp4_moe", help=f"built-in ({', '.join(BUILTINS)}) or a YAML file")
    p.add_argument("--json", action="store_true", help="the plan as JSON (tandem plan --json) plus a bytes section")


def published_bytes(entry) -> int:
    """Bytes of one parameter as published under its plan entry (codes + scales)."""
    shape = entry.shape if len(entry.shape) == 2 else (1, entry.shape[0])
    m, k = shape
    n = m * k
    fmt, kw = entry.format, entry.kwargs
    if fmt == "bf16":
        return 2 * n
    if fmt == "nvfp4":
        return n // 2 + n // 16 + 4 * (m if kw.get("scope") == "row" else 1)
    if fmt == "mxfp8":
        return n + n // 32
    if fmt == "int4":
        return n // 2 + 2 * (n // kw["group_size"])
    if fmt == "fp8_block":
        bm, bk = kw["block"]
        return n + 4 * math.ceil(m / bm) * (k // bk)
    raise ValueError(f"unknown format {fmt!r}")


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def main(args) -> int:
    from policy.checkpoint import read_shapes
    from tandem.commands.plan import make_plan, render

    path = Path(args.path)
    try:
        cfg, _ = read_shapes(path)  # config.json + headers: every name and shape checked, no weight read
        recipe, plan = make_plan(args.recipe, cfg)
    except ValueError as e:
        print(f"tandem import-hf: {e}", file=sys.stderr)
        return 2
    by_format: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for e in plan.params:
        key = e.format if e.format == "bf16" else f"{e.format}/{e.scope}"
        by_format[key][0] += e.numel
        by_format[key][1] += published_bytes(e)
    published = sum(b for _, b in by_format.values())
    on_disk = disk_bytes(path)
    if args.json:
        render(recipe, plan, str(path), True)
        print(json.dumps({"bytes": {"on_disk": on_disk, "published": published, "by_format": dict(by_format)}}))
        return 0
    render(recipe, plan, str(path), False)
    print(f"\n{'format':<14}{'parameters':>18}{'published bytes':>18}{'bits/param':>12}")
    for key, (numel, nbytes) in sorted(by_format.items(), key=lambda kv: -kv[1][1]):
        print(f"{key:<14}{numel:>18,}{nbytes:>18,}{8 * nbytes / max(numel, 1):>12.2f}")
    total = sum(n for n, _ in by_format.values())
    print(f"{'total':<14}{total:>18,}{published:>18,}{8 * published / max(total, 1):>12.2f}")
    print(f"on disk: {on_disk:,} bytes of safetensors; published under {recipe.name}: {published:,} bytes")
    return 0
