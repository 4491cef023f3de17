"""trainer.step's pure parts by hand: the staleness figures of a step and the learning rate of a step;
trainer.metrics.progress_line; trainer.checkpoints.Checkpointer on a real folder."""

from __future__ import annotations

import pytest
import torch

from trainer.checkpoints import Checkpointer, checkpoints
from trainer.config import LRSchedule, TrainerConfig
from trainer.metrics import progress_line
from trainer.step import lr_at, route_agreement, routing_metrics, stale_kv, staleness_stats, token_stats
from trainer.versions import per_token


def test_staleness_is_version_minus_each_samples_version():
    assert staleness_stats(5, [5, 4, 4, 3]) == {
        "staleness_mean": 1.0,
        "staleness_max": 2,
        "staleness_hist": {"0": 1, "1": 2, "2": 1},
    }
    assert staleness_stats(1, [1, 1]) == {"staleness_mean": 0.0, "staleness_max": 0, "staleness_hist": {"0": 2}}


# Two rows [B=2, T=4]; row 0's completion is targets 1..3 with versions 3, 4, 4 (in-flight: it spans
# two), row 1's targets 2..3, both at version 5. The trainer is at version 6, max_staleness 2.
MASK = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
TV = torch.tensor([[0, 3, 4, 4], [0, 0, 5, 5]])


def test_token_staleness_metrics_by_hand():
    got = token_stats(6, TV, MASK, max_staleness=2)
    # staleness per token: 3, 2, 2 and 1, 1 -> mean 9/5; one token (3 old) over the bound of 2
    assert got == {
        "token_staleness_mean": pytest.approx(9 / 5),
        "tokens_over_max_staleness_frac": pytest.approx(1 / 5),
        "samples_multi_version": 1,
        "tokens_on_stale_kv": 2,  # row 0's v4 tokens attend to the v3 prompt KV and token
    }
    assert token_stats(5, TV, MASK, max_staleness=2)["tokens_over_max_staleness_frac"] == 0.0
    assert stale_kv(TV, MASK).tolist() == [[False, False, True, True], [False, False, False, False]]


def test_each_token_takes_the_recompute_of_its_own_version():
    fallback = torch.full((2, 4), -9.0)
    by_version = {
        3: (torch.tensor([0]), torch.tensor([[-3.0, -3.25, -3.5, -3.75]])),  # row 0 under v3
        4: (torch.tensor([0]), torch.tensor([[-4.0, -4.25, -4.5, -4.75]])),  # row 0 under v4
        # v5 not held (from before a restart): row 1 keeps the fallback, unknown
    }
    out, known = per_token(TV, by_version, fallback)
    assert out.tolist() == [[-9.0, -3.25, -4.5, -4.75], [-9.0, -9.0, -9.0, -9.0]]
    assert known.tolist() == [[False, True, True, True], [False, False, False, False]]
    # A version's rows may be all of them (the current weights: prox): each still picks its own tokens.
    prox = torch.full((2, 4), -5.0)
    out, known = per_token(TV, {**by_version, 5: (torch.arange(2), prox)}, fallback)
    assert out[1].tolist() == [-9.0, -9.0, -5.0, -5.0] and out[0].tolist() == [-9.0, -3.25, -4.5, -4.75]
    assert (known == (MASK > 0)).all()


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


def test_split_rows_spreads_k_rows_evenly_or_takes_all():
    from trainer.step import split_rows

    assert split_rows(8, 0).tolist() == list(range(8))
    assert split_rows(8, 8).tolist() == list(range(8)) == split_rows(8, 20).tolist()
    assert split_rows(8, 2).tolist() == [0, 4]
    assert split_rows(10, 3).tolist() == [0, 3, 6]
    assert split_rows(256, 32).tolist() == list(range(0, 256, 8))


def test_route_agreement_compares_expert_sets_per_token_and_layer_by_hand():
    # 1 row, 3 positions (the last is a prompt/pad position), 2 MoE layers, k = 2.
    replayed = torch.tensor([[[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[1, 1], [1, 1]]]])
    own = torch.tensor([[[[2, 1], [3, 4]], [[5, 6], [7, 2]], [[0, 3], [2, 4]]]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    c = route_agreement(own, replayed, mask)
    # token 0: both layers equal as sets ([2, 1] is {1, 2}); token 1: layer 1 differs; token 2: masked.
    assert {k: int(v) for k, v in c.items()} == {"pairs": 4, "pairs_agree": 3, "tokens": 2, "tokens_agree": 1}
    assert routing_metrics(c) == {"router_agree_frac": 0.75, "tokens_routed_as_rollout_frac": 0.5}
    assert routing_metrics({}) == {"router_agree_frac": 1.0, "tokens_routed_as_rollout_frac": 1.0}
