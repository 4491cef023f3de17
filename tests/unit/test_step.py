"""trainer.step's pure parts by hand: the staleness figures of a step and the learning rate of a step;
trainer.metrics.progress_line; trainer.checkpoints.Checkpointer on a real folder."""

from __future__ import annotations

import pytest
import torch

from trainer.checkpoints import Checkpointer, checkpoints
from trainer.config import LRSchedule, TrainerConfig
from trainer.metrics import progress_line
from trainer.step import lr_at, staleness_stats


def test_staleness_is_version_minus_each_samples_version():
    assert staleness_stats(5, [5, 4, 4, 3]) == {
        "staleness_mean": 1.0,
        "staleness_max": 2,
        "staleness_hist": {"0": 1, "1": 2, "2": 1},
    }
    assert staleness_stats(1, [1, 1]) == {"staleness_mean": 0.0, "staleness_max": 0, "staleness_hist": {"0": 2}}


def test_the_learning_rate_follows_the_schedule_from_the_step_alone():
    cfg = TrainerConfig(lr=1e-3, max_steps=10, lr_schedule=LRSchedule(kind="linear", warmup_steps=2, min_lr_ratio=0.1))
    # warmup: lr / warmup_steps, then 2 x, then linear decay to 0.1 x lr at step 10
    assert lr_at(cfg, 0) == pytest.approx(5e-4)
    assert lr_at(cfg, 1) == pytest.approx(1e-3)
    assert lr_at(cfg, 10) == pytest.approx(1e-4)
    assert lr_at(cfg, 2) > lr_at(cfg, 6) > lr_at(cfg, 9)
    assert lr_at(TrainerConfig(lr=3e-4), 57) == 3e-4  # constant


ROW = {
    "step": 3, "policy_version": 2, "reward_mean": 0.5, "staleness_mean": 0.75, "staleness_max": 1,
    "dropped_stale": 4, "dropped_fingerprint": 0, "logp_abs_diff": 0.01234, "kl_k3": 0.000123,
    "lr": 3e-4, "step_time_s": 1.5,
}  # fmt: skip


def test_progress_line_reads_na_for_a_split_over_no_known_sample():
    line = progress_line(ROW, max_steps=10, eta_s=75)
    assert line == (
        "step    3/10 v2 reward 0.500 staleness 0.75/1 dropped 4s/0f |dlogp| 0.0123 (quant n/a) kl 0.00012 "
        "lr 3.00e-04 1.50s eta 1m15s"
    )
    split = progress_line({**ROW, "logp_abs_diff_quant": 0.002, "logp_abs_diff_stale": 0.01}, max_steps=10, eta_s=None)
    assert "(quant 2.0e-03 stale 0.0100)" in split and split.endswith("eta ?")


def test_checkpointer_keeps_the_newest_and_refuses_another_contract(tmp_path):
    folder = tmp_path / "checkpoints"
    ckpt = Checkpointer(folder, keep=2, log=print)
    assert ckpt.load_latest("abc") is None and ckpt.newest_step == -1
    for step in (1, 2, 3):
        assert ckpt.save(step, {"state": {"step": step}, "fingerprint": "abc", "w": torch.arange(step)})
    assert [p.name for p in checkpoints(folder)] == ["step-000002.pt", "step-000003.pt"]
    (folder / "step-000004.pt.tmp").write_bytes(b"cut short")  # a write killed midway
    again = Checkpointer(folder, keep=2, log=print)
    path, content = again.load_latest("abc")
    assert path.name == "step-000003.pt" and content["w"].tolist() == [0, 1, 2] and again.newest_step == 3
    assert not (folder / "step-000004.pt.tmp").exists()
    with pytest.raises(ValueError, match="contract fingerprint abc, this run's is xyz"):
        again.load_latest("xyz")


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_false(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    lines = []
    ckpt = Checkpointer(blocker / "checkpoints", keep=2, log=lines.append)  # a folder under a file: OSError
    assert not ckpt.save(1, {"state": {"step": 1}, "fingerprint": "abc"})
    assert ckpt.newest_step == -1
    assert len(lines) == 1 and lines[0].startswith("checkpoint step-000001.pt not written")
