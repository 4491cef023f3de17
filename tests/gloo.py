"""Shared by the gloo tests (tests/integration/test_*_gloo.py): real torch.distributed process
groups on 127.0.0.1, one spawned process per rank.

A rank's worker is `worker(rank, port, out)`: it calls `init(rank, port, world, timeout_s)`, does
its work and puts `(rank, result, None)` on `out`, or `(rank, None, traceback)` if it raised.
Results travel by pickle between these test processes only (plain Python values and bytes)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue

import pytest


def init(rank: int, port: int, world: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def run_ranks(worker, *, world: int, port: int, timeout_s: float, what: str) -> dict:
    """Start `world` spawned ranks of `worker` and return {rank: result}; fail the test with the
    rank's traceback if one raised, or if not all reported within `timeout_s` (`what` names them)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    env_before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned workers: many processes on few cores
    try:
        procs = [ctx.Process(target=worker, args=(r, port, out), daemon=True) for r in range(world)]
        for p in procs:
            p.start()
    finally:
        if env_before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_before
    results = {}
    try:
        for _ in range(world):
            rank, result, error = out.get(timeout=timeout_s)
            assert error is None, f"rank {rank} failed:\n{error}"
            results[rank] = result
    except queue.Empty:
        pytest.fail(f"{what} did not report within {timeout_s} s (got ranks {sorted(results)})")
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return results
