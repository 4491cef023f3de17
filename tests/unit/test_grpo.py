"""GRPO pieces: advantages, the decoupled PPO + TIS loss, mismatch metrics, batch packing."""

from __future__ import annotations

import math

import pytest
import torch

from trainer import grpo
from trainer.sequences import pack, scatter_rows


def test_group_advantages_normalize_within_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5])
    a = grpo.group_advantages(r, 4)
    assert torch.allclose(a[:4], torch.tensor([3.0, -1.0, -1.0, -1.0]) / math.sqrt(3), atol=1e-5)
    assert torch.equal(a[4:], torch.zeros(4))  # equal rewards: no signal, no NaN


def test_policy_loss_matches_hand_computation_and_clips():
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    prox = torch.tensor([[-1.0, -1.0, -1.0]])
    behav = torch.tensor([[-1.0, -3.0, 0.0]])  # token 2: prox/behav = e^2 > cap
    new = torch.tensor([[-1.0 + math.log(1.5), -1.0, 5.0]], requires_grad=True)  # token 1: ratio 1.5
    adv = torch.tensor([2.0])
    loss, stats = grpo.policy_loss(new, prox, behav, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    # token 1: w = 1, min(1.5*2, 1.28*2) = 2.56; token 2: w = 2 (capped), ratio 1 -> 2; masked token ignored
    assert loss.item() == pytest.approx(-(2.56 + 2 * 2.0) / 2)
    loss.backward()
    assert new.grad[0, 0].item() == 0.0  # clipped: no gradient through the ratio
    assert new.grad[0, 2].item() == 0.0  # masked
    assert stats["clip_frac"] == pytest.approx(0.5) and stats["tis_frac"] == pytest.approx(0.5)


def test_policy_loss_negative_advantage_clips_below():
    mask = torch.ones(1, 1)
    zero = torch.zeros(1, 1)
    new = torch.full((1, 1), math.log(0.5), requires_grad=True)  # ratio 0.5 < 1 - 0.2
    loss, _ = grpo.policy_loss(new, zero, zero, torch.tensor([-1.0]), mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    assert loss.item() == pytest.approx(0.8)  # -min(0.5 * -1, 0.8 * -1)
    loss.backward()
    assert new.grad.item() == 0.0


def test_mismatch_metrics_decompose():
    mask = torch.tensor([[1.0, 1.0]])
    behav = torch.tensor([[-1.0, -2.0]])
    at_v = torch.tensor([[-1.1, -2.0]])
    prox = torch.tensor([[-1.1, -1.5]])
    m = grpo.mismatch_metrics(prox, behav, at_v, mask)
    assert m["logp_abs_diff"] == pytest.approx(0.3)
    assert m["logp_abs_diff_quant"] == pytest.approx(0.05)
    assert m["logp_abs_diff_stale"] == pytest.approx(0.25)
    d = torch.tensor([-0.1, 0.5])
    assert m["kl_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))


def test_mismatch_percentiles_and_rows_of_unknown_versions():
    # Row 0's version is known (|quant| per token 0.1, 0.0, 0.3), row 1's is not (from before a restart).
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    behav = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    at_v = torch.tensor([[-1.1, -2.0, -2.7], [-5.0, -5.0, -9.0]])
    prox = at_v.clone()
    m = grpo.mismatch_metrics(prox, behav, at_v, mask, version_known=torch.tensor([True, False]))
    assert m["logp_abs_diff_quant"] == pytest.approx(0.4 / 3)  # row 1's 4.0s are left out
    assert m["logp_abs_diff_quant_p50"] == pytest.approx(0.1)
    assert m["logp_abs_diff_quant_p95"] == pytest.approx(0.1 + 0.9 * 0.2)  # linear between 0.1 and 0.3
    assert m["logp_abs_diff"] == pytest.approx((0.4 + 8.0) / 5)  # the total keeps every row
    none = grpo.mismatch_metrics(prox, behav, at_v, mask, version_known=torch.tensor([False, False]))
    assert sorted(none) == ["kl_k3", "logp_abs_diff"]  # the split over no token is absent, not NaN


def test_tokens_on_stale_kv_are_left_out_of_the_split_and_reported_apart():
    # One row, 3 tokens; |quant| per token 0.1, 0.2, 0.6; the last two were sampled on older KV.
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    behav = torch.tensor([[-1.0, -2.0, -3.0]])
    at_v = torch.tensor([[-1.1, -2.2, -3.6]])
    kv = torch.tensor([[False, True, True]])
    m = grpo.mismatch_metrics(at_v, behav, at_v, mask, version_known=torch.ones(1, 3, dtype=torch.bool), stale_kv=kv)
    assert m["logp_abs_diff_quant"] == pytest.approx(0.1) and m["logp_abs_diff_stale"] == 0.0
    assert m["logp_abs_diff_stale_kv"] == pytest.approx(0.4)
    assert m["logp_abs_diff"] == pytest.approx(0.3)  # the total keeps every token
    # Per-token known: an unknown token is in neither part.
    known = torch.tensor([[True, False, True]])
    m = grpo.mismatch_metrics(at_v, behav, at_v, mask, version_known=known, stale_kv=kv)
    assert m["logp_abs_diff_stale_kv"] == pytest.approx(0.6) and m["logp_abs_diff_quant"] == pytest.approx(0.1)
    assert "logp_abs_diff_stale_kv" not in grpo.mismatch_metrics(
        at_v, behav, at_v, mask, stale_kv=torch.zeros(1, 3, dtype=torch.bool)
    )


def test_pack_aligns_targets_and_completion_mask():
    tokens, targets, attn, mask = pack([[1, 5, 6], [1, 7]], [[8, 2], [9, 9, 2]], pad_id=0)
    assert tokens.tolist() == [[1, 5, 6, 8], [1, 7, 9, 9]]
    assert targets.tolist() == [[5, 6, 8, 2], [7, 9, 9, 2]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert attn.tolist() == [[True] * 4, [True] * 4]
    lp = scatter_rows([[-0.5, -0.25], [-1.0, -2.0, -3.0]], mask)
    assert lp.tolist() == [[0, 0, -0.5, -0.25], [0, -1.0, -2.0, -3.0]]
    with pytest.raises(ValueError, match="row 0: 1 values for 2 completion tokens"):
        scatter_rows([[-0.5], [-1.0, -2.0, -3.0]], mask)
