"""The `logging:` writers beside metrics.jsonl, read back from the files they wrote: TensorBoard's
event file (tensorboard's EventAccumulator) and W&B's offline run (its record log parsed here);
a writer's library imported only when it is on, and a missing one named at config time. And the
progress line's ETA, by hand."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.config import LoggingConfig, WandbConfig
from trainer.metrics import MetricsSink, eta_s, format_duration, make_writers

REPO = Path(__file__).resolve().parents[2]
ROWS = [
    {"step": s, "reward_mean": 0.25 * s, "lr": 1e-3 / s, "staleness_hist": {"0": 8}, "contract_breaking": False,
     "rollout_recipe": "nvfp4_moe", **({"eval_greedy_accuracy": 0.5} if s == 2 else {})}
    for s in (1, 2, 3)
]  # fmt: skip


def wandb_records(path: Path) -> list:
    """The protobuf Records of a W&B run file: a 7-byte header (":W&B", magic, version), then LevelDB
    log records (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, records, part = 7, [], b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:  # the block's zero padding
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):
            records.append(pb.Record.FromString(part))
            part = b""
    return records


@pytest.mark.slow
def test_tensorboard_and_wandb_offline_get_every_row(tmp_path, monkeypatch):
    for name in ("WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)  # the writer places them in the run folder
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(tensorboard=True, wandb=WandbConfig(enabled=True))
    writers = make_writers(cfg, tmp_path, name="unit", config={"run_id": "unit", "trainer": {"lr": 1e-3}})
    sink = MetricsSink(tmp_path / "metrics.jsonl", writers=writers)
    for row in ROWS:
        sink.write(row)
    sink.close()
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"reward_mean", "lr", "eval_greedy_accuracy"}  # numbers only
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.step for e in acc.Scalars("eval_greedy_accuracy")] == [2]

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # offline: in the run folder
    records = wandb_records(run_file)
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], h["reward_mean"], h["lr"]) for h in history] == [(s, 0.25 * s, 1e-3 / s) for s in (1, 2, 3)]
    assert history[1]["eval_greedy_accuracy"] == 0.5 and "staleness_hist" not in history[0]
    assert list((tmp_path / "wandb" / "cache" / "wandb" / "logs").glob("core-debug-*.log"))  # not in ~/.cache
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "unit" and run.project == "tandem"


def test_writers_import_their_library_only_when_on_and_a_missing_one_is_named():
    code = """
import sys
from trainer.config import LoggingConfig, WandbConfig
from trainer.metrics import check_writers, make_writers
assert make_writers(LoggingConfig(), ".", name="x", config={}) == []
assert "tensorboard" not in sys.modules and "wandb" not in sys.modules, "imported while off"
sys.modules["wandb"] = None  # as if not installed
try:
    check_writers(LoggingConfig(wandb=WandbConfig(enabled=True)))
except ValueError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == (
        "logging.wandb.enabled=true needs the wandb package, which is not installed (pip install wandb)"
    )
    with pytest.raises(ValueError, match=r"logging.wandb.mode='cloud' \(offline or online\)"):
        WandbConfig(enabled=True, mode="cloud")


def test_eta_is_the_recent_mean_step_time_times_the_steps_left():
    assert eta_s([], 10) is None and eta_s([5.0], 10) is None
    assert eta_s([0.0, 2.0, 6.0], 10) == pytest.approx(30.0)  # (6 - 0) / 2 = 3 s per step
    assert eta_s([0.0, 4.0], 0) == 0.0
    assert [format_duration(s) for s in (None, 0.4, 59.6, 61, 3599, 3600 * 3 + 7 * 60 + 20)] == [
        "?", "0s", "1m00s", "1m01s", "59m59s", "3h07m"
    ]  # fmt: skip


@pytest.mark.slow
def test_tandem_run_without_the_library_is_one_line_and_exit_2_before_any_folder(tmp_path):
    """`tandem run logging.tensorboard=true` where tensorboard is not installed (a module on the path
    that fails to import, as a missing package does)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "tensorboard.py").write_text("raise ImportError('No module named tensorboard')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)])}
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "tandem.cli", "run", "--run-dir", str(run_dir), "logging.tensorboard=true"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip() == (
        "tandem run: logging.tensorboard=true needs the tensorboard package, which is not installed "
        "(pip install tensorboard)"
    )
    assert not run_dir.exists()
