"""bench/e2e_report.py's per-step figures, hand-checked on a run folder written here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_spec = importlib.util.spec_from_file_location("e2e_report", Path(__file__).parents[2] / "bench" / "e2e_report.py")
e2e_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e_report)


def _row(step, time, step_time, publish):
    return {
        "step": step, "policy_version": step + 1, "time": time, "step_time_s": step_time, "publish_s": publish,
        "staleness_mean": 1.0, "logp_abs_diff": 0.0, "logp_abs_diff_quant": 0.0, "logp_abs_diff_stale": 0.0,
        "reward_mean": 0.0, "completion_tokens": 64,
    }  # fmt: skip


def test_per_step_means_cover_the_same_window_as_wall_per_step(tmp_path: Path):
    # Row k's timers describe the interval (row k-1, row k]. With --skip 1 the window is rows 2..4:
    # wall = (130 - 100) / 2 = 15; the per-step means take rows 3 and 4 only (row 2's interval,
    # with its 40 s first publish, lies before the window).
    rows = [_row(1, 60.0, 5.0, 30.0), _row(2, 100.0, 5.0, 40.0), _row(3, 116.0, 6.0, 9.0), _row(4, 130.0, 4.0, 9.0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = e2e_report.summarize(tmp_path, skip=1)
    assert r["wall_per_step_s"] == 15.0
    assert r["step_time_s"] == 5.0  # (6 + 4) / 2
    assert r["train_per_step_s"] == 14.0  # (6 + 9 + 4 + 9) / 2
    assert r["steady_steps"] == 3


def _run(folder: Path, rows: list[dict], *, recipe: str, backend: str | None) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = {"groups_per_step": 2} | ({"backend": backend} if backend else {})
    (folder / "config.yaml").write_text(json.dumps({"recipe": recipe, "num_rollout_workers": 1, "trainer": trainer}))
    return folder


def test_the_megatron_run_is_its_own_ideal_and_named_by_its_backend(tmp_path: Path):
    rows = [_row(1, 0.0, 5.0, 1.0), _row(2, 10.0, 5.0, 1.0), _row(3, 20.0, 5.0, 1.0)]
    slow = [_row(1, 0.0, 9.0, 1.0), _row(2, 12.0, 9.0, 1.0), _row(3, 24.0, 9.0, 1.0)]
    sync = e2e_report.summarize(_run(tmp_path / "sync", rows, recipe="nvfp4_moe", backend=None), skip=0)
    meg = e2e_report.summarize(_run(tmp_path / "megatron", slow, recipe="nvfp4_moe", backend="megatron"), skip=0)
    asy = e2e_report.summarize(_run(tmp_path / "async", slow, recipe="nvfp4_moe", backend="torch"), skip=0)
    assert (sync["backend"], meg["backend"], asy["backend"]) == ("torch", "megatron", "torch")
    text = e2e_report.table([sync, meg, asy], sync)
    assert "| megatron | nvfp4_moe (megatron) |" in text and "| async | nvfp4_moe |" in text
    assert meg["ideal_per_step_s"] == 10.0  # its own train/step (9 + 1): the sync run has the torch backend
    assert asy["ideal_per_step_s"] == 6.0  # the synchronous run's (5 + 1)
    assert asy["wall_over_ideal"] == 2.0  # 12 / 6


def test_the_warm_start_evaluation_comes_from_model_json(tmp_path: Path):
    run = _run(tmp_path / "async", [_row(1, 0.0, 5.0, 1.0), _row(2, 10.0, 5.0, 1.0)], recipe="bf16", backend=None)
    assert e2e_report.summarize(run, skip=0)["warmstart_eval"] is None
    ev = {"sampled": {"temperature": 1.0, "reward_mean": 0.25, "eos_frac": 0.9, "mean_len": 2.5}}
    (run / "model.json").write_text(json.dumps({"args": {}, "eval": ev}))
    assert e2e_report.summarize(run, skip=0)["warmstart_eval"] == ev
    assert e2e_report.main([str(run)]) == 0


def test_live_lines_and_the_swap_split_are_read(tmp_path: Path):
    (tmp_path / "logs").mkdir()
    line = (
        "w0: policy v{v} live (4381011968 bytes, {t}s, {t}s after publish); under v{p}: 2 groups, 512 tokens in "
        "0.50s generating; receive {r}s, verify 0.20s, drain_wait 0.00s, h2d 0.41s, swap 0.00s (in place, 1 stream(s))"
    )
    old = (
        "w0: policy v1 live (10 bytes, 9.00s, 9.50s after publish); under vNone: 0 groups, 0 tokens in 0.00s generating"
    )
    lines = [old, line.format(v=2, t="4.60", p=1, r="3.70"), line.format(v=3, t="5.00", p=2, r="4.10")]
    (tmp_path / "logs" / "rollout-0.log").write_text("\n".join(lines) + "\n")
    live = e2e_report.read_live(tmp_path)
    assert [e["version"] for e in live] == [1, 2, 3] and "receive_s" not in live[0]  # a line from before the split
    assert live[1]["receive_s"] == 3.70 and live[2]["h2d_s"] == 0.41 and live[2]["after_publish_s"] == 5.0
