"""Publish -> live on a rollout worker, by part: gRPC fetch over 1 vs N streams or N fetch processes,
and the swap into the engine in place vs building a fresh one, each against a same-run baseline.

    python3 bench/bench_swap.py                    # CUDA: Qwen3-30B-A3B widths x 6 layers, nvfp4_moe (the e2e version)
    python3 bench/bench_swap.py --small            # CPU box: the `small` preset cut to 2 layers, 8 experts
    python3 bench/bench_swap.py --streams 1,2,4,8 --repeats 2 --json out.json
    python3 bench/bench_swap.py --streams 1 --processes 1,2,4,6 --fetch-only   # the worker's fetch children
    python3 bench/bench_swap.py --streams 1 --processes 2 --fetch-only --delta-noise 1e-4   # deltas in them

A spawned child plays the trainer (random init, quantized with the recipe, published, served on
127.0.0.1); this process plays a worker. fetch: `PolicyClient.fetch` (fully verified) into one
`ReceiveBuffers` slab per `--streams` value (baseline: a host memcpy of the same bytes). fetch in
processes: `FetchProcess` with N children into one shared slab per `--processes` value, with the CPU
cores the server and the children used (~1.0 for the server = its event loop is the bound);
`--two-workers` then runs two such fetchers at once. `--delta-noise X`: the trainer also publishes
version 2, the same model with every weight scaled by (1 + X * N(0, 1)) (deltas on), and times the
delta's build that its publish starts; each fetcher then fetches versions 1, 1, 2, 1, 2: the second
whole into the warm slab (the baseline), 2 as a delta against the 1 its slab holds, 1 whole (no
delta of an older version is served). swap: a fresh `PackedEngine` + graph capture, twice (the
first pays compilation), against `PackedEngine.update` (baseline: one host-to-device copy
of the slab). First fetches are reported apart, then medians of `--repeats`."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def model_config(args):
    from policy.model import ModelConfig

    over = {"n_layers": args.layers}
    if args.experts:
        over["n_experts"] = args.experts
    return ModelConfig.preset(args.preset, **over)


def quantized_version(args, noise: float = 0.0):
    """A random-init model (seed 0), each weight scaled by (1 + noise * N(0, 1)) when `noise`,
    quantized with the recipe (QAT's cache on CUDA, what a trainer publishes): (its quantized
    tensors by name, the contract)."""
    import torch

    from policy import qat
    from policy.contract import contract_from_recipe
    from policy.formats.params import quantize_params
    from policy.model import Transformer
    from policy.recipe import Recipe

    cfg, recipe = model_config(args), Recipe.load(args.recipe)
    with torch.device(args.device):
        model = Transformer(cfg, seed=0)
    if noise:
        g = torch.Generator(args.device).manual_seed(1)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + noise * torch.randn(p.shape, device=p.device, generator=g))
    if args.device == "cuda":
        tensors = qat.apply_qat(model, recipe).quantized_params(model)
    else:
        tensors = quantize_params(dict(model.named_parameters()), recipe.plan(cfg))
    return tensors, contract_from_recipe(model_config=cfg, recipe=recipe)


def build_version(args, version: int = 1):
    """Version 1 (`quantized_version`), or 2 (its weights moved by --delta-noise), as a PackedPolicy;
    and build_manifest's seconds."""
    from policy import manifest as M

    tensors, contract = quantized_version(args, noise=args.delta_noise if version == 2 else 0.0)
    t0 = time.perf_counter()
    packed = M.build_manifest(version=version, parent_version=version - 1 or None, contract=contract, tensors=tensors)
    return packed, time.perf_counter() - t0


def _serve(args, out, stop) -> None:
    """The trainer: build, quantize, publish one version, serve until told to stop."""
    from broker.policy_server import PolicyServer, PolicyServerConfig

    packed, build_s = build_version(args)
    server = PolicyServer(PolicyServerConfig(max_streams_per_connection=16, deltas=args.delta_noise > 0))
    port = server.start()
    server.publish(packed)
    delta_build_s = None
    if args.delta_noise:
        v2 = build_version(args, 2)[0]
        t0 = time.perf_counter()
        server.publish(v2)
        while server.stats()["deltas_built"] < 1 and time.perf_counter() - t0 < args.timeout:
            time.sleep(0.005)
        delta_build_s = time.perf_counter() - t0
    out.put(
        {
            "port": port,
            "bytes": packed.manifest.total_bytes,
            "tensors": len(packed.manifest.tensors),
            "fingerprint": packed.manifest.contract_fingerprint,
        }
    )
    out.put({"build_manifest_s": build_s, "delta_build_s": delta_build_s})
    del packed
    stop.wait(args.timeout)
    server.stop()


