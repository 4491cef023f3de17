"""`tandem study` end to end: a 2x2 grid of tiny real runs (`tandem run`: private redis-server,
trainer, a rollout worker) plus one contract-breaking ablation run, interrupted and resumed.

1. The study starts; once the first run is finished and the second has its first checkpoint, SIGTERM
   stops it (exit 130): the first run is finished, the second interrupted with a checkpoint.
2. Re-running finishes the study: the finished run is skipped, the interrupted one resumes from its
   checkpoint, and summary.csv, report.md and the PNGs are complete, the ablation flagged.
3. Re-running once more starts nothing.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer.checkpoints import checkpoints

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 3


def _study(tmp: Path) -> Path:
    base = {
        "run_id": "tiny",
        "num_rollout_workers": 1,
        "model": {
            "preset": "tiny",
            "overrides": {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64},
        },
        "trainer": {
            "max_steps": STEPS,
            "groups_per_step": 2,
            "group_size": 4,
            "minibatches": 1,
            "warmstart_steps": 2,
            "warmstart_batch": 8,
            "metrics_port": -1,
            "collect_timeout_s": 120.0,
        },
    }
    (tmp / "base.yaml").write_text(yaml.safe_dump(base))
    study = {
        "name": "tiny",
        "description": "a 2x2 grid of tiny runs",
        "base": "base.yaml",
        "grid": {"recipe": ["bf16", "int4_qat"], "loop.max_staleness": [0, 1]},
        "runs": {"int4-train_bf16-rollout": {"recipe": "int4_qat", "rollout_recipe": "bf16", "loop.max_staleness": 1}},
    }
    (tmp / "study.yaml").write_text(yaml.safe_dump(study, sort_keys=False))
    return tmp / "study.yaml"


def _tandem_study(cfg: Path, out: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "study", str(cfg), "--out", str(out), "--jobs", "1"],
        stdout=open(out.parent / "study.log", "ab"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        **kw,
    )


def _lines(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def test_study_runs_resumes_and_reports(tmp_path):
    cfg = _study(tmp_path)
    out = tmp_path / "out"
    first, second = out / "recipe-bf16__max_staleness-0", out / "recipe-bf16__max_staleness-1"

    # 1. Interrupt the study while the second run is under way.
    proc = _tandem_study(cfg, out)
    deadline = time.monotonic() + 240
    # The second run's warm-start checkpoint is written before its rollout worker is up: stop then.
    while not (first / "done.json").exists() or not checkpoints(second / "checkpoints"):
        assert proc.poll() is None, (tmp_path / "study.log").read_text()[-3000:]
        assert time.monotonic() < deadline, (tmp_path / "study.log").read_text()[-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 130
    log = (tmp_path / "study.log").read_text()
    assert f"start {first.name} (new)" in log and f"start {second.name} (new)" in log
    assert not (second / "done.json").exists() and checkpoints(second / "checkpoints")
    done_before = (first / "done.json").read_text()

    # 2. Resume: the first run is skipped, the second resumes from its checkpoint, the rest run.
    proc = _tandem_study(cfg, out)
    assert proc.wait(timeout=300) == 0, (tmp_path / "study.log").read_text()[-3000:]
    log = (tmp_path / "study.log").read_text()
    assert "5 runs (0 aliases), 1 already finished, 4 to run" in log
    assert f"start {second.name} (resuming)" in log
    assert "resumed from" in (second / "launcher.log").read_text()
    assert (first / "done.json").read_text() == done_before
    assert len(_lines(first / "attempts.jsonl")) == 1 and len(_lines(second / "attempts.jsonl")) == 2

    with open(out / "summary.csv") as f:
        rows = {r["name"]: r for r in csv.DictReader(f)}
    assert set(rows) == {
        "recipe-bf16__max_staleness-0",
        "recipe-bf16__max_staleness-1",
        "recipe-int4_qat__max_staleness-0",
        "recipe-int4_qat__max_staleness-1",
        "int4-train_bf16-rollout",
    }
    for r in rows.values():
        assert r["status"] == "done" and int(r["steps"]) == STEPS, r
        for key in ("final_reward", "reward_change", "logp_abs_diff_quant", "kl_k3", "wall_time_s"):
            float(r[key])
    knob = rows["int4-train_bf16-rollout"]
    assert (knob["recipe"], knob["rollout_recipe"], knob["contract_breaking"]) == ("int4_qat", "bf16", "True")
    assert rows["recipe-int4_qat__max_staleness-1"]["contract_breaking"] == "False"
    # Every metrics row of the ablation says so, and no sample was refused: the trainer accepted the
    # bf16 rollouts' fingerprint because the knob named it.
    metrics = _lines(out / "int4-train_bf16-rollout" / "metrics.jsonl")
    assert all(m["contract_breaking"] and m["rollout_recipe"] == "bf16" for m in metrics)
    assert metrics[-1]["dropped_fingerprint"] == 0
    # The trainer's int4 QAT forward differs from the bf16 rollout: a quantization mismatch the
    # matched int4 run (bitwise-identical weights) does not have.
    assert float(knob["logp_abs_diff_quant"]) > 10 * float(
        rows["recipe-int4_qat__max_staleness-1"]["logp_abs_diff_quant"]
    )

    report = (out / "report.md").read_text()
    assert "Contract-breaking ablations" in report and "int4-train_bf16-rollout" in report
    assert (
        "Commit writing this report" in report
        and "the runs ran at: `" in report
        and "Machine:" in report
        and "```yaml" in report
    )
    for png in ("reward_curves.png", "mismatch_vs_staleness.png", "kl_vs_staleness.png", "dropped_vs_staleness.png"):
        assert (out / png).stat().st_size > 1000 and f"]({png})" in report
    assert "| int4_qat |" in report.split("## Figures")[0]  # the table against bf16 has the int4 rows

    # 3. Nothing left to run.
    proc = _tandem_study(cfg, out)
    assert proc.wait(timeout=120) == 0
    assert "5 already finished, 0 to run" in (tmp_path / "study.log").read_text()
