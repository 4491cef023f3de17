"""Publish throughput: quantize -> manifest -> servable, against a plain copy of the same bytes.

    python bench/bench_publish.py                 # ~2 GB of nvfp4 expert tensors (CPU: random codes)
    python bench/bench_publish.py --bytes 26e9    # a whole Qwen3-30B-A3B nvfp4_moe version (GPU host)
    python bench/bench_publish.py --quick         # ~128 MB

What one publish costs the trainer (issue 17's target: >= 8 GB/s, i.e. <= 4 s for 26 GB):
- `quantize`: on CUDA, bf16 expert weights quantized on the GPU by the byte-exact Triton kernels
  (policy.manifest.quantize_param). On the CPU the reference quantizer would take minutes per GB,
  so the CPU run starts from random nvfp4 codes (transport does not care about values).
- `manifest`: `build_manifest` — device-to-host copies into pinned memory, then every tensor's
  bytes copied into one immutable buffer, xxh3 per chunk and sha256, in a thread pool
  (`threads=1` in the same run is the serial baseline: what the code did before).
- `servable`: `PolicyServer.publish` — re-checks every chunk's xxh3 and frames each chunk as a
  pre-serialized gRPC message (one copy), tensors in parallel.
Baseline, same run, same bytes: `bytes(blob)` of every tensor (one plain single-threaded copy),
printed as GB/s, and each stage's time as a ratio to it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_grpc import EXPERT_SHAPES, synthetic_experts  # noqa: E402  (bench/ is the script's folder)


def expert_tensors(total_bytes: int, device: str, seed: int):
    """nvfp4 QuantizedParams of routed experts adding up to about `total_bytes` packed bytes:
    quantized from random bf16 weights on the GPU, random codes on the CPU (bench_grpc's)."""
    if device != "cuda":
        return synthetic_experts(total_bytes, seed)
    import torch

    from policy import manifest as M

    per_expert = sum(m * k // 2 + m * k // 16 + 4 for _, (m, k) in EXPERT_SHAPES)
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for e in range(max(1, round(total_bytes / per_expert))):
        layer, expert = divmod(e, 128)
        for proj, (m, k) in EXPERT_SHAPES:
            w = torch.randn(m, k, generator=g, device=device, dtype=torch.bfloat16)
            out[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"] = M.quantize_param(
                w, "nvfp4", scope="tensor"
            )
    torch.cuda.synchronize()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=float, default=2e9, help="packed policy size in bytes (default 2e9)")
    parser.add_argument("--quick", action="store_true", help="~128 MB instead")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="build_manifest threads (0: one per core, <= 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    total = int(128e6 if args.quick else args.bytes)

    import torch

    from broker.policy_server import PolicyServer, PolicyServerConfig
    from policy import manifest as M

    contract = M.Contract(
        model_config={"preset": "qwen3-30b-a3b", "bench": "publish"},
        recipe_name="nvfp4_moe",
        recipe_rules={"rules": "experts -> nvfp4"},
    )
    print(f"device {args.device}, {os.cpu_count()} CPU cores, torch {torch.__version__}", flush=True)

    def timed(fn):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        return result, time.perf_counter() - t0

    tensors, quant_s = timed(lambda: expert_tensors(total, args.device, args.seed))
    if args.device == "cuda":  # quantize again, timed alone (the first call compiles the kernels)
        tensors, quant_s = timed(lambda: expert_tensors(total, args.device, args.seed))

    def build(threads):
        return M.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors, threads=threads)

    serial, serial_s = timed(lambda: build(1))
    packed, build_s = timed(lambda: build(args.threads or None))
    assert [t.sha256 for t in serial.manifest.tensors] == [t.sha256 for t in packed.manifest.tensors]
    del serial
    gb = packed.manifest.total_bytes / 1e9

    blobs = list(packed.blobs.values())
    _, copy_s = timed(lambda: [bytes(b) for b in blobs])
    server = PolicyServer(PolicyServerConfig())
    server.start()
    try:
        _, serve_s = timed(lambda: server.publish(packed))
    finally:
        server.stop()

    def line(what, s):
        print(f"{what:<34} {s:8.3f} s  {gb / s:7.2f} GB/s  {s / copy_s:6.2f}x copy", flush=True)

    print(f"{len(packed.manifest.tensors)} tensors, {gb:.3f} GB packed")
    line("baseline: bytes(blob) copy", copy_s)
    line(f"quantize ({args.device})", quant_s)
    line("build_manifest, serial (threads=1)", serial_s)
    line(f"build_manifest, {args.threads or 'default'} threads", build_s)
    line("PolicyServer.publish", serve_s)
    line("manifest + servable", build_s + serve_s)
    line("quantize + manifest + servable", quant_s + build_s + serve_s)
    print(f"speedup of build_manifest over serial: {serial_s / build_s:.2f}x")
    return 0


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
