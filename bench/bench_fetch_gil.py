"""What a policy fetch costs the decode loop's Python: a GIL-bound stand-in for the decode loop
(small pure-Python steps, as a worker's step launches graphs and samples from Python) counts its
steps per second while a version is fetched (a) not at all (the baseline, measured in the same
run), (b) in a thread of this process (`PolicyClient.fetch`, the in-process path), (c) by the
fetch child (`rollout.fetch_process.FetchProcess`, the CUDA worker's default). Both the decode
rate and the fetch's own time count: in one process they trade against each other through the GIL
(steps lost = the decode rate's drop x the fetch's seconds).

    python3 bench/bench_fetch_gil.py                 # the e2e version (Qwen3-30B-A3B widths x 6 layers, nvfp4_moe)
    python3 bench/bench_fetch_gil.py --small         # CPU box: the `small` preset cut to 2 layers, 8 experts

The trainer is bench_swap.py's spawned serving child (random init, quantized, published, served on
127.0.0.1). Target: (c) keeps >= 0.8 of the baseline's steps/s where the host has a core for the
child (a host with fewer cores than busy processes shares them however the fetch is arranged).

`--serve`: the other side, what serving a version costs the trainer's Python. This process builds
the version and frames it into shared pool buffers (as the trainer publishes), `--clients` fetch
children fetch it at once, and a stand-in for the training loop (small torch ops on `--device`: each
releases the GIL and takes it back, as every kernel launch of a training step does) counts its ops
per second: idle, and while the version is served (a) by a PolicyServer in this process (its
event-loop thread hands every chunk to gRPC), under each `--switch-intervals` value
(sys.setswitchinterval: how long a thread waiting for the GIL lets the holder run before asking for
it; Python's default 5 ms), and (b) by broker.server_process.PolicyServerProcess (the trainer's
default on CUDA: serving in a child process).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_swap import _serve  # noqa: E402  (the serving child)


def python_step() -> None:
    sum(range(2000))  # one "decode step" of Python (~20 us)


def steps_while(work, seconds_min: float = 1.0, step=python_step) -> tuple[float, float]:
    """Steps per second of `step` (the decode stand-in) while `work()` runs in a thread (or for
    `seconds_min` when `work` is None), and work's seconds."""
    done = threading.Event()
    took = [0.0]

    def run() -> None:
        t0 = time.perf_counter()
        try:
            work()
        finally:
            took[0] = time.perf_counter() - t0
            done.set()

    if work is None:
        threading.Timer(seconds_min, done.set).start()
    else:
        threading.Thread(target=run, daemon=True).start()
    n, t0 = 0, time.perf_counter()
    while not done.is_set():
        step()
        n += 1
    return n / (time.perf_counter() - t0), took[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="where the serving child builds the version")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=0)
    ap.add_argument("--recipe", default="nvfp4_moe")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--serve", action="store_true", help="measure the serving side (module docstring)")
    ap.add_argument("--clients", type=int, default=2, help="--serve: fetch children fetching at once")
    ap.add_argument("--switch-intervals", default="0.005,0.0005", help="--serve: sys.setswitchinterval values (s)")
    args = ap.parse_args(argv)
    if args.small:
        args.preset, args.layers, args.experts = "small", 2, 8
    if args.serve:
        return serve(args)

    from broker.policy_client import PolicyClient, PolicyClientConfig, ReceiveBuffers
    from rollout.fetch_process import FetchProcess, FetchRequest

    ctx = mp.get_context("spawn")
    out, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=_serve, args=(args, out, stop), daemon=True)
    server.start()
    fetcher = FetchProcess(pinned=False)
    try:
        info = out.get(timeout=args.timeout)
        out.get(timeout=60)
        address, gb = f"127.0.0.1:{info['port']}", info["bytes"] / 1e9
        with PolicyClient(PolicyClientConfig(address=address)) as c:
            fingerprint = c.get_manifest(1).contract_fingerprint
        print(f"{os.cpu_count()} CPU cores; version {gb:.3f} GB in {info['tensors']} tensors", flush=True)
        buffers = ReceiveBuffers()

        def in_process() -> None:
            with PolicyClient(PolicyClientConfig(address=address, fetch_timeout_s=600.0)) as client:
                client.fetch(1, buffers=buffers)

        def in_child() -> None:
            fetcher.fetch(FetchRequest(address=address, fingerprint=fingerprint, version=1, fetch_timeout_s=600.0))

        in_process(), in_child()  # warm: slabs touched, the child started
        for _ in range(args.repeats):
            base, _ = steps_while(None)
            thread, thread_s = steps_while(in_process)
            child, child_s = steps_while(in_child)
            lost_thread, lost_child = (base - thread) * thread_s, (base - child) * child_s
            print(
                f"decode steps/s: idle {base:,.0f}; fetching in a thread {thread:,.0f} (x{thread / base:.2f}, "
                f"fetch {thread_s:.2f} s, {lost_thread:,.0f} steps lost); fetching in the child {child:,.0f} "
                f"(x{child / base:.2f}, fetch {child_s:.2f} s, {lost_child:,.0f} steps lost)",
                flush=True,
            )
    finally:
        fetcher.close()
        stop.set()
        server.join(30)
    return 0


