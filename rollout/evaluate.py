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
from .prompts import Prompt
from .tasks import Task


@torch.no_grad()
def accuracy(model: Transformer, task: Task, prompts: list[Prompt], *, temperature: float, seed: int = 0) -> float:
    """The mean score of one completion per prompt, greedy at temperature 0, else sampled with the
    fixed per-row seeds `seed + i`."""
    tok = task.tokenizer
    gen = generate(
        model,
        [p.tokens for p in prompts],
        max_new_tokens=task.max_new_tokens,
        temperature=temperature,
        seeds=[seed + i for i in range(len(prompts))] if temperature > 0 else None,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
    )
    return sum(task.score(c, p.fields) for c, p in zip(gen.completions(), prompts)) / len(prompts)


def heldout_accuracy(model: Transformer, task: Task, *, k: int, temperature: float, seed: int = 0) -> dict:
    """{"eval_greedy_accuracy", "eval_sampled_accuracy"}: `accuracy` over k held-out prompts at
    temperature 0 and at `temperature`."""
    prompts = [task.heldout_prompt(i) for i in range(k)]
    return {
        "eval_greedy_accuracy": accuracy(model, task, prompts, temperature=0.0, seed=seed),
        "eval_sampled_accuracy": accuracy(model, task, prompts, temperature=temperature, seed=seed),
    }
