"""trainer.warmstart: the learning-rate schedule by hand, and a warm start that teaches a task."""

from __future__ import annotations

import math
import random

import pytest
import torch

from policy.model import ModelConfig, Transformer
from rollout.tasks import AdditionTask
from trainer.warmstart import lr_factor, warm_start


def test_lr_factor_warmup_then_cosine_to_zero():
    f = [lr_factor(t, steps=6, warmup=2, cosine=True) for t in range(6)]
    # warmup 1/2, 2/2; then (1 + cos(pi * k / 4)) / 2 for k = 0..3
    want = [0.5, 1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2]
    assert f == pytest.approx(want, abs=1e-12)
    assert [lr_factor(t, steps=6) for t in range(6)] == [1.0] * 6  # the trainer's default: constant
    assert [lr_factor(t, steps=4, warmup=2) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_warm_start_lowers_the_loss_under_the_schedule():
    task = AdditionTask(digits=1, seed=0)
    cfg = ModelConfig.preset("tiny", n_layers=1, vocab_size=max(64, task.tokenizer.vocab_size))
    model = Transformer(cfg, seed=0)
    rng = random.Random(0)

    def example():
        p = task.example(rng)
        return p.tokens, p.reference

    torch.manual_seed(0)
    losses = warm_start(model, example, steps=20, batch=8, lr=3e-3, pad_id=0, warmup=3, cosine=True, log=lambda s: None)
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0]
