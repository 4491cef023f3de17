"""Tasks as plugins: the `Task` protocol, the registry of built-in tasks, and the built-in addition task.

A task is what the run learns: its prompts, its verifier and its tokenizer (the tokenizer's size is
the model's vocab, so trainer and rollout build the same one). `tandem/services.py` builds one with
`make_task(cfg.task, seed=cfg.seed)` and injects it into both sides: the trainer feeds
`task.prompt(i)` and warm-starts on `task.example(rng)`; a rollout worker generates up to
`task.max_new_tokens` tokens and scores them with `task.score`. `task.name` selects the factory: a
built-in registered in `TASKS` (`addition`, and `jsonl` in rollout/jsonl_task.py), or a user's
`"module:attr"` (imported at start; called as `factory(cfg, seed=seed)`, returning a `Task`).

Rules: `prompt(index)` is a pure function of (the task's seed, index), so a restarted trainer feeds
the same data; held-out prompts are never given by `prompt` or `example`. The built-in `addition`:
a prompt is "<bos>123+45=", a correct completion "168<eos>"; the reward is 1.0 for the exact answer
followed by <eos>, else 0.0 (why this task and a binary verifier: docs/design-decisions.md)."""

from __future__ import annotations

import importlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .jsonl_task import JsonlTask
from .prompts import Prompt, is_heldout

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
CHARS = "0123456789+="
MAX_DRAWS = 10_000  # draws of a prompt on one side of the held-out split before giving up


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

    def save_pretrained(self, path: str | Path) -> list[str]:
        """Write this tokenizer as a Hugging Face tokenizer folder; returns the file names written.

        `AutoTokenizer.from_pretrained(path)` then encodes text as `encode(text, bos=True)` (the task's
        prompts), or as `encode(text)` with `add_special_tokens=False`; it has the same <pad>, <bos> and
        <eos> ids, decodes without special tokens, pads on the left (for batched generation) and, like
        `encode`, raises on a character outside the vocabulary (there is no unknown token)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
        from tokenizers import Tokenizer as Backend

        tok = Backend(models.WordLevel(dict(self.stoi)))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # one token per character
        tok.decoder = decoders.Fuse()  # characters join without spaces
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, self.bos_id)])
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, BOS, EOS)])
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "padding_side": "left",
            "clean_up_tokenization_spaces": False,
        }
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (path / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
        return ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]


@runtime_checkable
class Tokenizer(Protocol):
    pad_id: int
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]: ...

    def decode(self, ids) -> str: ...


@runtime_checkable
class Task(Protocol):
    """What a task provides (structural: any object with these members is a task):

    tokenizer        a `Tokenizer`: vocab_size, pad_id, bos_id, eos_id, encode(text, bos=, eos=), decode(ids),
                        and optionally save_pretrained(folder) (a Hugging Face tokenizer folder for exports)
    max_new_tokens   the longest completion a rollout generates
    prompt(index)    -> Prompt, a pure function of (the task's seed, index), so that a restarted
                        trainer feeds the same data
    example(rng)     -> Prompt, a random example with its reference completion (supervised warm start)
    score(completion_ids, fields) -> float, the verifier; `fields` is the Prompt's `fields` as it
                        travelled with the prompt group (plain msgpack-able data: strings, numbers)
    check_fields(fields) -> str | None   (optional) why `score` cannot take these fields, None when it
                        can: a worker refuses (dead-letters) a prompt group whose fields it fails
    heldout_prompt(index) -> Prompt   (optional; for trainer.eval_every) a held-out prompt, one that
                        `prompt` and `example` never give: the built-ins split their prompt space by
                        `is_heldout(prompt text, task.heldout_fraction)`
    """

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_new_tokens(self) -> int: ...

    def prompt(self, index: int) -> Prompt: ...

    def example(self, rng: random.Random) -> Prompt: ...

    def score(self, completion_ids: Sequence[int], fields: dict[str, Any]) -> float: ...


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """The run's `task:` section."""

    name: str = "addition"
    """A built-in task (`rollout.tasks.TASKS`: addition) or a user's factory as "module:attr"."""
    digits: int = 1
    """addition: each operand has 1..digits digits (1 = single-digit sums, the demo)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Task-specific settings for a user's factory (it reads them from cfg.options)."""
    path: str = ""
    """jsonl: the prompt file, one JSON object per line (rollout/jsonl_task.py)."""
    prompt_field: str = "prompt"
    """jsonl: the field holding the prompt text."""
    answer_field: str = "answer"
    """jsonl: the field holding the reference answer."""
    tokenizer: str = ""
    """jsonl: a Hugging Face tokenizer folder (tokenizer.json; eos/pad/bos from tokenizer_config.json)."""
    verifier: str = "numeric"
    """jsonl: exact (stripped text equality) or numeric (last number, within `tolerance`)."""
    tolerance: float = 1e-6
    """jsonl, numeric verifier: the largest accepted |completion's number - answer's number|."""
    max_new_tokens: int = 16
    """jsonl: the longest completion a rollout generates."""
    chat_template: bool = False
    """jsonl: wrap each prompt in the tokenizer's chat template (one user message)."""
    heldout_fraction: float = 0.0
    """addition and jsonl: the share of the prompt space held out for evaluation (trainer.eval_every),
    chosen by a hash of the prompt text and never fed or warm-started on; 0 = none."""
    heldout_path: str = ""
    """jsonl: a file of held-out prompts (the same fields as task.path); prompts of task.path with
    the same text are left out of training."""

    def __post_init__(self):
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"task.heldout_fraction={self.heldout_fraction!r} (want 0 <= f < 1)")
        if self.heldout_path and (self.name != "jsonl" or self.heldout_fraction):
            raise ValueError("task.heldout_path belongs to task.name=jsonl, without task.heldout_fraction")
        if self.name not in TASKS and ":" not in self.name:
            raise ValueError(
                f"task.name={self.name!r}: not a built-in task ({', '.join(sorted(TASKS))}) "
                "and not a 'module:attr' factory"
            )
        if self.name == "addition" and (self.path or self.tokenizer):
            raise ValueError("task.path / task.tokenizer belong to task.name=jsonl (addition has its own)")


