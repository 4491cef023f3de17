"""bench/run_e2e_device.sh end to end on the CPU (E2E_SMALL=1): the GPU run's launch path with a tiny
model. It writes the Hugging Face folder, runs `tandem run configs/gpu-h200.yaml` (real redis-server,
trainer and 2 rollout worker processes, gRPC on loopback) and reports; this checks that every
figure docs/benchmarks.md quotes from the H200 run is produced, the workers' and the trainer's traces included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")
def test_run_e2e_script_small_on_cpu(tmp_path):
    env = {
        **os.environ,
        "E2E_SMALL": "1",
        "RUNS": "async",
        "STEPS": "6",  # 3 were too few: a worker still draining its first groups when the trainer ended never swapped
        "E2E_DIR": str(tmp_path / "runs"),
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
        "E2E_TRACE_AFTER_S": "0",  # each worker profiles its first steps, the trainer its first one
    }
    proc = subprocess.run(
        ["bash", "bench/run_e2e_device.sh"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steps"] == 6 and report["recipe"] == "nvfp4_moe" and report["max_staleness"] == 2
    assert report["dropped_fingerprint"] == 0 and report["invalid"] == 0
    assert sorted(report["workers"]) == ["w0", "w1"]  # each swapped versions and said what it generated
    assert sum(w["tokens"] for w in report["workers"].values()) > 0
    assert report["publish_to_live_median_s"] is not None and report["publish_to_live_median_s"] >= 0
    assert report["train_per_step_s"] >= report["step_time_s"] > 0
    assert 0 <= report["logp_abs_diff_quant"] < 1e-3  # the contract: QAT and packed weights agree
    with tarfile.open(tmp_path / "out" / "async.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"async/metrics.jsonl", "async/logs/trainer.log", "async/reward.png", "async/model.json"} <= names
    assert {"async/traces/w0-trace-summary.json", "async/traces/w1-trace.json"} <= names
    assert "async/traces/trainer-trace-summary.json" in names and "async/traces/trainer-trace.json" not in names
    assert "Traced steps of each service" in (tmp_path / "out" / "report.md").read_text()
    assert not any("run.secret" in n or "/redis" in n for n in names)  # no secret, no AOF in the archive
    row = json.loads((tmp_path / "runs" / "async" / "metrics.jsonl").read_text().splitlines()[-1])
    assert {
        "collect_s",
        "publish_s",
        "quantize_s",
        "publish_blocked_s",
        "publish_bg_s",
        "publish_announce_wait_s",
        "recompute_s",
    } <= set(row)
    # older versions are held as their packed tensors, at most max_staleness + 1 of them
    assert 1 <= row["retained_versions"] <= 3 and row["retained_bytes"] > 0
    # the warm start teaches the task: sampled completions end with <eos> and some are rewarded
    sampled = report["warmstart_eval"]["sampled"]
    assert sampled["reward_mean"] > 0 and sampled["eos_frac"] > 0.5, report["warmstart_eval"]
    assert not (tmp_path / "runs" / "async" / "checkpoints").exists()  # trainer.checkpoint_every: 0
