"""Publish -> fetch throughput of the gRPC policy transport over loopback, vs an in-memory copy.

    python bench/bench_grpc.py              # ~1 GB of packed nvfp4 expert tensors
    python bench/bench_grpc.py --quick      # ~64 MB

The policy is Qwen3-30B-A3B-shaped routed experts in nvfp4 (gate_up [1536, 2048] and down
[2048, 768] per expert, 2.65 MB packed per expert), with random codes: transport does not care
about values, and quantizing 1 GB with the CPU reference quantizer would take minutes.

A child process plays the trainer: it builds the policy, times `build_manifest` (one copy of
the bytes, sha256 + xxh3) and `PolicyServer.publish` (pre-serializing every chunk), then serves.
This process plays a rollout worker: it times `PolicyClient.fetch_bytes` (every chunk's xxh3
and every tensor's sha256 checked against the manifest, bytes copied into fresh buffers); the
first fetch is reported apart (it pays the page faults of never-touched memory), the ratio uses
the median of the following ones.
Baseline, same run, same bytes: a plain in-memory copy of every tensor into fresh buffers
(`bytearray(blob)`), and into already-touched buffers. The ratios printed are fetch / copy.
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

EXPERT_SHAPES = (("gate_up_proj", (1536, 2048)), ("down_proj", (2048, 768)))


def synthetic_experts(total_bytes: int, seed: int) -> dict:
    """nvfp4 QuantizedParams of routed experts with random codes, about `total_bytes` packed bytes."""
    import numpy as np
    import torch

    from policy import formats
    from policy.formats.params import QuantizedParam

    rng = np.random.default_rng(seed)
    per_expert = sum(m * k // 2 + m * k // 16 + 4 for _, (m, k) in EXPERT_SHAPES)
    n_experts = max(1, round(total_bytes / per_expert))
    tensors = {}
    for e in range(n_experts):
        layer, expert = divmod(e, 128)
        for proj, (m, k) in EXPERT_SHAPES:
            codes = torch.from_numpy(rng.integers(0, 256, size=(m, k // 2), dtype=np.uint8))
            scales = torch.full((m, k // 16), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.0
            q = formats.nvfp4.from_parts(
                {"codes": codes, "block_scales": scales, "global_scale": torch.ones(1)}, (m, k), scope="tensor"
            )
            tensors[f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"] = QuantizedParam(
                "nvfp4", {"scope": "tensor"}, q
            )
    return tensors


def synthetic_policy(total_bytes: int, seed: int, version: int = 1):
    """A PackedPolicy of nvfp4 expert tensors adding up to about `total_bytes` packed bytes."""
    from policy import manifest as M
    from policy.contract import Contract

    tensors = synthetic_experts(total_bytes, seed)
    contract = Contract(
        model_config={"preset": "qwen3-30b-a3b", "n_experts_benched": len(tensors) // len(EXPERT_SHAPES)},
        recipe_name="nvfp4_moe",
        recipe_rules={"rules": "experts -> nvfp4"},
    )
    t0 = time.perf_counter()
    packed = M.build_manifest(version=version, parent_version=None, contract=contract, tensors=tensors)
    return packed, time.perf_counter() - t0


def _serve(total_bytes: int, seed: int, out: mp.Queue, stop: mp.Event, max_s: float) -> None:
    from broker.policy_server import PolicyServer, PolicyServerConfig

    packed, build_s = synthetic_policy(total_bytes, seed)
    server = PolicyServer(PolicyServerConfig())
    port = server.start()
    t0 = time.perf_counter()
    server.publish(packed)
    publish_s = time.perf_counter() - t0
    nbytes = packed.manifest.total_bytes
    del packed  # the server holds its own pre-serialized copy
    out.put({"port": port, "build_s": build_s, "publish_s": publish_s, "bytes": nbytes})
    stop.wait(max_s)
    server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bytes", type=float, default=1e9, help="packed policy size in bytes (default 1e9)")
    parser.add_argument("--quick", action="store_true", help="~64 MB instead")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tp-size", type=int, default=2, help="TP degree of the shard fetch (rank 0)")
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run, seconds")
    args = parser.parse_args(argv)
    total = int(64e6 if args.quick else args.bytes)
    if total < 1e6 or args.repeats < 1:
        parser.error("--bytes must be >= 1e6 and --repeats >= 1")

    from broker.policy_client import PolicyClient, PolicyClientConfig

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(total, args.seed, out, stop, args.timeout), daemon=True)
    child.start()
    try:
        info = out.get(timeout=args.timeout)
        gb = info["bytes"] / 1e9

        # The same bytes in this process, for the baseline and an independent check.
        packed, _ = synthetic_policy(total, args.seed)
        blobs = [packed.blobs[t.name] for t in packed.manifest.tensors]

        def copy_fresh() -> float:
            t0 = time.perf_counter()
            copies = [bytearray(b) for b in blobs]
            dt = time.perf_counter() - t0
            del copies
            return dt

        warm = [bytearray(len(b)) for b in blobs]

        def copy_warm() -> float:
            t0 = time.perf_counter()
            for dst, src in zip(warm, blobs):
                dst[:] = src
            return time.perf_counter() - t0

        config = PolicyClientConfig(
            address=f"127.0.0.1:{info['port']}",
            expected_fingerprint=packed.manifest.contract_fingerprint,
            fetch_timeout_s=args.timeout,
        )
        fetch_times = []
        with PolicyClient(config) as client:
            manifest = client.get_manifest()
            for _ in range(args.repeats + 1):  # the first one is cold (first touch of the buffers)
                t0 = time.perf_counter()
                raw, _, stats = client.fetch_bytes(manifest)
                fetch_times.append(time.perf_counter() - t0)
                assert stats.refetched_chunks == stats.resumed_streams == 0
                del raw
            shard_times = []
            for _ in range(2):  # the first one makes the server cut (and cache) the shard layout
                t0 = time.perf_counter()
                raw, _, _ = client.fetch_bytes(manifest, tp_rank=0, tp_size=args.tp_size)
                shard_times.append(time.perf_counter() - t0)
                shard_gb = sum(len(b) for b in raw.values()) / 1e9
                del raw
            # One independent end-to-end check beyond the client's own verification.
            raw, _, _ = client.fetch_bytes(manifest, names=[manifest.tensors[-1].name])
            assert (
                hashlib.sha256(raw[manifest.tensors[-1].name]).digest()
                == hashlib.sha256(packed.blobs[manifest.tensors[-1].name]).digest()
            )
        fresh = [copy_fresh() for _ in range(args.repeats)]
        warmed = [copy_warm() for _ in range(args.repeats)]
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()

    cold_s = fetch_times[0]
    fetch_s, fresh_s, warm_s = (statistics.median(x) for x in (fetch_times[1:], fresh, warmed))
    n_tensors = len(packed.manifest.tensors)
    print(f"policy: {n_tensors} nvfp4 tensors, {gb:.3f} GB packed, chunks of {packed.manifest.chunk_bytes} B")
    print(f"trainer build_manifest (copy + sha256 + xxh3): {info['build_s']:.3f} s  = {gb / info['build_s']:.2f} GB/s")
    print(
        f"trainer publish (pre-serialize chunks):         {info['publish_s']:.3f} s  "
        f"= {gb / info['publish_s']:.2f} GB/s"
    )
    print(
        f"rollout fetch over loopback gRPC (verified):    {fetch_s:.3f} s  = {gb / fetch_s:.2f} GB/s "
        f"(median of {args.repeats}: {', '.join(f'{t:.3f}' for t in fetch_times[1:])})"
    )
    print(f"  first fetch (cold buffers):                   {cold_s:.3f} s  = {gb / cold_s:.2f} GB/s")
    print(
        f"TP shard fetch, rank 0 of {args.tp_size} ({shard_gb:.3f} GB): first {shard_times[0]:.3f} s "
        f"(server cuts the shards), then {shard_times[1]:.3f} s = {shard_gb / shard_times[1]:.2f} GB/s"
    )
    print(f"baseline in-memory copy, fresh buffers:          {fresh_s:.3f} s  = {gb / fresh_s:.2f} GB/s")
    print(f"baseline in-memory copy, touched buffers:        {warm_s:.3f} s  = {gb / warm_s:.2f} GB/s")
    print(f"ratio fetch / fresh copy:   {fresh_s / fetch_s:.3f}")
    print(f"ratio fetch / touched copy: {warm_s / fetch_s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