def main(argv: list[str] | None = None) -> int:
    import torch

    cuda_here = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if cuda_here else "cpu")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=0, help="routed experts (0: the preset's)")
    ap.add_argument("--recipe", default="nvfp4_moe")
    ap.add_argument("--small", action="store_true", help="the `small` preset, 2 layers, 8 experts (CPU box)")
    ap.add_argument("--streams", default="1,2,4,8")
    ap.add_argument("--processes", default="1,2,4", help="fetch children per FetchProcess ('' = skip)")
    ap.add_argument("--two-workers", action="store_true", help="two FetchProcesses at once, with the fastest N")
    ap.add_argument("--fetch-only", action="store_true", help="skip the engine build and update")
    ap.add_argument("--delta-noise", type=float, default=0.0, help="> 0: deltas in the fetch children (docstring)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--kv", type=int, default=256)
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on the serving child, seconds")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.small:
        args.preset, args.layers, args.experts = "small", 2, 8
    try:
        streams = [int(x) for x in args.streams.split(",")]
        processes = [int(x) for x in args.processes.split(",") if x]
    except ValueError:
        ap.error("--streams and --processes: comma-separated ints")
    if args.repeats < 1 or not streams or min(streams) < 1 or not all(1 <= n <= 16 for n in processes):
        ap.error("--repeats >= 1, --streams of ints >= 1, --processes of ints in [1, 16]")

    import numpy as np

    from broker.policy_client import PolicyClient, PolicyClientConfig, ReceiveBuffers
    from policy.recipe import Recipe
    from rollout.packed_engine import EngineConfig, PackedEngine

    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    cfg = model_config(args)
    plan = Recipe.load(args.recipe).plan(cfg)
    print(
        f"{torch.cuda.get_device_name() if cuda else 'cpu'}, {os.cpu_count()} CPU cores, torch {torch.__version__}; "
        f"{args.preset} widths x {args.layers} layers ({cfg.num_parameters() / 1e9:.2f}B parameters), {args.recipe}",
        flush=True,
    )

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        return r, time.perf_counter() - t0

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_serve, args=(args, out, stop), daemon=True)
    child.start()
    res: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "args": vars(args), "fetch": {}}
    try:
        info = out.get(timeout=args.timeout)
        res.update(info)
        res.update(out.get(timeout=60))
        nbytes = info["bytes"]
        gb = nbytes / 1e9
        print(
            f"version: {gb:.3f} GB in {info['tensors']} tensors; trainer build_manifest {res['build_manifest_s']:.2f} s"
            + (
                ""
                if res["delta_build_s"] is None
                else f"; v2 published and its delta built in {res['delta_build_s']:.2f} s"
            ),
            flush=True,
        )
        address = f"127.0.0.1:{info['port']}"
        buffers = ReceiveBuffers(pinned=cuda)

        def fetch(n: int):
            c = PolicyClientConfig(address=address, streams=n, fetch_timeout_s=300.0)
            with PolicyClient(c) as client:
                return client.fetch(1, buffers=buffers)

        (fetched, first_s) = timed(lambda: fetch(streams[0]))
        res["first_fetch_s"] = first_s
        print(
            f"first fetch (fresh slab{', pinned' if cuda else ''}), {streams[0]} stream(s): {first_s:.2f} s", flush=True
        )

        # Baseline: host memcpy of the same bytes between touched buffers.
        views = list(buffers.views({n: lay.nbytes for n, lay in fetched.layouts.items()}).values())
        dst = [np.empty_like(v) for v in views]
        for d, v in zip(dst, views):
            np.copyto(d, v)  # touch
        memcpy_s = min(timed(lambda: [np.copyto(d, v) for d, v in zip(dst, views)])[1] for _ in range(3))
        res["memcpy_s"] = memcpy_s
        print(f"baseline host memcpy (touched buffers): {memcpy_s:.3f} s, {gb / memcpy_s:.2f} GB/s", flush=True)

        for n in streams:
            runs = []
            for _ in range(args.repeats):
                fetched, s = timed(lambda: fetch(n))
                f = fetched
                runs.append((s, f.stats.receive_s, f.stats.verify_s))
            s, recv, ver = (statistics.median(x) for x in zip(*runs))
            res["fetch"][n] = {"s": s, "receive_s": recv, "verify_s": ver}
            print(
                f"fetch, {n} stream(s): {s:.2f} s = {gb / s:.2f} GB/s (receive {recv:.2f} s, verify tail {ver:.2f} s); "
                f"x{res['fetch'][streams[0]]['s'] / s:.2f} vs {streams[0]} stream(s), {memcpy_s / s:.3f} of memcpy",
                flush=True,
            )
        if processes:
            res["processes"] = fetch_in_processes(args, processes, info["fingerprint"], address, child.pid, cuda, gb)
        if args.fetch_only:
            return 0
        tensors = fetched.tensors  # the last fetch's: they alias the slab

        ecfg = EngineConfig(max_batch=args.max_batch, max_seq_len=min(args.kv, cfg.max_seq_len))

        def build():
            e = PackedEngine(cfg, plan, tensors, device=dev, engine=ecfg)
            e.capture()
            return e

        if cuda:
            slab = torch.from_numpy(buffers._slab)
            dev_buf = torch.empty(slab.numel(), dtype=torch.uint8, device=dev)
            dev_buf.copy_(slab, non_blocking=True)
            h2d_s = min(timed(lambda: dev_buf.copy_(slab, non_blocking=True))[1] for _ in range(3))
            dev_buf = None  # freed before the engines
            res["h2d_s"] = h2d_s
            print(
                f"baseline host-to-device copy of the slab (pinned): {h2d_s:.3f} s, {gb / h2d_s:.1f} GB/s", flush=True
            )
        eng, build1 = timed(build)
        del eng
        if cuda:
            torch.cuda.empty_cache()
        eng, build2 = timed(build)
        mem0 = torch.cuda.memory_allocated() if cuda else 0
        ups = [timed(lambda: eng.update(tensors)) for _ in range(args.repeats + 1)]
        assert all(ok for ok, _ in ups), "update refused the same layout"
        update_s = statistics.median(s for _, s in ups[1:])
        mem1 = torch.cuda.memory_allocated() if cuda else 0
        res.update(build_first_s=build1, build_s=build2, update_s=update_s, update_mem_growth=mem1 - mem0)
        print(f"fresh engine + graph capture: first {build1:.2f} s (compiles), then {build2:.2f} s", flush=True)
        print(
            f"update in place (h2d into the live engine): {update_s:.3f} s = {gb / update_s:.1f} GB/s; "
            f"x{build2 / update_s:.1f} faster than a fresh build"
            + (f", {res['h2d_s'] / update_s:.2f} of the raw copy's speed" if cuda else "")
            + (f"; device memory after {len(ups)} updates: {mem1 - mem0:+d} bytes" if cuda else ""),
            flush=True,
        )
        best = min(res["fetch"], key=lambda k: res["fetch"][k]["s"])
        res["best_streams"] = best
        expect = res["fetch"][best]["s"] + update_s
        res["expected_pointer_to_live_s"] = expect
        print(
            f"expected pointer -> live (idle worker, or drain shorter than the fetch): fetch with {best} streams "
            f"{res['fetch'][best]['s']:.2f} s + update {update_s:.2f} s = {expect:.2f} s "
            f"(was: drain, then fetch with 1 stream {res['fetch'][streams[0]]['s']:.2f} s + fresh build {build2:.2f} s)",
            flush=True,
        )
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


