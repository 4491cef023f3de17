"""Can this worker run a decoded prompt group? A pure function of the group and the worker's limits.

The codec only says that an entry is well formed (and the signature that the trainer sent it). A
well-formed prompt can still crash a worker: a token id past the embedding table (IndexError in the
prefill), a prompt that with the task's new tokens does not fit a KV slot (ValueError at submit), task
fields the verifier needs missing (KeyError when scoring), a group size the trainer will refuse after
it was generated. `check_prompt` runs on every record before it touches the engine; a group it refuses
is dead-lettered alone, with the reason, and counted, and the worker goes on.

Rules, each with the reason string it returns (the first that fails):
    n_samples      == group_size where the run's is known (the trainer refuses any other size after
                   it was generated), else 1..max_batch (the KV slots)
    0 <= token id < vocab_size                                   (the embedding table's rows)
    len(prompt) + max_new_tokens <= max_seq_len                  (a KV slot: the engine's capacity)
    task fields    what the task's `check_fields(fields)` says (None = fine), where the task has one
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from broker.codec import PromptGroup
from policy.fields import is_int


@dataclass(frozen=True, kw_only=True)
class PromptRules:
    vocab_size: int  # token ids must be < this (the model's embedding rows)
    max_seq_len: int  # prompt + new tokens of one sample (the model's context, or the KV slot's on cuda)
    max_new_tokens: int  # the task's generation limit
    max_batch: int  # KV slots (rollout.max_batch)
    group_size: int | None = None  # the run's GRPO group size (trainer.group_size); None = not known here

    def __post_init__(self) -> None:
        errors = [
            f"{name}={getattr(self, name)!r} (must be an int >= 1)"
            for name in ("vocab_size", "max_seq_len", "max_new_tokens", "max_batch")
            if not is_int(getattr(self, name), lo=1)
        ]
        if self.group_size is not None and not is_int(self.group_size, lo=1):
            errors.append(f"group_size={self.group_size!r} (must be an int >= 1, or None)")
        if errors:
            raise ValueError("PromptRules: " + "; ".join(errors))


def check_prompt(
    group: PromptGroup, rules: PromptRules, *, check_fields: Callable[[dict[str, Any]], str | None] | None = None
) -> str | None:
    """None when this worker can generate and score `group`; else one line saying what is wrong.

    `check_fields` is the task's own check of `group.task` (e.g. `AdditionTask.check_fields`)."""
    n = group.n_samples
    if rules.group_size is not None:
        if n != rules.group_size:
            return f"n_samples={n}, the run's group size is {rules.group_size}"
    elif not 1 <= n <= rules.max_batch:
        return f"n_samples={n} (want 1..{rules.max_batch}, the KV slots)"
    tokens = group.prompt_tokens
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= rules.vocab_size:
        return f"prompt token ids in [{lo}, {hi}], vocab is [0, {rules.vocab_size})"
    if len(tokens) + rules.max_new_tokens > rules.max_seq_len:
        return f"{len(tokens)} prompt tokens + {rules.max_new_tokens} new > max_seq_len={rules.max_seq_len}"
    if check_fields is not None:
        reason = check_fields(group.task)
        if reason is not None:
            return f"task fields: {reason}"
    return None