@dataclass(frozen=True, kw_only=True)
class AdditionTask:
    """a+b with each operand drawn uniformly from 1..`digits` digits; prompt i from Random(seed, i)."""

    digits: int = 2
    seed: int = 0
    heldout_fraction: float = 0.0  # prompts with is_heldout(text) are for evaluation only
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer, compare=False)

    def __post_init__(self):
        if not 1 <= self.digits <= 9:
            raise ValueError(f"AdditionTask.digits={self.digits} must be in 1..9")

    @property
    def max_new_tokens(self) -> int:
        return self.digits + 2  # carry digit + <eos>

    def sample(self, rng: random.Random) -> tuple[str, str]:
        """(prompt text, answer text), e.g. ("123+45=", "168")."""
        a, b = (rng.randint(0, 10 ** rng.randint(1, self.digits) - 1) for _ in range(2))
        return f"{a}+{b}=", str(a + b)

    def _draw(self, rng: random.Random, *, heldout: bool) -> Prompt:
        """The first sample from `rng` on the asked side of the held-out split."""
        for _ in range(MAX_DRAWS):
            text, answer = self.sample(rng)
            if is_heldout(text, self.heldout_fraction) == heldout:
                tok = self.tokenizer
                return Prompt(
                    tokens=tok.encode(text, bos=True), fields={"answer": answer}, reference=tok.encode(answer, eos=True)
                )
        side = "held-out" if heldout else "training"
        raise ValueError(
            f"task.heldout_fraction={self.heldout_fraction}: no {side} prompt in {MAX_DRAWS} draws (digits={self.digits})"
        )

    def example(self, rng: random.Random) -> Prompt:
        return self._draw(rng, heldout=False)

    def prompt(self, index: int) -> Prompt:
        return self.example(random.Random(self.seed * 1_000_003 + index))

    def heldout_prompt(self, index: int) -> Prompt:
        return self._draw(random.Random(f"heldout:{self.seed}:{index}"), heldout=True)

    @staticmethod
    def reward(completion_text_until_eos: str, ended_with_eos: bool, answer: str) -> float:
        return 1.0 if ended_with_eos and completion_text_until_eos == answer else 0.0

    @staticmethod
    def check_fields(fields: dict[str, Any]) -> str | None:
        """`score` needs fields["answer"], a string."""
        answer = fields.get("answer")
        return None if isinstance(answer, str) else f"want 'answer' as a string, got {type(answer).__name__}"

    def score(self, completion_ids: Sequence[int], fields: dict[str, Any]) -> float:
        """The verifier on raw completion token ids: 1.0 for exactly fields["answer"] then <eos>."""
        ids = list(completion_ids)
        ended = self.tokenizer.eos_id in ids
        return self.reward(self.tokenizer.decode(ids), ended, fields["answer"])


def make_addition(cfg: TaskConfig, *, seed: int) -> AdditionTask:
    return AdditionTask(digits=cfg.digits, seed=seed, heldout_fraction=cfg.heldout_fraction)


def make_jsonl(cfg: TaskConfig, *, seed: int) -> Task:
    return JsonlTask.from_config(cfg, seed=seed)


TASKS: dict[str, Callable[..., Task]] = {"addition": make_addition, "jsonl": make_jsonl}


def make_task(cfg: TaskConfig, *, seed: int) -> Task:
    """The configured task: a built-in from TASKS or a user's "module:attr" factory."""
    if cfg.name in TASKS:
        factory = TASKS[cfg.name]
    else:
        module, _, attr = cfg.name.partition(":")
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"task.name={cfg.name!r}: cannot load the factory: {type(e).__name__}: {e}") from None
    try:
        task = factory(cfg, seed=seed)
    except TypeError as e:  # a factory of the wrong signature
        raise ValueError(f"task.name={cfg.name!r}: factory(cfg, seed=...) failed: {e}") from None
    if not isinstance(task, Task) or not isinstance(task.tokenizer, Tokenizer):
        raise ValueError(f"task.name={cfg.name!r}: the factory returned {type(task).__name__}, not a Task")
    return task