def cpu_s(pids) -> float:
    """CPU seconds (user + system) the processes `pids` used so far."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def fetch_in_processes(args, processes: list[int], fingerprint: str, address: str, server_pid: int, cuda: bool, gb):
    """The worker's fetch (FetchProcess, N children into one shared slab) for each N; see the docstring."""
    import threading

    from rollout.fetch_process import FetchProcess, FetchRequest

    request = FetchRequest(address=address, fingerprint=fingerprint, version=1, fetch_timeout_s=300.0)
    out: dict = {}
    if args.delta_noise:
        for n in processes:
            out[n] = deltas_in_processes(n, request, server_pid, cuda, gb)
        return out
    for n in processes:
        fetcher = FetchProcess(pinned=cuda, reuse=True, processes=n, log=print)
        try:
            t0 = time.perf_counter()
            fetcher.fetch(request)
            first_s = time.perf_counter() - t0
            runs = []
            for _ in range(args.repeats):
                pids = fetcher.pids
                srv0, kids0, t0 = cpu_s([server_pid]), cpu_s(pids), time.perf_counter()
                f = fetcher.fetch(request)
                s = time.perf_counter() - t0
                srv, kids = (cpu_s([server_pid]) - srv0) / s, (cpu_s(pids) - kids0) / s
                runs.append((s, f.stats.receive_s, f.stats.verify_s, srv, kids))
                f = None  # its tensors alias the slab
        finally:
            fetcher.close()
        s, recv, ver, srv, kids = (statistics.median(x) for x in zip(*runs))
        out[n] = dict(first_s=first_s, s=s, receive_s=recv, verify_s=ver, server_cores=srv, children_cores=kids)
        base = out[processes[0]]["s"]
        print(
            f"fetch in {n} process(es): {s:.2f} s = {gb / s:.2f} GB/s (receive {recv:.2f} s, verify tail {ver:.2f} s; "
            f"first {first_s:.2f} s); x{base / s:.2f} vs {processes[0]} process(es); server {srv:.2f} cores, "
            f"children {kids:.2f} cores",
            flush=True,
        )
    if args.two_workers:
        n = min(out, key=lambda k: out[k]["s"])
        fetchers = [FetchProcess(pinned=cuda, reuse=True, processes=n, log=print) for _ in range(2)]
        try:
            for fetcher in fetchers:
                fetcher.fetch(request)  # children started, slab allocated
            times: list = [None, None]

            def run(i):
                t0 = time.perf_counter()
                fetchers[i].fetch(request)
                times[i] = time.perf_counter() - t0

            srv0, t0 = cpu_s([server_pid]), time.perf_counter()
            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
            srv = (cpu_s([server_pid]) - srv0) / wall
        finally:
            for fetcher in fetchers:
                fetcher.close()
        out["two_workers"] = {"processes": n, "s": times, "wall_s": wall, "server_cores": srv}
        print(
            f"two workers at once, {n} process(es) each: {times[0]:.2f} / {times[1]:.2f} s "
            f"({2 * gb / wall:.2f} GB/s served in all; one alone {out[n]['s']:.2f} s); server {srv:.2f} cores",
            flush=True,
        )
    return out


