"""trainer.warmstart: the learning-rate schedule by hand, and a warm start that teaches a task."""

from __future__ import annotations

import math
import random

import pytest
import torch

from policy.model import ModelConfig, Transformer
from rollout.tasks import AdditionTask
from trainer.sequences import pack
from trainer.warmstart import lr_factor, warm_start


def test_lr_factor_warmup_then_cosine_to_zero():
    f = [lr_factor(t, steps=6, warmup=2, kind="cosine") for t in range(6)]
    # warmup 1/2, 2/2; then (1 + cos(pi * k / 4)) / 2 for k = 0..3
    want = [0.5, 1.0, 1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2]
    assert f == pytest.approx(want, abs=1e-12)
    assert [lr_factor(t, steps=6) for t in range(6)] == [1.0] * 6  # the trainer's default: constant
    assert [lr_factor(t, steps=4, warmup=2) for t in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_lr_factor_linear_and_cosine_decay_to_the_floor():
    # linear, no warmup, 5 steps, floor 0.2: 0.2 + 0.8 * (1 - t / 5)
    lin = [lr_factor(t, steps=5, kind="linear", min_ratio=0.2) for t in range(5)]
    assert lin == pytest.approx([1.0, 0.84, 0.68, 0.52, 0.36], abs=1e-12)
    # cosine after 1 warmup step, 5 steps, floor 0.5: 0.5 + 0.5 * (1 + cos(pi * k / 4)) / 2, k = t - 1
    cos = [lr_factor(t, steps=5, warmup=1, kind="cosine", min_ratio=0.5) for t in range(5)]
    assert cos == pytest.approx(
        [1.0, 1.0, 0.5 + 0.25 * (1 + math.cos(math.pi / 4)), 0.75, 0.5 + 0.25 * (1 + math.cos(3 * math.pi / 4))],
        abs=1e-12,
    )
    assert lr_factor(10, steps=5, kind="linear", min_ratio=0.1) == pytest.approx(0.1)  # past the end: the floor


def test_warm_start_lowers_the_loss_under_the_schedule():
    task = AdditionTask(digits=1, seed=0)
    cfg = ModelConfig.preset("tiny", n_layers=1, vocab_size=max(64, task.tokenizer.vocab_size))
    model = Transformer(cfg, seed=0)
    rng = random.Random(0)

    def example():
        p = task.example(rng)
        return p.tokens, p.reference

    torch.manual_seed(0)
    losses = warm_start(
        model, example, steps=20, batch=8, lr=3e-3, pad_id=0, warmup=3, kind="cosine", log=lambda s: None
    )
    assert len(losses) == 20 and losses[-1] < 0.5 * losses[0]


def test_warm_start_under_autocast_computes_with_the_current_weights():
    """Step k's loss is that of the weights after k steps: a model trained k steps and evaluated on
    step k's batch in a fresh bf16 autocast region gives it. One autocast region around the whole
    loop would fail this: its cached bf16 casts are the first step's weights (the H200 warm start)."""
    task = AdditionTask(digits=1, seed=0)
    cfg = ModelConfig.preset("tiny", n_layers=1, vocab_size=max(64, task.tokenizer.vocab_size))

    def train(steps):
        model, rng, batches = Transformer(cfg, seed=0), random.Random(0), []

        def example():
            p = task.example(rng)
            batches.append((p.tokens, p.reference))
            return batches[-1]

        losses = warm_start(
            model, example, steps=steps, batch=8, lr=3e-3, pad_id=0, autocast_dtype=torch.bfloat16, log=lambda s: None
        )
        return model, losses, batches

    _, losses, batches = train(4)
    model, _, _ = train(3)
    tokens, targets, attn, mask = pack(*zip(*batches[-8:]), 0)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp = model.token_logprobs(tokens, targets, attention_mask=attn)
    assert float(-(logp * mask).sum() / mask.sum()) == pytest.approx(losses[-1], abs=1e-4)
    assert losses[-1] != pytest.approx(losses[0], abs=1e-2)  # the weights moved


def test_a_stop_request_ends_the_warm_start_between_steps():
    task = AdditionTask(digits=1, seed=0)
    model = Transformer(ModelConfig.preset("tiny", n_layers=1, vocab_size=max(64, task.tokenizer.vocab_size)), seed=0)
    rng, asked, lines = random.Random(0), [], []

    def example():
        p = task.example(rng)
        return p.tokens, p.reference

    def stop() -> bool:  # asked before each step: True at the fourth question
        asked.append(1)
        return len(asked) == 4

    losses = warm_start(model, example, steps=1000, batch=2, lr=1e-3, pad_id=0, stop=stop, log=lines.append)
    assert len(losses) == 3 and len(asked) == 4 and lines[-1] == "warm start stopped after step 3/1000"
    assert not model.training  # left in eval mode, as after a whole warm start


def test_the_warm_start_ends_at_the_first_check_that_reaches_the_target():
    """`until` is taken after steps 10, 20, 30, ... in eval mode; the first score >= target ends it."""
    task = AdditionTask(digits=1, seed=0)
    model = Transformer(ModelConfig.preset("tiny", n_layers=1, vocab_size=max(64, task.tokenizer.vocab_size)), seed=0)
    rng, scores, lines, forwards, taken = random.Random(0), iter([0.1, 0.39, 0.4, 0.9]), [], [], []
    original = model.token_logprobs

    def example():
        p = task.example(rng)
        return p.tokens, p.reference

    def counted(*args, **kwargs):  # one forward per step: how many steps came before each score
        forwards.append(1)
        return original(*args, **kwargs)

    def until() -> float:
        taken.append((model.training, len(forwards)))
        return next(scores)

    model.token_logprobs = counted
    losses = warm_start(
        model, example, steps=1000, batch=2, lr=1e-3, pad_id=0, until=until, target=0.4, log=lines.append
    )
    assert len(losses) == 30 and taken == [(False, 10), (False, 20), (False, 30)]
    assert lines[-1] == "warm start ends after step 30: score 0.400 >= 0.4"
    assert not model.training
