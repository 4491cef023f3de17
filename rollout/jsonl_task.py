"""Task `jsonl`: RL on a user's prompt file, one JSON object per line, with a built-in verifier.

    task: {name: jsonl, path: configs/data/arith.jsonl, prompt_field: question, answer_field: answer,
           tokenizer: configs/data/arith_tokenizer, verifier: numeric, tolerance: 1.0e-6,
           max_new_tokens: 16, chat_template: false}

Verifiers, on the completion decoded up to the first eos (a completion that never ends gets 0):
  exact    1.0 if the completion, stripped of surrounding whitespace, equals the answer (stripped).
  numeric  1.0 if the last number in the completion is within `tolerance` of the last number in the
           answer field (so GSM8K's "... #### 42" works as is). Numbers: optional sign, digits with
           optional thousands commas, optional decimals.
Prompt i is row `perm_e[i mod n]` of epoch e = i // n (`perm_e` a shuffle of the n rows seeded by
(seed, e)): a pure function of (seed, i), every row once per epoch. Held out for evaluation: the rows
of `heldout_path` (their prompt texts left out of training), or the rows `is_heldout` under
`heldout_fraction`. The whole file is read and checked at start (errors name the line). Custom
verifiers: a `module:attr` task factory (rollout.tasks), which may wrap `JsonlTask`."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policy.fields import is_int, is_number

from .hf_tokenizer import HFTokenizer
from .prompts import Prompt, is_heldout

__all__ = ["VERIFIERS", "JsonlTask", "last_number", "read_rows"]

VERIFIERS = ("exact", "numeric")
_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def last_number(text: str) -> float | None:
    """The last number written in `text` ("1,234.5" -> 1234.5), or None."""
    found = _NUMBER.findall(text)
    return float(found[-1].replace(",", "")) if found else None


def read_rows(path: Path, prompt_field: str, answer_field: str) -> list[tuple[str, str]]:
    if not path.is_file():
        raise ValueError(f"task.path={str(path)!r}: no such file")
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
            for key in (prompt_field, answer_field):
                if key not in obj:
                    raise ValueError(f"{path}:{n}: no field {key!r} (has {sorted(obj)[:8]})")
            prompt, answer = obj[prompt_field], obj[answer_field]
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{n}: field {prompt_field!r} must be a non-empty string")
            if not (isinstance(answer, str) or is_number(answer)):
                raise ValueError(f"{path}:{n}: field {answer_field!r} must be a string or a number")
            rows.append((prompt, str(answer)))
    if not rows:
        raise ValueError(f"task.path={str(path)!r}: the file has no rows")
    return rows


def split_rows(rows: list[tuple[str, str]], cfg) -> tuple[list, list]:
    """(training rows, held-out rows) of the task section `cfg` (see the module docstring)."""
    if cfg.heldout_path:
        held = read_rows(Path(cfg.heldout_path), cfg.prompt_field, cfg.answer_field)
        texts = {text for text, _ in held}
        train = [r for r in rows if r[0] not in texts]
    else:
        held = [r for r in rows if is_heldout(r[0], cfg.heldout_fraction)]
        train = [r for r in rows if not is_heldout(r[0], cfg.heldout_fraction)]
    if not train:
        raise ValueError(f"task.path={cfg.path!r}: every row is held out (task.heldout_fraction / heldout_path)")
    if cfg.heldout_fraction and not held:
        raise ValueError(f"task.heldout_fraction={cfg.heldout_fraction}: no row of {cfg.path!r} is held out")
    return train, held


@dataclass(frozen=True, kw_only=True)
class JsonlTask:
    """Prompts and answers from a JSONL file, scored by a built-in verifier (see the module docstring)."""

    rows: tuple[tuple[str, str], ...]
    heldout_rows: tuple[tuple[str, str], ...] = ()
    tokenizer: HFTokenizer = field(compare=False)
    verifier: str = "numeric"
    tolerance: float = 1e-6
    max_new_tokens: int = 16
    chat_template: bool = False
    seed: int = 0

    def __post_init__(self):
        errors = []
        if self.verifier not in VERIFIERS:
            errors.append(f"task.verifier={self.verifier!r} must be one of {VERIFIERS}")
        if not is_number(self.tolerance, lo=0):
            errors.append(f"task.tolerance={self.tolerance!r} must be a number >= 0")
        if not is_int(self.max_new_tokens, lo=1):
            errors.append(f"task.max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        if self.chat_template and self.tokenizer.chat_template is None:
            errors.append("task.chat_template is true but the tokenizer has no chat_template")
        if self.verifier == "numeric":
            every = self.rows + self.heldout_rows
            bad = [i for i, (_, a) in enumerate(every) if last_number(a) is None]
            if bad:
                errors.append(
                    f"verifier numeric: {len(bad)} answers have no number (row {bad[0] + 1}: {every[bad[0]][1]!r})"
                )
        if errors:
            raise ValueError("; ".join(errors))

    @classmethod
    def from_config(cls, cfg, *, seed: int) -> JsonlTask:
        """From the run's task section (rollout.tasks.TaskConfig: path, prompt_field, answer_field,
        tokenizer, verifier, tolerance, max_new_tokens, chat_template)."""
        if not cfg.path:
            raise ValueError("task.name=jsonl needs task.path (a JSONL file)")
        if not cfg.tokenizer:
            raise ValueError("task.name=jsonl needs task.tokenizer (a folder with tokenizer.json)")
        rows = read_rows(Path(cfg.path), cfg.prompt_field, cfg.answer_field)
        rows, held = split_rows(rows, cfg)
        return cls(
            rows=tuple(rows),
            heldout_rows=tuple(held),
            tokenizer=HFTokenizer.load(cfg.tokenizer),
            verifier=cfg.verifier,
            tolerance=float(cfg.tolerance),
            max_new_tokens=cfg.max_new_tokens,
            chat_template=cfg.chat_template,
            seed=seed,
        )

    def _prompt(self, row: int | tuple[str, str]) -> Prompt:
        text, answer = self.rows[row] if isinstance(row, int) else row
        tok = self.tokenizer
        if self.chat_template:
            tokens = tok.encode(tok.chat_prompt(text))
        else:
            tokens = tok.encode(text, bos=True)
        return Prompt(tokens=tokens, fields={"answer": answer}, reference=tok.encode(answer, eos=True))

    def row_of(self, index: int) -> int:
        n = len(self.rows)
        epoch, i = divmod(index, n)
        order = list(range(n))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order[i]

    def prompt(self, index: int) -> Prompt:
        return self._prompt(self.row_of(index))

    def example(self, rng: random.Random) -> Prompt:
        return self._prompt(rng.randrange(len(self.rows)))

    def heldout_prompt(self, index: int) -> Prompt:
        if not self.heldout_rows:
            raise ValueError("task.heldout_fraction / task.heldout_path: this task holds out no prompt")
        return self._prompt(self.heldout_rows[index % len(self.heldout_rows)])

    def reward(self, completion: str, answer: str) -> float:
        if self.verifier == "exact":
            return 1.0 if completion.strip() == answer.strip() else 0.0
        got, want = last_number(completion), last_number(answer)
        return 1.0 if got is not None and math.isfinite(got) and abs(got - want) <= self.tolerance else 0.0

    def check_fields(self, fields: dict[str, Any]) -> str | None:
        """`score` needs fields["answer"]: a string or a number, with a number in it for `numeric`."""
        answer = fields.get("answer")
        if not (isinstance(answer, str) or is_number(answer)):
            return f"want 'answer' as a string or a number, got {type(answer).__name__}"
        if self.verifier == "numeric" and last_number(str(answer)) is None:
            return f"answer {str(answer)[:40]!r} has no number (verifier numeric)"
        return None

    def score(self, completion_ids: Sequence[int], fields: dict[str, Any]) -> float:
        ids = list(completion_ids)
        if self.tokenizer.eos_id not in ids:
            return 0.0
        return self.reward(self.tokenizer.decode(ids), str(fields["answer"]))