def serve(args) -> int:
    import torch
    from bench_swap import quantized_version

    from broker import frames
    from broker.policy_server import PolicyServer, PolicyServerConfig
    from broker.server_process import PolicyServerProcess
    from rollout.fetch_process import FetchProcess, FetchRequest

    tensors, contract = quantized_version(args)
    pool = frames.BufferPool(pin=args.device == "cuda", shared=True)
    config = PolicyServerConfig(max_streams_per_connection=16)
    servers = {"thread": PolicyServer(config), "process": PolicyServerProcess(config)}
    for server in servers.values():
        server.start()
        framed = frames.build_framed(version=1, parent_version=None, contract=contract, tensors=tensors, pool=pool)
        server.publish(framed)
    manifest = framed.manifest
    del tensors
    fetchers = [FetchProcess(pinned=False) for _ in range(args.clients)]
    a, b, c = (torch.ones(64, device=args.device) for _ in range(3))

    def torch_step() -> None:
        for _ in range(10):
            torch.add(a, b, out=c)  # releases the GIL and takes it back, as a kernel launch

    def fetch_all(server) -> None:
        request = FetchRequest(
            address=server.address, fingerprint=manifest.contract_fingerprint, version=1, fetch_timeout_s=600.0
        )
        threads = [threading.Thread(target=f.fetch, args=(request,)) for f in fetchers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def measure(where: str, server) -> None:
        base, _ = steps_while(None, step=torch_step)
        busy, busy_s = steps_while(lambda: fetch_all(server), step=torch_step)
        print(
            f"served {where}: training stand-in {base:,.0f} steps/s idle, {busy:,.0f} while serving "
            f"(x{busy / base:.2f}); serving took {busy_s:.2f} s "
            f"({args.clients * manifest.total_bytes / busy_s / 1e9:.2f} GB/s in all)",
            flush=True,
        )

    default = sys.getswitchinterval()
    try:
        print(f"{os.cpu_count()} CPU cores; serving {manifest.total_bytes / 1e9:.3f} GB to {args.clients} "
              f"fetch children at once", flush=True)  # fmt: skip
        fetch_all(servers["thread"])  # warm: the children started, their slabs touched
        for _ in range(args.repeats):
            for interval in [float(x) for x in args.switch_intervals.split(",")]:
                sys.setswitchinterval(interval)
                measure(f"by a thread of this process, switch interval {interval * 1e3:g} ms", servers["thread"])
            sys.setswitchinterval(default)
            measure("by the server's own process (PolicyServerProcess)", servers["process"])
    finally:
        sys.setswitchinterval(default)
        for f in fetchers:
            f.close()
        for server in servers.values():
            server.stop()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
