"""Held-out evaluation: greedy and sampled accuracy of a policy model on a task's held-out prompts.

The prompts are `task.heldout_prompt(i)` for i = 0..k-1, the same at every evaluation; completions
come from the CPU engine's path (rollout.engine.generate, on the model's device) and are scored by
the task's verifier. Sampled completions draw from fixed per-row seeds (`seed + i`): the same
noise at every evaluation, so a change of accuracy is a change of the policy.
"""

from __future__ import annotations

import torch

from policy.model import Transformer

from .engine import generate
from .tasks import Task


@torch.no_grad()
def heldout_accuracy(model: Transformer, task: Task, *, k: int, temperature: float, seed: int = 0) -> dict:
    """{"eval_greedy_accuracy", "eval_sampled_accuracy"}: the mean score over k held-out prompts at
    temperature 0 and at `temperature`."""
    prompts = [task.heldout_prompt(i) for i in range(k)]
    tok = task.tokenizer
    out = {}
    for name, temp in (("eval_greedy_accuracy", 0.0), ("eval_sampled_accuracy", temperature)):
        gen = generate(
            model,
            [p.tokens for p in prompts],
            max_new_tokens=task.max_new_tokens,
            temperature=temp,
            seeds=[seed + i for i in range(k)] if temp > 0 else None,
            eos_id=tok.eos_id,
            pad_id=tok.pad_id,
        )
        out[name] = sum(task.score(c, p.fields) for c, p in zip(gen.completions(), prompts)) / k
    return out
