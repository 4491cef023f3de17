"""Publish throughput: quantize -> manifest -> servable, the pooled framed path vs last session's path.

    python bench/bench_publish.py                  # GPU: the Qwen3-30B-A3B-width 6-layer model under nvfp4_moe
    python bench/bench_publish.py --layers 2       # GPU, smaller
    python bench/bench_publish.py                  # CPU: ~1 GB of nvfp4 expert tensors (random codes)
    python bench/bench_publish.py --quick          # CPU: ~128 MB

What one publish costs (issue 17's target: >= 8 GB/s, i.e. <= 4 s for a 26 GB version):
- `quantize`: on CUDA, every weight of the model quantized on the GPU by the byte-exact Triton
  kernels (what the QAT cache computes once per optimizer step; `hook.quantized_params`). On the
  CPU the reference quantizer would take minutes per GB, so the CPU run takes random nvfp4 codes.
- last session's path, same run, same tensors: `build_manifest` (pinned D2H into fresh pinned
  memory, then every tensor copied into a new buffer and hashed, in a thread pool), then the
  server's framing as it was (every chunk joined into a new `bytes`, GIL held; re-created here
  from its code) — and `PolicyServer.publish(PackedPolicy)` as it is now (one threaded copy).
- the new path: `broker.frames.stage` + `run` (D2H straight into a pooled, page-locked buffer laid
  out as the gRPC messages, xxh3 + sha256 in place in a thread pool) + `PolicyServer.publish`
  (no copy). Versions 1..2 allocate the server's two buffers (keep_versions=1: one served, one
  being filled); later versions reuse them, which is the steady state of a trainer.
Host ceilings, same run: device-to-host copy into the page-locked buffer, a single-threaded host
copy into touched and into fresh memory, sha256 and xxh3 on one core. The new path's manifest is
checked equal to build_manifest's (same checksums) and a worker fetches part of it, verified.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_grpc import synthetic_experts  # noqa: E402  (bench/ is the script's folder)


def old_framing(packed, threads: int) -> list:
    """Last session's PolicyServer framing (its `_chunk_messages`): each chunk's pre-serialized head
    joined with its bytes into a new `bytes` (one copy, GIL held), tensors in a thread pool."""
    import xxhash

    from policy import manifest as M
    from tandem.v1 import policy_pb2

    m = packed.manifest
    first = M.first_chunk_indices(m)

    def frame(t):
        mv, out, cb = memoryview(packed.blobs[t.name]), [], m.chunk_bytes
        n = M.chunk_count(len(mv), cb)
        for j in range(n):
            piece = mv[j * cb : (j + 1) * cb]
            digest = xxhash.xxh3_64_intdigest(piece)
            assert digest == t.chunk_xxh3[j]
            head = policy_pb2.TensorChunk(
                version=m.version,
                chunk_index=first[t.name] + j,
                tensor_name=t.name,
                tensor_nbytes=len(mv),
                offset=j * cb,
                xxh3=digest,
                tensor_sha256=t.sha256 if j == n - 1 else b"",
            ).SerializeToString(deterministic=True)
            out.append(b"".join((head, b"\x7a", _varint(len(piece)), piece)))
        return out

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(frame, m.tensors))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | 0x80 if n else b)
        if not n:
            return bytes(out)


def host_ceilings(cuda: bool) -> dict[str, float]:
    """GB/s of the host's own limits (one core unless said)."""
    import numpy as np
    import torch
    import xxhash

    from broker.frames import HostBuffer

    n = 1 << 30
    out = {}
    src = np.resize(np.arange(251, dtype=np.uint8), n)  # not zeros; the values do not matter here
    dst = np.empty(n, dtype=np.uint8)
    dst.fill(1)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    out["host copy into touched memory, 1 core"] = n / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    fresh = np.empty(n, dtype=np.uint8)
    np.copyto(fresh, src)
    out["host copy into fresh memory, 1 core"] = n / (time.perf_counter() - t0) / 1e9
    del fresh
    part = memoryview(src)[: 256 << 20]
    t0 = time.perf_counter()
    hashlib.sha256(part).digest()
    out["sha256, 1 core"] = len(part) / (time.perf_counter() - t0) / 1e9
    t0 = time.perf_counter()
    for i in range(0, len(part), 1 << 20):
        xxhash.xxh3_64_intdigest(part[i : i + (1 << 20)])
    out["xxh3 per 1 MiB, 1 core"] = len(part) / (time.perf_counter() - t0) / 1e9
    threads = min(32, os.cpu_count() or 1)
    pieces = [memoryview(src)[i : i + (n // threads)] for i in range(0, n, n // threads)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda p: hashlib.sha256(p).digest(), pieces))
        out[f"sha256, {threads} threads"] = n / (time.perf_counter() - t0) / 1e9
    if cuda:
        dev = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        buf = HostBuffer(n, pin=True)
        host = torch.from_numpy(buf.array)
        for label in ("cold", "warm"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            out[f"D2H into the page-locked buffer ({label})"] = n / (time.perf_counter() - t0) / 1e9
        chunks = [(i, i + (1 << 20)) for i in range(0, n, 1 << 20)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a, b in chunks:
            host[a:b].copy_(dev[a:b], non_blocking=True)
        torch.cuda.synchronize()
        out["D2H in 1 MiB copies (the framed path's pattern)"] = n / (time.perf_counter() - t0) / 1e9
        buf.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--recipe", default="nvfp4_moe")
    parser.add_argument("--bytes", type=float, default=1e9, help="CPU: packed size of the synthetic experts")
    parser.add_argument("--quick", action="store_true", help="CPU: ~128 MB")
    parser.add_argument("--versions", type=int, default=4, help="new-path versions published (>= 3)")
    parser.add_argument("--threads", type=int, default=0, help="hashing threads (0: one per core, <= 32)")
    args = parser.parse_args(argv)

    import torch

    from broker import frames
    from broker.policy_client import PolicyClient, PolicyClientConfig
    from broker.policy_server import PolicyServer, PolicyServerConfig
    from policy import manifest as M

    cuda = args.device == "cuda"
    threads = args.threads or None
    print(f"device {args.device}, {os.cpu_count()} CPU cores, torch {torch.__version__}", flush=True)

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        result = fn()
        sync()
        return result, time.perf_counter() - t0

    if cuda:
        from policy import qat
        from policy.model import ModelConfig, Transformer
        from policy.recipe import Recipe

        cfg = ModelConfig.preset(args.preset, n_layers=args.layers)
        recipe = Recipe.load(args.recipe)
        with torch.device("cuda"):
            model = Transformer(cfg, seed=0)
        hook = qat.apply_qat(model, recipe)
        contract = M.contract_from_recipe(model_config=cfg, recipe=recipe)
        n_params = sum(p.numel() for p in model.parameters())
        what = f"{args.preset} widths x {args.layers} layers ({n_params / 1e9:.2f}B parameters), {args.recipe}"

        def quantize():
            hook.invalidate()
            return hook.quantized_params(model)

        tensors, _ = timed(quantize)  # compiles the kernels
        tensors, quant_s = timed(quantize)
    else:
        total = int(128e6 if args.quick else args.bytes)
        contract = M.Contract(
            model_config={"preset": "qwen3-30b-a3b", "bench": "publish"},
            recipe_name="nvfp4_moe",
            recipe_rules={"rules": "experts -> nvfp4"},
        )
        tensors, quant_s, what = synthetic_experts(total, 0), 0.0, "synthetic nvfp4 experts (random codes)"

    # Last session's path.
    workers = threads or min(32, os.cpu_count() or 1)

    def old_path():
        packed, build_s = timed(
            lambda: M.build_manifest(
                version=1, parent_version=None, contract=contract, tensors=tensors, threads=threads
            )
        )
        _, old_frame_s = timed(lambda: len(old_framing(packed, workers)))
        with PolicyServer(PolicyServerConfig(keep_versions=1)) as server:
            _, packed_publish_s = timed(lambda: server.publish(packed))
        ref = [(t.name, list(t.chunk_xxh3), t.sha256) for t in packed.manifest.tensors]
        return packed.manifest.total_bytes / 1e9, ref, build_s, old_frame_s, packed_publish_s

    gb, ref, build_s, old_frame_s, packed_publish_s = old_path()

    # The new path: versions framed into the server's pooled buffers.
    pool = frames.BufferPool(pin=cuda)
    rows = []
    with PolicyServer(PolicyServerConfig(keep_versions=1)) as server:
        for v in range(1, max(3, args.versions) + 1):
            sync()
            t0 = time.perf_counter()
            staged = frames.stage(
                version=v, parent_version=v - 1 if v > 1 else None, contract=contract, tensors=tensors, pool=pool,
                threads=threads,
            )  # fmt: skip
            t1 = time.perf_counter()
            framed = staged.run()
            t2 = time.perf_counter()
            server.publish(framed)
            t3 = time.perf_counter()
            rows.append((v, pool.allocated, t1 - t0, t2 - t1, t3 - t2, t3 - t0))
            got = [(t.name, list(t.chunk_xxh3), t.sha256) for t in framed.manifest.tensors]
            assert got == ref, "the framed path's checksums differ from build_manifest's"
            del framed, staged
        # A worker fetches the largest tensors and a few others, verified (xxh3 + sha256).
        entries = sorted(server._lookup(None).manifest.tensors, key=lambda t: -t.nbytes)
        names = [t.name for t in entries[:4] + entries[-4:]]
        contract_fp = contract.fingerprint()
        with PolicyClient(PolicyClientConfig(address=server.address, expected_fingerprint=contract_fp)) as c:
            (fetched, _, _), fetch_s = timed(lambda: c.fetch_bytes(c.get_manifest(v), names=names))
        fetched_gb = sum(len(b) for b in fetched.values()) / 1e9
    pool.close()

    ceilings = host_ceilings(cuda)

    def line(label, s, base=None):
        extra = f"  {base / s:6.2f}x old" if base else ""
        print(f"{label:<58} {s:8.3f} s  {gb / s:7.2f} GB/s{extra}", flush=True)

    print(f"{what}: {len(ref)} tensors, {gb:.3f} GB packed, {workers} hashing threads")
    old_total = quant_s + build_s + old_frame_s
    if quant_s:
        line("quantize on the GPU (QAT cache refill, every weight)", quant_s)
    line("old: build_manifest (pinned D2H, copy + hash per tensor)", build_s)
    line("old: server framing (a new bytes per chunk, GIL held)", old_frame_s)
    line("old: quantize + manifest + servable", old_total)
    line("now: PolicyServer.publish(PackedPolicy) (threaded copy)", packed_publish_s)
    for v, allocated, stage_s, run_s, publish_s, total_s in rows:
        print(
            f"new v{v} (buffers allocated {allocated}): stage {stage_s:.3f} s, frame+D2H+hash {run_s:.3f} s, "
            f"install {publish_s:.3f} s = {total_s:.3f} s ({gb / total_s:.2f} GB/s)",
            flush=True,
        )
    steady = statistics.median(r[5] for r in rows[2:])
    line("new: manifest + servable, steady (buffers reused, median)", steady, build_s + old_frame_s)
    line("new: quantize + manifest + servable, steady", quant_s + steady, old_total)
    target = "met" if gb / (quant_s + steady) >= 8 else "missed"
    print(f"target >= 8 GB/s quantize -> manifest -> servable: {target} ({gb / (quant_s + steady):.2f} GB/s)")
    print(f"worker fetch of {len(names)} tensors ({fetched_gb:.3f} GB), verified: {fetch_s:.3f} s")
    for label, rate in ceilings.items():
        print(f"ceiling: {label:<52} {rate:7.2f} GB/s", flush=True)
    return 0


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
