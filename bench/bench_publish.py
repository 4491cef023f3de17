"""Publish throughput: quantize -> manifest -> servable, against the host's own ceilings, one run.

    python3 bench/bench_publish.py                 # CUDA: Qwen3-30B-A3B widths x 6 layers, nvfp4_moe (<= 90 s on an H200)
    python3 bench/bench_publish.py --bytes 1e9     # CPU: the same model's tensors, scaled to ~1 GB (~1 min, 2 cores)
    python3 bench/bench_publish.py --source qat --preset tiny --layers 2   # CPU: the CUDA run's code path, small

Target: >= 8 GB/s quantize -> manifest -> servable, i.e. <= 4 s for a 26 GB
Qwen3-30B-A3B nvfp4_moe version. What one publish of version v costs, each timed per version:
- `quantize`: on CUDA, the QAT cache refill (`hook.invalidate()` then `hook.quantized_params(model)`:
  every weight's quantized parts, what the trainer's QAT step computes anyway and the publish reuses).
  On the CPU the reference quantizer takes minutes per GB, so the CPU run takes the model's tensors
  (same names, formats and count; vocabulary and expert width scaled to `--bytes`) with random bytes,
  and has no quantize stage.
- `stage` (broker.frames.stage: describe the tensors, on the training thread), `frame` (StagedPublish.run:
  the layout, D2H straight into a pooled page-locked buffer laid out as the gRPC messages, xxh3 and
  sha256 of every chunk in a thread pool, the manifest; its own split is printed), `install`
  (PolicyServer.publish: verify the manifest, index the messages). Versions 1-2 allocate the server's
  two buffers (keep_versions=1); later ones reuse them, the trainer's steady state (median of v >= 3).
Baselines, same run: D2H into a page-locked buffer; a host copy on one core; sha256 on one core over
one stream (schema 1's per-tensor hash) vs over 1 MiB chunks in the pool (schema 2's); xxh3 on one core.
Checked, same run: the framed manifest equals build_manifest's (checksums included), and a worker
fetches and verifies the largest and smallest tensors. Sections that fail print FAILED and the rest
still runs (exit status 1); optional ones are skipped past `--budget-s`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MiB = 1 << 20
START = [time.perf_counter()]  # main() resets it
FAILED: list[str] = []


def elapsed() -> float:
    return time.perf_counter() - START[0]


def section(name: str, fn, *args):
    """Run one part of the bench; a failure is printed (one line + traceback) and counted, not fatal."""
    try:
        return fn(*args)
    except Exception as e:  # a bench that runs once must report what it can
        FAILED.append(name)
        print(f"FAILED {name}: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(limit=4)
        return None


# -- the tensors ---------------------------------------------------------------------------------------


def model_bytes(cfg, plan) -> int:
    """Packed bytes of a model's published tensors under a plan (nvfp4 or bf16), nothing allocated."""
    from policy.model import parameter_shapes

    total = 0
    for name, shape in parameter_shapes(cfg).items():
        m, k = shape if len(shape) == 2 else (1, shape[0])
        fmt = plan[name].format
        if fmt == "nvfp4":
            total += m * k // 2 + m * k // 16 + 4
        elif fmt == "bf16":
            total += 2 * m * k
        else:
            raise ValueError(f"{name}: format {fmt} (the CPU variant knows nvfp4 and bf16 only)")
    return total


def scaled_config(cfg, recipe, total_bytes: float):
    """`cfg` with vocabulary and expert width scaled so its packed bytes are about `total_bytes`
    (attention and the tensor count unchanged)."""
    import dataclasses

    full = model_bytes(cfg, recipe.plan(cfg))
    fixed = model_bytes(dataclasses.replace(cfg, vocab_size=64, expert_ffn_dim=16), recipe.plan(cfg))
    s = min(1.0, max(0.0, (total_bytes - fixed) / max(1, full - fixed)))
    return dataclasses.replace(
        cfg,
        vocab_size=max(64, round(cfg.vocab_size * s / 64) * 64),
        expert_ffn_dim=max(16, round(cfg.expert_ffn_dim * s / 16) * 16),
    )


