"""A task's prompt and the held-out split, shared by every task (rollout.tasks, rollout.jsonl_task).

`is_heldout(text, fraction)` is a pure function of the prompt text, so the trainer, every rollout
worker and every restart split the prompt space the same way: the held-out prompts are those that
`Task.prompt` and `Task.example` never give, and `Task.heldout_prompt` gives only them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Prompt:
    """One prompt of a task: its token ids, the fields its verifier needs, a reference completion."""

    tokens: list[int]  # the prompt as the model sees it (with <bos> where the task uses one)
    fields: dict[str, Any]  # travels with the prompt group to `Task.score`, e.g. {"answer": "15"}
    reference: list[int]  # a correct completion (with <eos>), for the supervised warm start


def is_heldout(text: str, fraction: float) -> bool:
    """Whether a prompt text is held out for evaluation: the first 8 bytes of its sha256, read as a
    number in [0, 1), fall below `fraction`. A pure function of the text: the same split everywhere."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64 < fraction
