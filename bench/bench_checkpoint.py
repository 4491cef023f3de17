"""Hugging Face checkpoints: memory and speed of save_hf (from a generator) and load_hf / iter_hf.

Each measurement runs in its own subprocess, whose anonymous resident memory (RssAnon: heap and
tensors, not the memory-mapped file pages) the parent samples every 5 ms; ru_maxrss is printed too.
Baseline, in the same run: safetensors' `load_file` of every shard (what any loader pays to hold the
weights once). Printed: peak anonymous memory above that of the imports alone, as a multiple of the checkpoint's bytes
(target: save and streaming iteration well under 1x; load_hf about 1x, never 2x), and GB/s.

    .venv/bin/python bench/bench_checkpoint.py [--gb 0.5] [--shard-mb 128]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(kind: str, path: str, gb: float, shard_mb: int) -> None:
    import torch

    from policy import checkpoint
    from policy.model import ModelConfig, parameter_shapes

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if kind == "save":
        # Qwen3-30B-A3B widths, layers and experts cut to reach about `gb` gigabytes of bf16
        cfg = ModelConfig.preset("qwen3-30b-a3b", vocab_size=32768, n_layers=2, n_experts=8)
        per_layer = sum(
            torch.Size(s).numel() for n, s in parameter_shapes(cfg).items() if n.startswith("model.layers.0.")
        )
        n_layers = max(1, int((gb * 1e9 / 2 - 2 * 32768 * 2048) / per_layer))
        cfg = ModelConfig.preset("qwen3-30b-a3b", vocab_size=32768, n_layers=n_layers, n_experts=8)
        g = torch.Generator().manual_seed(0)
        gen = ((n, torch.randn(*s, generator=g, dtype=torch.bfloat16)) for n, s in parameter_shapes(cfg).items())
        checkpoint.save_hf(path, cfg, gen, max_shard_bytes=shard_mb << 20)
    elif kind == "iter":
        for _, t in checkpoint.iter_hf(path):
            t.sum()  # touch every byte
    elif kind == "load":
        _, tensors = checkpoint.load_hf(path)
        sum(t.sum() for t in tensors.values())
    elif kind == "imports":
        pass  # the interpreter, torch and policy.checkpoint: subtracted from every other row
    elif kind == "baseline":
        from safetensors.torch import load_file

        tensors = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(f))
        sum(t.sum() for t in tensors.values())
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"seconds": seconds, "rss_kb": peak - base}))


def _rss_anon_kb(pid: int) -> int:
    """Anonymous resident memory of a process (heap and tensors; not the mapped file pages, which
    the kernel can drop at any time and which ru_maxrss would count)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except FileNotFoundError:
        pass
    return 0


def run(kind: str, path: str, gb: float, shard_mb: int) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, path, "--gb", str(gb), "--shard-mb", str(shard_mb)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    base, peak = None, 0
    while proc.poll() is None:
        kb = _rss_anon_kb(proc.pid)
        base = kb if base is None else min(base, kb)
        peak = max(peak, kb)
        time.sleep(0.005)
    out = proc.stdout.read()
    if proc.returncode:
        raise SystemExit(f"{kind} failed")
    r = json.loads(out.strip().splitlines()[-1])
    r["anon_kb"] = peak - (base or 0)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=0.5, help="checkpoint size in GB (bf16)")
    ap.add_argument("--shard-mb", type=int, default=128)
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child[0], args.child[1], args.gb, args.shard_mb)
    with tempfile.TemporaryDirectory() as d:
        path = str(Path(d) / "ckpt")
        results = {"save": run("save", path, args.gb, args.shard_mb)}
        nbytes = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
        for kind in ("baseline", "iter", "load"):
            results[kind] = run(kind, path, args.gb, args.shard_mb)
        imports = run("imports", path, args.gb, args.shard_mb)
    for r in results.values():
        r["anon_kb"] = max(0, r["anon_kb"] - imports["anon_kb"])
    print(f"checkpoint: {nbytes / 1e9:.2f} GB bf16 in shards of {args.shard_mb} MiB")
    print(f"{'step':<34}{'peak anon / ckpt':>17}{'peak RSS / ckpt':>16}{'GB/s':>8}")
    labels = {
        "save": "save_hf from a generator",
        "baseline": "baseline: safetensors load_file",
        "iter": "iter_hf (streaming)",
        "load": "load_hf (returns every tensor)",
    }
    for kind, r in results.items():
        anon, rss = r["anon_kb"] * 1024 / nbytes, r["rss_kb"] * 1024 / nbytes
        print(f"{labels[kind]:<34}{anon:>17.2f}{rss:>16.2f}{nbytes / 1e9 / r['seconds']:>8.2f}")
    ratio = results["load"]["rss_kb"] / max(results["baseline"]["rss_kb"], 1)
    print(f"load_hf peak RSS / baseline's: {ratio:.2f} (the fused gate_up copies; the rest maps the files)")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
