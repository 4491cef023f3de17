"""Decode attention and sampling: the packed engine's Triton kernels against FlashInfer's (CUDA only).

Attention: B rows, each at the same context length L, Qwen3-30B-A3B's heads (32 query, 4 KV, head
dim 128), the engine's cache [B, Hkv, S, hd] read by FlashInfer as HND pages of S slots (one page a
row, no copy), or with --page-size P a copy of it in pages of P slots, FlashInfer's usual layout
(the copy is not timed). The engine's kernel also writes the new token's k and v into the cache;
FlashInfer's timed call does the same write first (two index_put), so both do the same work.
FlashInfer plans on the host for the lengths of each step (its split of the KV depends on them),
outside the timed region; its plan time is printed beside. The engine's kernel reads the lengths from device memory.

Sampling: B x V fp32 logits at T = 1; the engine's `sampling_triton.sample` (each row's own seed and
step: the sampler the contract defines) against `flashinfer.sampling.sampling_from_logits` (one seed
for the whole batch, so it cannot reproduce a row's token from that row's seed: compared for speed).

Times are `bench_kernels.bench` (CUDA graphs, L2 cleared before every run), same process.

    PYTHONPATH=. python bench/bench_attention.py [--sampling] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

sys.path.insert(0, ".")
from bench.bench_kernels import bench  # noqa: E402
from rollout.kernels import attention_triton, sampling_triton  # noqa: E402

H, HKV, HD = 32, 4, 128


def paged(cache: torch.Tensor, page: int) -> torch.Tensor:
    """[B, Hkv, S, hd] -> FlashInfer's HND pages [B * S / page, Hkv, page, hd]; row b's pages are b * S / page + j."""
    b, h, s, d = cache.shape
    return cache.view(b, h, s // page, page, d).transpose(1, 2).reshape(b * s // page, h, page, d).contiguous()


def attention(fi, batch: int, lengths, slots: int, page: int, out: dict) -> None:
    dev = "cuda"
    kc = torch.randn(batch, HKV, slots, HD, device=dev, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(batch, H, HD, device=dev, dtype=torch.bfloat16)
    kn = torch.randn(batch, HKV, HD, device=dev, dtype=torch.bfloat16)
    vn = torch.randn_like(kn)
    scale = HD**-0.5
    rows = torch.arange(batch, device=dev)
    work = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=dev)
    page = page or slots
    kp, vp = (kc, vc) if page == slots else (paged(kc, page), paged(vc, page))
    per_row = slots // page
    print(f"decode attention, batch {batch}, {H}/{HKV} heads x {HD}, cache slots {slots}, page {page}", flush=True)
    print(
        f"{'L':>6s} {'engine us':>10s} | {'flashinfer us':>14s} {'x':>6s} {'plan us':>8s} {'max |diff|':>10s} | tensor cores",
        flush=True,
    )
    for L in lengths:
        pos = torch.full((batch,), L - 1, dtype=torch.int64, device=dev)
        ours = attention_triton.decode_attention(q, kn, vn, kc, vc, pos, scale)
        t_ours = bench(lambda: attention_triton.decode_attention(q, kn, vn, kc, vc, pos, scale))
        row = {"batch": batch, "length": L, "engine_us": t_ours}
        for tc in (False, True):
            wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(work, "HND", use_tensor_cores=tc)
            used = -(-L // page)  # pages row b reads: b * per_row + 0 .. used - 1
            indptr = torch.arange(batch + 1, dtype=torch.int32, device=dev) * used
            indices = (rows[:, None] * per_row + torch.arange(used, device=dev)).flatten().to(torch.int32)
            last = torch.full((batch,), L - (used - 1) * page, dtype=torch.int32, device=dev)
            slot = rows * per_row + (L - 1) // page

            def theirs(wrapper=wrapper, slot=slot):
                kp[slot, :, (L - 1) % page] = kn
                vp[slot, :, (L - 1) % page] = vn
                return wrapper.run(q, (kp, vp))

            try:
                for _ in range(2):  # the first plan may compile (JIT); the second is timed
                    t0 = time.perf_counter()
                    wrapper.plan(indptr, indices, last, H, HKV, HD, page, q_data_type=torch.bfloat16,
                                 sm_scale=scale)  # fmt: skip
                    torch.cuda.synchronize()
                    t_plan = (time.perf_counter() - t0) * 1e6
                diff = float((theirs().float() - ours.float()).abs().max())
                t = bench(theirs)
            except Exception as e:  # a FlashInfer failure is reported, and the comparison goes on
                print(f"{L:6d} flashinfer (tensor cores {tc}) failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            key = "flashinfer_tc" if tc else "flashinfer"
            row.update({f"{key}_us": t, f"{key}_plan_us": t_plan, f"{key}_max_abs_diff": diff})
            print(f"{L:6d} {t_ours:10.1f} | {t:14.1f} {t_ours / t:6.3f} {t_plan:8.0f} {diff:10.2e} | {tc}", flush=True)
        out["attention"].append(row)


def sampling(fi, batch: int, vocab: int, out: dict) -> None:
    dev = "cuda"
    logits = torch.randn(batch, vocab, device=dev) * 3
    seeds = torch.arange(batch, dtype=torch.int64, device=dev)
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    temp = torch.ones(1, device=dev)
    t_ours = bench(lambda: sampling_triton.sample(logits, seeds, step, temp))
    t0 = time.perf_counter()
    fi.sampling.sampling_from_logits(logits, seed=1, offset=0)
    torch.cuda.synchronize()
    t_first = time.perf_counter() - t0
    t_fi = bench(lambda: fi.sampling.sampling_from_logits(logits, seed=1, offset=0))
    print(
        f"sampling {batch} x {vocab}: engine {t_ours:.1f} us, flashinfer {t_fi:.1f} us (x {t_ours / t_fi:.3f}); "
        f"flashinfer's first call {t_first:.1f} s (JIT)",
        flush=True,
    )
    out["sampling"] = {
        "batch": batch,
        "vocab": vocab,
        "engine_us": t_ours,
        "flashinfer_us": t_fi,
        "first_call_s": t_first,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", default="128,512,2048,4096")
    ap.add_argument("--page-size", type=int, default=0, help="FlashInfer reads a copy in pages of this many slots")
    ap.add_argument("--sampling", action="store_true", help="also sampling (FlashInfer compiles it for ~90 s)")
    ap.add_argument("--json")
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    slots = max(lengths)
    if args.page_size and slots % args.page_size:
        print(
            f"bench_attention: --page-size {args.page_size} does not divide the cache's {slots} slots", file=sys.stderr
        )
        return 2
    try:
        import flashinfer as fi
    except ImportError as e:
        print(f"bench_attention: flashinfer is not importable ({e}); nothing to compare", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}; flashinfer {fi.__version__}", flush=True)
    out: dict = {"device": torch.cuda.get_device_name(), "attention": []}
    t0 = time.time()
    attention(fi, args.batch, lengths, slots, args.page_size, out)
    print(f"attention done in {time.time() - t0:.0f} s (FlashInfer's JIT included)", flush=True)
    if args.sampling:
        sampling(fi, args.batch, 151936, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
