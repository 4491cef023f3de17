"""policy.tracing: the summary of a recording, its rows from a chrome trace and the affinity list by
hand; a StepTracer on the CPU records the steps it was asked for after its delay, writes the trace and
the summary, and reports a folder it cannot write in one line instead of raising."""

from __future__ import annotations

import json
import os

import pytest
import torch

from policy.tracing import StepTracer, TraceConfig, _cpu_list, rows_from_trace, summarize, thread_affinity
from rollout.config import RolloutConfig


def test_summarize_by_hand():
    rows = [
        {"name": "gemm", "device_us": 3000.0, "cpu_us": 10.0, "count": 4},
        {"name": "attn", "device_us": 1000.0, "cpu_us": 0.0, "count": 4},
        {"name": "aten::copy_", "device_us": 0.0, "cpu_us": 500.0, "count": 8},
    ]
    s = summarize(rows, [0.010, 0.002, 0.004, 0.004], busy_us=3600.0)  # 4 steps, 20 ms in all
    assert (
        s["steps"] == 4
        and s["step_wall_ms_median"] == pytest.approx(4.0)
        and s["step_wall_ms_mean"] == pytest.approx(5.0)
    )
    assert s["device_busy_ms_per_step"] == pytest.approx(0.9) and s["device_busy_frac"] == pytest.approx(0.18)
    assert s["kernel_ms_per_step"] == pytest.approx(1.0)  # 4 ms of kernels, 0.4 of them on two streams at once
    assert [k["name"] for k in s["top_kernels"]] == ["gemm", "attn"] and s["top_kernels"][0]["ms_per_step"] == 0.75
    assert [c["name"] for c in s["top_cpu_ops"]] == ["aten::copy_", "gemm"]


def test_rows_from_a_chrome_trace_by_hand():
    def x(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}

    events = [
        x("cpu_op", "aten::linear", 0, 100),  # encloses mm (60, which encloses a launch of 10) and copy_ (20)
        x("cpu_op", "aten::mm", 10, 60),
        x("cuda_runtime", "cudaLaunchKernel", 20, 10),
        x("cpu_op", "aten::copy_", 75, 20),
        x("cpu_op", "aten::mm", 0, 30, tid=2),  # another thread: nothing encloses it
        x("kernel", "gemm", 30, 50, tid=9),
        x("kernel", "gemm", 60, 40, tid=10),  # overlaps the first from 60 to 80
        x("gpu_memcpy", "Memcpy DtoH", 200, 5, tid=9),
        x("gpu_user_annotation", "Optimizer.step", 0, 500, tid=9),  # a range, not device work
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 0},  # not a complete event
    ]
    rows, busy_us = rows_from_trace(events)
    by = {r["name"]: r for r in rows}
    assert by["aten::linear"]["cpu_us"] == 20 and by["aten::copy_"]["cpu_us"] == 20
    assert by["aten::mm"] == {"name": "aten::mm", "device_us": 0.0, "cpu_us": 80.0, "count": 2}  # 50 + 30
    assert by["cudaLaunchKernel"]["cpu_us"] == 10
    assert by["gemm"] == {"name": "gemm", "device_us": 90.0, "cpu_us": 0.0, "count": 2}
    assert by["Memcpy DtoH"]["device_us"] == 5 and "Optimizer.step" not in by and "flow" not in by
    assert busy_us == 75  # [30, 100) and [200, 205)


def test_cpu_list_and_this_process_affinity():
    assert _cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8" and _cpu_list({3}) == "3" and _cpu_list(set()) == ""
    a = thread_affinity()
    assert a["pid"] == os.getpid() and a["process"] == _cpu_list(os.sched_getaffinity(0))
    assert any(name.split(" ", 1)[0] == str(os.getpid()) for name in a["threads"])  # the main thread


def test_a_tracer_records_its_steps_then_writes_once(tmp_path):
    logged = []
    tracer = StepTracer(
        TraceConfig(dir=str(tmp_path / "t"), after_s=0.0, steps=2), "w0", torch.device("cpu"), logged.append
    )
    x = torch.randn(64, 64)
    for _ in range(5):
        with tracer.step():
            x = torch.tanh(x @ x)
    summary = json.loads((tmp_path / "t" / "w0-trace-summary.json").read_text())
    assert summary["steps"] == 2 and summary["name"] == "w0" and summary["affinity"]["threads"]
    assert any("mm" in op["name"] for op in summary["top_cpu_ops"])
    assert json.loads((tmp_path / "t" / "w0-trace.json").read_text())["traceEvents"]
    assert len(logged) == 1 and logged[0].startswith("w0: traced 2 steps")


def test_a_tracer_waits_is_off_without_a_folder_and_survives_an_unwritable_one(tmp_path):
    waiting = StepTracer(TraceConfig(dir=str(tmp_path), after_s=3600.0, steps=1), "w0", torch.device("cpu"), print)
    off = StepTracer(TraceConfig(), "w0", torch.device("cpu"), print)
    for t in (waiting, off):
        with t.step():
            pass
        assert t.prof is None and not list(tmp_path.iterdir())
    (tmp_path / "file").write_text("")
    logged = []
    bad = StepTracer(
        TraceConfig(dir=str(tmp_path / "file"), after_s=0.0, steps=1), "w1", torch.device("cpu"), logged.append
    )
    with bad.step():
        pass
    assert bad.done and len(logged) == 1 and "trace not written" in logged[0] and "\n" not in logged[0]


@pytest.mark.parametrize("kw", [{"after_s": -1.0}, {"steps": 0}, {"dir": 3}])
def test_trace_config_is_checked_in_one_line(kw):
    with pytest.raises(ValueError, match="TraceConfig: ") as e:
        RolloutConfig(trace=TraceConfig(**kw))
    assert "\n" not in str(e.value)