def synthetic_tensors(cfg, plan, seed: int = 0) -> dict:
    """QuantizedParams of every parameter as the plan says (nvfp4 or bf16), parts random bytes: views
    into one random buffer (generating the bytes is not what is measured), masked to values a worker
    accepts (finite bf16: exponent's top bit cleared; E4M3 block scales non-negative, never NaN)."""
    import numpy as np
    import torch

    from policy import formats
    from policy.formats.params import QuantizedParam
    from policy.model import parameter_shapes

    rng = np.random.default_rng(seed)
    pool = torch.from_numpy(np.frombuffer(rng.bytes(model_bytes(cfg, plan)), dtype=np.uint8).copy())
    at = 0

    def take(n: int, dtype, shape):
        nonlocal at
        t = pool[at : at + n].view(dtype).reshape(shape)
        at += n
        return t

    out = {}
    for name, shape in parameter_shapes(cfg).items():
        m, k = shape if len(shape) == 2 else (1, shape[0])
        e = plan[name]
        if e.format == "nvfp4":
            parts = {
                "codes": take(m * k // 2, torch.uint8, (m, k // 2)),
                "block_scales": take(m * k // 16, torch.uint8, (m, k // 16))
                .bitwise_and_(0x7E)
                .view(torch.float8_e4m3fn),
                "global_scale": torch.ones(1),
            }
            at += 4
            q = formats.nvfp4.from_parts(parts, (m, k), scope=e.kwargs.get("scope", "tensor"))
        else:
            values = take(2 * m * k, torch.int16, (m, k)).bitwise_and_(~0x4000).view(torch.bfloat16)
            q = formats.bf16.from_parts({"values": values}, (m, k))
        out[name] = QuantizedParam(e.format, dict(e.kwargs), q)
    return out


# -- baselines -------------------------------------------------------------------------------------------


def baselines(cuda: bool, threads: int, nbytes: int) -> dict[str, float]:
    """GB/s of the host's own limits over `nbytes` (one core unless said)."""
    import numpy as np
    import torch
    import xxhash

    from broker.frames import HostBuffer

    out = {}
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    dst.fill(1)
    t0 = time.perf_counter()
    np.copyto(dst, src)
    out["host copy into touched memory, 1 core"] = nbytes / (time.perf_counter() - t0) / 1e9
    mv = memoryview(src)
    t0 = time.perf_counter()
    hashlib.sha256(mv).digest()
    out["sha256, 1 core, one stream (schema 1: per tensor)"] = nbytes / (time.perf_counter() - t0) / 1e9
    chunks = [mv[i : i + MiB] for i in range(0, nbytes, MiB)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(lambda c: hashlib.sha256(c).digest(), chunks))
        out[f"sha256, {threads} threads, 1 MiB chunks (schema 2)"] = nbytes / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        list(pool.map(lambda c: (xxhash.xxh3_64_intdigest(c), hashlib.sha256(c).digest()), chunks))
        out[f"xxh3 + sha256, {threads} threads, 1 MiB chunks (the publish's hashing)"] = (
            nbytes / (time.perf_counter() - t0) / 1e9
        )
    t0 = time.perf_counter()
    for c in chunks:
        xxhash.xxh3_64_intdigest(c)
    out["xxh3, 1 core, 1 MiB chunks"] = nbytes / (time.perf_counter() - t0) / 1e9
    if cuda:
        dev = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        buf = HostBuffer(nbytes, pin=True)
        host = torch.from_numpy(buf.array)
        for label in ("cold", "warm"):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            host.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()
            out[f"D2H into a page-locked buffer ({label})"] = nbytes / (time.perf_counter() - t0) / 1e9
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for a in range(0, nbytes, MiB):
            host[a : a + MiB].copy_(dev[a : a + MiB], non_blocking=True)
        torch.cuda.synchronize()
        out["D2H in 1 MiB copies (the framed path's pattern)"] = nbytes / (time.perf_counter() - t0) / 1e9
        del host
        buf.close()
    return out


# -- the bench ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--recipe", default="nvfp4_moe")
    parser.add_argument("--bytes", type=float, default=1e9, help="synthetic: packed size the model is scaled to")
    parser.add_argument(
        "--source",
        choices=("auto", "qat", "synthetic"),
        default="auto",
        help="qat: the model's QAT cache refill (auto on CUDA); synthetic: random bytes in its shapes (auto on CPU)",
    )
    parser.add_argument("--versions", type=int, default=5, help="versions published (>= 3; v >= 3 are steady)")
    parser.add_argument("--threads", type=int, default=0, help="hashing threads (0: one per core, <= 32)")
    parser.add_argument("--budget-s", type=float, default=70.0, help="skip the optional checks past this")
    args = parser.parse_args(argv)
    START[0] = time.perf_counter()
    FAILED.clear()
    if args.versions < 3:
        parser.error("--versions must be >= 3")

    import torch

    from broker import frames
    from broker.policy_client import PolicyClient, PolicyClientConfig
    from broker.policy_server import PolicyServer, PolicyServerConfig
    from policy import manifest as M
    from policy.contract import contract_from_recipe
    from policy.model import ModelConfig
    from policy.recipe import Recipe

    cuda = args.device == "cuda"
    threads = args.threads or min(32, os.cpu_count() or 1)
    print(f"device {args.device}, {os.cpu_count()} CPU cores, {threads} hashing threads, torch {torch.__version__}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    cfg = ModelConfig.preset(args.preset, n_layers=args.layers)
    recipe = Recipe.load(args.recipe)

    qat_source = args.source == "qat" or (args.source == "auto" and cuda)

    def setup():
        """(config, quantize(), description): the model's QAT refill, or random bytes in its tensors' shapes."""
        if qat_source:
            from policy import qat
            from policy.model import Transformer

            with torch.device(args.device):
                model = Transformer(cfg, seed=0)
            hook = qat.apply_qat(model, recipe)
            n_params = sum(p.numel() for p in model.parameters())
            what = f"{args.preset} widths x {args.layers} layers ({n_params / 1e9:.2f}B parameters), {args.recipe}"

            def quantize():
                hook.invalidate()
                return hook.quantized_params(model)

            t0 = time.perf_counter()
            quantize()  # compiles the kernels
            sync()
            print(f"first quantize (compiles the Triton kernels on CUDA): {time.perf_counter() - t0:.1f} s", flush=True)
            return cfg, quantize, what
        small = scaled_config(cfg, recipe, args.bytes)
        synthetic = synthetic_tensors(small, recipe.plan(small))
        what = (
            f"{args.preset} widths x {args.layers} layers scaled to vocab {small.vocab_size}, expert width "
            f"{small.expert_ffn_dim}, {args.recipe}, random bytes"
        )
        return small, lambda: synthetic, what

    cfg, quantize, what = section("model", setup) or (cfg, None, "")
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)

    # The publish, version after version, as the trainer does it.
    pool = frames.BufferPool(pin=cuda)
    with PolicyServer(PolicyServerConfig(keep_versions=1)) as server:

        def publish_versions():
            rows, last = [], None
            for v in range(1, args.versions + 1):
                sync()
                t0 = time.perf_counter()
                tensors = quantize()
                sync()
                t1 = time.perf_counter()
                staged = frames.stage(
                    version=v, parent_version=v - 1 if v > 1 else None, contract=contract, tensors=tensors,
                    pool=pool, threads=threads,
                )  # fmt: skip
                t2 = time.perf_counter()
                framed = staged.run()
                t3 = time.perf_counter()
                server.publish(framed)
                t4 = time.perf_counter()
                rows.append((v, pool.allocated, t1 - t0, t2 - t1, t3 - t2, t4 - t3, dict(framed.seconds)))
                last = framed.manifest
                del framed, staged, tensors
            return rows, last

        rows, last = (section("publish", publish_versions) if quantize else None) or ([], None)
        if last is not None:
            report(rows, last, what, qat_source, args.versions)

            def reference():
                """build_manifest over the same tensors: its checksums must equal the framed path's."""
                ref, s = timed(sync, lambda: M.build_manifest(
                    version=last.version, parent_version=last.version - 1, contract=contract, tensors=quantize(),
                    threads=threads, created_unix_ns=last.created_unix_ns,
                ))  # fmt: skip
                same = [(t.name, list(t.chunk_xxh3), t.sha256) for t in ref.manifest.tensors] == [
                    (t.name, list(t.chunk_xxh3), t.sha256) for t in last.tensors
                ]
                gb = last.total_bytes / 1e9
                print(
                    f"{'build_manifest (fresh pinned and host memory, same pool)':<66} {s:8.3f} s  {gb / s:7.2f} GB/s"
                )
                print(f"framed manifest's checksums equal build_manifest's: {same}", flush=True)
                if not same:
                    raise AssertionError("the framed path's checksums differ from build_manifest's")

            def fetch():
                """A worker fetches the 4 largest and 4 smallest tensors, every chunk and tensor verified."""
                entries = sorted(last.tensors, key=lambda t: -t.nbytes)
                names = [t.name for t in entries[:4] + entries[-4:]]
                cfg = PolicyClientConfig(address=server.address, expected_fingerprint=contract.fingerprint())
                with PolicyClient(cfg) as c:
                    (got, _, _), s = timed(sync, lambda: c.fetch_bytes(c.get_manifest(last.version), names=names))
                n = sum(len(b) for b in got.values())
                print(
                    f"worker fetch of {len(names)} tensors ({n / 1e9:.3f} GB), verified: {s:.3f} s ({n / s / 1e9:.2f} GB/s)"
                )

            for name, fn in (("build_manifest reference", reference), ("worker fetch", fetch)):
                if elapsed() > args.budget_s:
                    print(f"skipped {name}: {elapsed():.0f} s elapsed, past --budget-s {args.budget_s:.0f}")
                else:
                    section(name, fn)
    pool.close()

    nbytes = 512 * MiB if cuda or args.bytes >= 512 * MiB else 128 * MiB
    ceilings = section("baselines", baselines, cuda, threads, nbytes) or {}
    for label, rate in ceilings.items():
        print(f"baseline: {label:<66} {rate:7.2f} GB/s", flush=True)
    pooled = next((r for k, r in ceilings.items() if k.startswith("xxh3 + sha256")), None)
    if pooled and last is not None:
        gb = last.total_bytes / 1e9
        print(
            f"hashing the version at the pooled rate alone: {gb / pooled:.3f} s ({pooled:.2f} GB/s is the publish's ceiling)"
        )
    print(f"done in {elapsed():.1f} s" + (f"; FAILED: {', '.join(FAILED)}" if FAILED else ""), flush=True)
    return 1 if FAILED else 0


def report(rows, last, what: str, quantized: bool, versions: int) -> None:
    gb = last.total_bytes / 1e9
    chunks = sum(len(t.chunk_xxh3) for t in last.tensors)
    print(f"{what}: {len(last.tensors)} tensors, {gb:.3f} GB packed, {chunks} chunks")
    for v, allocated, q, st, fr, ins, split in rows:
        parts = ", ".join(f"{k} {s:.3f}" for k, s in split.items())
        print(
            f"v{v} (buffers allocated {allocated}): quantize {q:.3f} + stage {st:.3f} + frame {fr:.3f} "
            f"({parts}) + install {ins:.3f} = {q + st + fr + ins:.3f} s",
            flush=True,
        )
    steady = rows[2:]

    def med(f):
        return statistics.median(f(r) for r in steady)

    def line(label, s):
        rate = f"{gb / s:7.2f} GB/s" if s > 0 else "        n/a"
        print(f"{label:<66} {s:8.3f} s  {rate}", flush=True)

    print(f"steady state: median of v3..v{versions}")
    if quantized:
        line("quantize (the QAT cache refill, every weight)", med(lambda r: r[2]))
    else:
        print("quantize: n/a (synthetic: random bytes stand in for the quantized parts)")
    line("  stage (describe the tensors: the training thread)", med(lambda r: r[3]))
    line("  frame (layout, D2H, xxh3 + sha256 of every chunk, the manifest)", med(lambda r: r[4]))
    for k in steady[0][6]:
        line(f"    of it {k}", med(lambda r, k=k: r[6][k]))
    line("  install (PolicyServer.publish)", med(lambda r: r[5]))
    line("manifest + servable (stage + frame + install)", med(lambda r: r[3] + r[4] + r[5]))
    total = med(lambda r: r[2] + r[3] + r[4] + r[5])
    line("quantize -> manifest -> servable", total)
    verdict = "met" if gb / total >= 8 else "missed"
    print(f"target >= 8 GB/s quantize -> manifest -> servable: {verdict} ({gb / total:.2f} GB/s)", flush=True)
    if not quantized:
        print("(a synthetic run has no quantize stage; the target is the CUDA run's)")


def timed(sync, fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
