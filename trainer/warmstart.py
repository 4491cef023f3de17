"""Supervised warm start: a few hundred steps of next-token training on correct answers.

RL needs a policy that is sometimes right: from a random init the reward is always 0 and GRPO
has no signal. Stopping supervised training early leaves a policy that is right on a fraction of
the prompts, which is where the demo's RL starts. Simplified: plain cross-entropy on the answer
tokens only, AdamW; the example source is any callable returning (prompt, answer) token lists, so
the trainer stays task-agnostic.

Early stop: with `until` (a score of the model, e.g. held-out sampled accuracy) and `target`, the
score is taken every CHECK_EVERY steps and the warm start ends at the first that reaches `target`,
so RL starts from about the same accuracy whatever the seed.

Learning rate: constant `lr` by default; `warmup` and `kind` give the schedule of `lr_factor`
(bench/make_e2e_model.py: warmup + cosine, a short warmup for a random init and an annealed end).
The trainer's RL steps use the same function (`trainer.lr_schedule`).

Mixed precision: `autocast_dtype` (e.g. torch.bfloat16 on CUDA) wraps each step's forward and loss
in its own autocast region, never the optimizer step: autocast caches its casts of leaf weights for
the life of a region, so one region around the whole loop would run every step with the first
step's bf16 copies of the F.linear weights while AdamW moves their fp32 masters unseen.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from .sequences import pack

Example = tuple[list[int], list[int]]
CHECK_EVERY = 10  # steps between two scores of `until`


def warm_start(
    model,
    sample: Callable[[], Example],
    *,
    steps: int,
    batch: int,
    lr: float,
    pad_id: int,
    warmup: int = 0,
    kind: str = "constant",
    autocast_dtype: torch.dtype | None = None,
    stop: Callable[[], bool] = lambda: False,
    until: Callable[[], float] | None = None,
    target: float = 0.0,
    log: Callable[[str], None] = print,
) -> list[float]:
    """Train `model` in place; returns the loss of every step taken: `stop()` is asked before each
    step, and True ends the warm start there (fewer losses than `steps`); so does `until()` >=
    `target` after every CHECK_EVERY-th step."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: lr_factor(t, steps=steps, warmup=warmup, kind=kind))
    device = next(model.parameters()).device
    losses = []
    t0 = time.time()
    model.train()
    for step in range(steps):
        if stop():
            log(f"warm start stopped after step {step}/{steps}")
            break
        prompts, answers = zip(*(sample() for _ in range(batch)))
        tokens, targets, attn, mask = (t.to(device) for t in pack(prompts, answers, pad_id))
        with torch.autocast(device.type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            logp = model.token_logprobs(tokens, targets, attention_mask=attn)
            loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == steps - 1:
            log(f"warm start step {step + 1}/{steps} loss {losses[-1]:.3f} ({time.time() - t0:.0f}s)")
        if until is not None and (step + 1) % CHECK_EVERY == 0 and _reached(model, until, target, step + 1, log):
            break
    model.eval()
    return losses


def _reached(model, until: Callable[[], float], target: float, step: int, log: Callable[[str], None]) -> bool:
    """`until()` taken in eval mode (then back to training): True when it is >= `target`, logged."""
    model.eval()
    score = until()
    model.train()
    if score < target:
        return False
    log(f"warm start ends after step {step}: score {score:.3f} >= {target}")
    return True


def lr_factor(t: int, *, steps: int, warmup: int = 0, kind: str = "constant", min_ratio: float = 0.0) -> float:
    """lr_t / lr at step t = 0..steps-1, with m = min_ratio and p = (t - warmup) / (steps - warmup):
    (t + 1) / warmup                      t < warmup (linear warmup, whatever the kind)
    1                                     constant (and any kind when steps <= warmup)
    m + (1 - m) * (1 - p)                 linear decay to m at the end
    m + (1 - m) * (1 + cos(pi * p)) / 2   cosine decay to m at the end"""
    if t < warmup:
        return (t + 1) / warmup
    if kind == "constant" or steps <= warmup:
        return 1.0
    p = min(1.0, (t - warmup) / (steps - warmup))
    decay = 1 - p if kind == "linear" else (1 + math.cos(math.pi * p)) / 2
    return min_ratio + (1 - min_ratio) * decay
