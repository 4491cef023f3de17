"""Writes the shipped arithmetic / word-problem task data and its BPE tokenizer (run from the repo root):

    python configs/data/make_arith.py        # -> configs/data/arith.jsonl, configs/data/arith_tokenizer/

Deterministic (seed 0), so the committed files are what this script writes. The JSONL has one
{"question": ..., "answer": ...} object per line, GSM8K-style but tiny: bare sums and differences
("37+5=") and one-sentence word problems whose answer is a small integer. The tokenizer is a
byte-level BPE trained with the `tokenizers` library on that text, digits split one per token (so
numbers are spelled digit by digit), with <pad>, <bos>, <eos> and a minimal chat template.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent
NAMES = ["Ann", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jun"]
THINGS = ["apples", "books", "coins", "pens", "shells", "stamps", "cards", "eggs"]
SPECIALS = ["<pad>", "<bos>", "<eos>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def problem(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    kind = rng.randrange(5)
    if kind == 0:
        return f"{a}+{b}=", a + b
    if kind == 1:
        a, b = max(a, b), min(a, b)
        return f"{a}-{b}=", a - b
    if kind == 2:
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} now?", a + b
    if kind == 3:
        a, b = max(a, b), min(a, b)
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?", a - b
    a, b = rng.randint(1, 5), rng.randint(1, 5)
    return f"{name} buys {a} bags of {b} {thing}. How many {thing}?", a * b


def main() -> None:
    rng = random.Random(0)
    rows = [problem(rng) for _ in range(1000)]
    with open(HERE / "arith.jsonl", "w") as f:
        for q, a in rows:
            f.write(json.dumps({"question": q, "answer": str(a)}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = [q for q, _ in rows] + [str(a) for _, a in rows] + ["<|user|>", "<|assistant|>"]
    tok.train_from_iterator(text, trainer=trainer)
    out = HERE / "arith_tokenizer"
    out.mkdir(exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
