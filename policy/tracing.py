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

The summary is read back from the exported trace file (`rows_from_trace`), not from torch's own
tables: those build a Python object and a tree node per event, more than 45 s for one traced GRPO
step of the long workload on the H200. kineto prints "External init callback must run in same thread
as registerClient" once when a recording starts off the main thread (the trainer's step thread);
the recording goes on (the traced step ran on the H200 after it).
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
DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")  # chrome-trace categories of work on the device
CPU_EVENTS = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")  # ... of work on a host thread


def summarize(rows: list[dict], step_walls: list[float], busy_us: float) -> dict:
    """The summary of a recording. rows: one per distinct op or kernel, {"name", "device_us" (its own
    time on the device, summed), "cpu_us" (its own CPU time, summed), "count"}; step_walls: each
    recorded step's wall seconds; busy_us: the time at least one device event ran. Per step: wall
    (median and mean), device busy time (busy_us over the steps) and kernel time (every kernel's own
    time summed: kernels overlapping on several streams count twice)."""
    n = max(1, len(step_walls))
    kernels = sorted((r for r in rows if r["device_us"] > 0), key=lambda r: -r["device_us"])[:TOP]
    cpu = sorted((r for r in rows if r["cpu_us"] > 0), key=lambda r: -r["cpu_us"])[:TOP]
    wall_ms = statistics.fmean(step_walls) * 1e3 if step_walls else 0.0
    busy_ms = busy_us / 1e3 / n
    return {
        "steps": len(step_walls),
        "step_wall_ms_median": statistics.median(step_walls) * 1e3 if step_walls else 0.0,
        "step_wall_ms_mean": wall_ms,
        "device_busy_ms_per_step": busy_ms,
        "device_busy_frac": busy_ms / wall_ms if wall_ms else 0.0,
        "kernel_ms_per_step": sum(r["device_us"] for r in rows) / 1e3 / n,
        "top_kernels": [
            {"name": r["name"], "ms_per_step": r["device_us"] / 1e3 / n, "count": r["count"]} for r in kernels
        ],
        "top_cpu_ops": [{"name": r["name"], "ms_per_step": r["cpu_us"] / 1e3 / n, "count": r["count"]} for r in cpu],
    }


def rows_from_trace(events: list[dict]) -> tuple[list[dict], float]:
    """`summarize`'s rows and busy time from a chrome trace's events (complete events, ph "X": ts and
    dur in µs; others are skipped). A device event (DEVICE_EVENTS) counts its duration; a CPU event
    (CPU_EVENTS) its self time: its duration less that of the CPU events it encloses on its thread
    (pid, tid). Busy time: the union of the device events' intervals."""
    rows: dict[str, dict] = {}
    device: list[dict] = []
    threads: dict[tuple, list[dict]] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        if e.get("cat") in DEVICE_EVENTS:
            device.append(e)
        elif e.get("cat") in CPU_EVENTS:
            threads.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    timed = [(e, "device_us", e["dur"]) for e in device]
    timed += [(e, "cpu_us", us) for evs in threads.values() for e, us in _self_times(evs)]
    for e, key, us in timed:
        row = rows.setdefault(e["name"], {"name": e["name"], "device_us": 0.0, "cpu_us": 0.0, "count": 0})
        row[key] += us
        row["count"] += 1
    return list(rows.values()), _union_us([(e["ts"], e["ts"] + e["dur"]) for e in device])


def _self_times(events: list[dict]) -> list[tuple[dict, float]]:
    """(event, self µs) for one thread's events, nested by time: its duration less its children's."""
    events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
    children = [0.0] * len(events)
    open_: list[int] = []  # the events enclosing the current one, innermost last
    for i, e in enumerate(events):
        while open_ and events[open_[-1]]["ts"] + events[open_[-1]]["dur"] <= e["ts"]:
            open_.pop()
        if open_:
            children[open_[-1]] += e["dur"]
        open_.append(i)
    return [(e, max(0.0, e["dur"] - c)) for e, c in zip(events, children)]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


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
        out = Path(self.cfg.dir)
        trace = out / f"{self.name}-trace.json"
        try:
            out.mkdir(parents=True, exist_ok=True)
            self.prof.export_chrome_trace(str(trace))
            self.prof = None  # the recording, in memory: the file has it now
            rows, busy_us = rows_from_trace(json.loads(trace.read_text())["traceEvents"])
            summary = summarize(rows, self.walls, busy_us) | {"name": self.name, "affinity": thread_affinity()}
            (out / f"{self.name}-trace-summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self.log(f"{self.name}: trace not written: {type(e).__name__}: {e}")
            return
        self.log(
            f"{self.name}: traced {summary['steps']} steps: {summary['step_wall_ms_median']:.1f} ms per step "
            f"(median), device busy {summary['device_busy_frac']:.0%}; {out}/{self.name}-trace*.json"
        )