def deltas_in_processes(n: int, request, server_pid: int, cuda: bool, gb: float) -> dict:
    """--delta-noise: versions 1, 1, 2, 1, 2 (see the docstring), each fetch's figures."""
    import dataclasses

    from rollout.fetch_process import FetchProcess

    fetcher = FetchProcess(pinned=cuda, reuse=True, processes=n, log=print)
    rows = []
    try:
        for version in (1, 1, 2, 1, 2):
            pids = fetcher.pids or []
            srv0, kids0, t0 = cpu_s([server_pid]), cpu_s(pids), time.perf_counter()
            f = fetcher.fetch(dataclasses.replace(request, version=version))
            s = time.perf_counter() - t0
            st = f.stats
            rows.append(dict(version=version, s=s, receive_s=st.receive_s, verify_s=st.verify_s, bytes=st.bytes,
                             delta_parent=st.delta_parent, server_cores=(cpu_s([server_pid]) - srv0) / s,
                             children_cores=(cpu_s(pids) - kids0) / s if pids else None))  # fmt: skip
            f = None  # its tensors alias the slab
    finally:
        fetcher.close()
    for r in rows:
        label = "whole" if not r["delta_parent"] else f"delta against v{r['delta_parent']}"
        print(
            f"{n} process(es), v{r['version']} {label}: {r['s']:.2f} s (receive {r['receive_s']:.2f}, verify tail "
            f"{r['verify_s']:.2f}), {r['bytes'] / 1e6:.1f} MB on the wire ({100 * r['bytes'] / (gb * 1e9):.2f}%); "
            f"server {r['server_cores']:.2f} cores, children {r['children_cores'] or 0:.2f} cores",
            flush=True,
        )
    return {"rows": rows}


if __name__ == "__main__":
    raise SystemExit(main())
