"""Built-in task: multi-digit addition with a programmatic verifier and a character tokenizer.

Chosen because a 1-5M parameter model learns it on a CPU in minutes, its reward is exact
(no learned judge), and difficulty is one knob (`digits`). A prompt is "<bos>123+45=" and a
correct completion is "168<eos>". The reward is 1.0 for the exact answer followed by <eos>,
else 0.0: GRPO normalizes within a group, so a binary verifier is enough signal once the
warm-started policy is sometimes right.

The tokenizer is part of the model contract (its size is the model's vocab), so trainer and
rollout both build it from this module's constants.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+="


class CharTokenizer:
    """Character-level: ids 0..2 are <pad>, <bos>, <eos>; then one id per character of CHARS."""

    def __init__(self, chars: str = CHARS):
        self.itos = [PAD, BOS, EOS, *chars]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
        unknown = sorted({c for c in text if c not in self.stoi})
        if unknown:
            raise ValueError(f"text {text!r} has characters outside the vocabulary: {unknown}")
        return [self.bos_id] * bos + [self.stoi[c] for c in text] + [self.eos_id] * eos

    def decode(self, ids) -> str:
        """Characters up to the first <eos>; special tokens and out-of-range ids are dropped."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if 3 <= i < len(self.itos):
                out.append(self.itos[i])
        return "".join(out)


@dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """a+b with each operand drawn uniformly from 1..`digits` digits."""

    digits: int = 2

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise ValueError(f"AdditionTask.digits={self.digits} must be in 1..9")

    @property
    def max_answer_tokens(self) -> int:
        return self.digits + 2  # carry digit + <eos>

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """(prompt text, answer text), e.g. ("123+45=", "168")."""
        a, b = (rng.randint(0, 10 ** rng.randint(1, self.digits) - 1) for _ in range(2))
        return f"{a}+{b}=", str(a + b)

    @staticmethod
    def reward(completion_text_until_eos: str, ended_with_eos: bool, answer: str) -> float:
        return 1.0 if ended_with_eos and completion_text_until_eos == answer else 0.0

    def score(self, tok: CharTokenizer, completion_ids, answer: str) -> float:
        """The verifier on raw completion token ids."""
        ids = list(completion_ids)
        ended = tok.eos_id in ids
        return self.reward(tok.decode(ids), ended, answer)
