"""A profile of a service's steps (`rollout.trace`, `trainer.trace`): what a worker's decode loop or
the trainer's GRPO step spends time on while the rest of the machine (the other services on the same
GPU, fetch children, Redis) runs beside it.

    tracer = StepTracer(cfg.trace, name, device, log)   # name: the worker's id or "trainer"
    with tracer.step():          # around each step, on the thread that runs it
        ...

Rules: off while `trace.dir` is "". The first step that starts `after_s` seconds or more after the
tracer was made starts a torch.profiler recording (CPU, and CUDA on a CUDA device); after `steps`
steps it stops and writes DIR/<name>-trace.json (chrome://tracing or Perfetto) and
DIR/<name>-trace-summary.json (`summarize`: wall time and device busy time per step, the top
kernels and CPU ops, the CPU affinity of the process and of each of its threads), then says so in
one line. Once per process; a failure to write is one logged line, never the service's end.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .fields import is_int, is_number


@dataclass(frozen=True, kw_only=True)
class TraceConfig:
    """A torch.profiler recording of a service's steps (policy/tracing.py)."""

    dir: str = ""
    """Folder for <name>-trace.json (chrome://tracing, Perfetto) and <name>-trace-summary.json (time
    per step, device busy time, top kernels and CPU ops, CPU affinity of every thread), <name> the
    worker's id or "trainer"; "" = off."""
    after_s: float = 60.0
    """Seconds after the service starts before the recording (past engine builds, graph captures, compiles)."""
    steps: int = 20
    """Steps recorded: a worker's batcher steps (one decode step each on the CPU, `check_every` graph
    replays on CUDA), the trainer's GRPO steps (each launches far more kernels: 1 or 2)."""

    def __post_init__(self):
        if not isinstance(self.dir, str) or not is_number(self.after_s, 0, 86400) or not is_int(self.steps, 1, 10000):
            raise ValueError(
                f"TraceConfig: dir={self.dir!r}, after_s={self.after_s!r}, steps={self.steps!r} "
                "(want a folder or '', 0..86400 seconds, 1..10000 steps)"
            )


TOP = 12  # kernels and CPU ops listed in the summary


def summarize(rows: list[dict], step_walls: list[float]) -> dict:
    """The summary of a recording. rows: one per distinct op or kernel, {"name", "device_us" (its own
    time on the device, summed), "cpu_us" (its own CPU time, summed), "count"}; step_walls: each
    recorded step's wall seconds. Per step: wall (median and mean) and device busy time (the sum of
    every kernel's own time over the steps, divided by their number: overlapping kernels count twice)."""
    n = max(1, len(step_walls))
    device_us = sum(r["device_us"] for r in rows)
    kernels = sorted((r for r in rows if r["device_us"] > 0), key=lambda r: -r["device_us"])[:TOP]
    cpu = sorted((r for r in rows if r["cpu_us"] > 0), key=lambda r: -r["cpu_us"])[:TOP]
    wall_ms = statistics.fmean(step_walls) * 1e3 if step_walls else 0.0
    busy_ms = device_us / 1e3 / n
    return {
        "steps": len(step_walls),
        "step_wall_ms_median": statistics.median(step_walls) * 1e3 if step_walls else 0.0,
        "step_wall_ms_mean": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "device_busy_frac": busy_ms / wall_ms if wall_ms else 0.0,
        "top_kernels": [
            {"name": r["name"], "ms_per_step": r["device_us"] / 1e3 / n, "count": r["count"]} for r in kernels
        ],
        "top_cpu_ops": [{"name": r["name"], "ms_per_step": r["cpu_us"] / 1e3 / n, "count": r["count"]} for r in cpu],
    }


def thread_affinity() -> dict:
    """This process's CPU affinity and each of its threads' ({"<tid> <name>": "0-3,8"}): Linux /proc."""
    threads = {}
    for task in sorted(Path("/proc/self/task").glob("*"), key=lambda p: int(p.name)):
        with contextlib.suppress(OSError, ValueError):
            name = (task / "comm").read_text().strip()
            threads[f"{task.name} {name}"] = _cpu_list(os.sched_getaffinity(int(task.name)))
    return {"pid": os.getpid(), "process": _cpu_list(os.sched_getaffinity(0)), "threads": threads}


def _cpu_list(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive CPUs
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


class StepTracer:
    def __init__(self, cfg: TraceConfig, name: str, device: torch.device, log: Callable[[str], None]):
        self.cfg, self.name, self.device, self.log = cfg, name, device, log
        self.made = time.monotonic()
        self.done = not cfg.dir
        self.prof = None
        self.walls: list[float] = []

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.done or (self.prof is None and time.monotonic() - self.made < self.cfg.after_s):
            yield
            return
        if self.prof is None:
            self._start()
        t0 = time.perf_counter()
        yield
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.walls.append(time.perf_counter() - t0)
        if len(self.walls) >= self.cfg.steps:
            self._finish()

    def _start(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()

    def _finish(self) -> None:
        self.prof.__exit__(None, None, None)
        self.done = True
        rows = [
            {"name": e.key, "device_us": e.self_device_time_total, "cpu_us": e.self_cpu_time_total, "count": e.count}
            for e in self.prof.key_averages()
        ]
        summary = summarize(rows, self.walls) | {"name": self.name, "affinity": thread_affinity()}
        out = Path(self.cfg.dir)
        try:
            out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(out / f"{self.name}-trace.json"))
            (out / f"{self.name}-trace-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        except OSError as e:
            self.log(f"{self.name}: trace not written: {e}")
            return
        self.log(
            f"{self.name}: traced {summary['steps']} steps: {summary['step_wall_ms_median']:.1f} ms per step "
            f"(median), device busy {summary['device_busy_frac']:.0%}; {out}/{self.name}-trace*.json"
        )
