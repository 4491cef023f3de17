"""The held-out split (trainer.eval_every): disjoint from every prompt the trainer feeds or
warm-starts on, for the addition task and a jsonl file (fraction and separate file), a run without
it unchanged; held-out accuracy of hand-made models by hand; bad schedule and evaluation values
refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollout.hf_tokenizer import HFTokenizer
from rollout.jsonl_task import JsonlTask
from rollout.prompts import is_heldout
from rollout.tasks import AdditionTask, TaskConfig, make_task
from tandem import config

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "configs/data/arith.jsonl"
TOKENIZER = REPO / "configs/data/arith_tokenizer"


def _text(task, prompt) -> str:
    return task.tokenizer.decode(prompt.tokens)


def test_addition_split_is_disjoint_and_covers_the_rest():
    task = AdditionTask(digits=1, seed=3, heldout_fraction=0.2)
    space = {f"{a}+{b}=" for a in range(10) for b in range(10)}
    held = {t for t in space if is_heldout(t, 0.2)}
    assert 5 <= len(held) <= 40  # about a fifth of the 100 sums
    fed = {_text(task, task.prompt(i)) for i in range(3000)}
    rng = random.Random(0)
    warm = {_text(task, task.example(rng)) for _ in range(3000)}
    evals = {_text(task, task.heldout_prompt(i)) for i in range(500)}
    assert not (fed | warm) & held  # never trained on
    assert fed == warm == space - held  # every other sum is trained on
    assert evals == held
    # A pure function of (seed, index): another instance gives the same prompts.
    again = AdditionTask(digits=1, seed=3, heldout_fraction=0.2)
    assert [again.heldout_prompt(i).tokens for i in range(20)] == [task.heldout_prompt(i).tokens for i in range(20)]


def test_addition_without_a_split_feeds_what_it_fed_before():
    task = AdditionTask(digits=2, seed=1)
    for i in range(50):
        a_b = AdditionTask(digits=2).sample(random.Random(1 * 1_000_003 + i))
        assert _text(task, task.prompt(i)) == a_b[0]
    with pytest.raises(ValueError, match="no held-out prompt"):
        task.heldout_prompt(0)


def test_jsonl_fraction_and_file_splits_are_disjoint(tmp_path):
    tok = HFTokenizer.load(TOKENIZER)
    cfg = TaskConfig(
        name="jsonl", path=str(DATA), prompt_field="question", tokenizer=str(TOKENIZER), heldout_fraction=0.25
    )
    task = make_task(cfg, seed=0)
    assert isinstance(task, JsonlTask) and task.heldout_rows
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    assert len(task.rows) + len(task.heldout_rows) == len(rows)
    held = {q for q, _ in task.heldout_rows}
    n = len(task.rows)
    fed = {tok.decode(task.prompt(i).tokens) for i in range(3 * n)}
    assert fed == {q for q, _ in task.rows} and not fed & held
    assert {tok.decode(task.heldout_prompt(i).tokens) for i in range(len(task.heldout_rows))} == held

    # A separate held-out file: its prompts leave the training rows.
    heldout = tmp_path / "heldout.jsonl"
    heldout.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    cfg = TaskConfig(name="jsonl", path=str(DATA), prompt_field="question", tokenizer=str(TOKENIZER),
                     heldout_path=str(heldout))  # fmt: skip
    task = make_task(cfg, seed=0)
    assert [q for q, _ in task.heldout_rows] == [r["question"] for r in rows[:3]]
    assert len(task.rows) == len(rows) - 3 and not {q for q, _ in task.rows} & {q for q, _ in task.heldout_rows}


def test_eval_without_a_split_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match=r"trainer.eval_every=5 needs held-out prompts: set task.heldout_fraction"):
        config.load(None, ["trainer.eval_every=5"])
    with pytest.raises(ValueError, match=r"task.heldout_fraction=1.0 \(want 0 <= f < 1\)"):
        config.load(None, ["task.heldout_fraction=1.0"])
    with pytest.raises(ValueError, match="task.heldout_path belongs to task.name=jsonl"):
        config.load(None, ["task.heldout_path=x.jsonl"])
    assert config.load(None, ["trainer.eval_every=5", "task.heldout_fraction=0.1"]).trainer.eval_every == 5


def _constant_model(token: int, vocab: int):
    """A model that always puts logit dim on `token` and 0 elsewhere: every layer's output
    projections zero, so the residual stream stays the embedding (all ones) whatever the prompt."""
    import torch

    from policy.model import ModelConfig, Transformer

    model = Transformer(ModelConfig.preset("tiny", n_layers=1, vocab_size=vocab, max_seq_len=32), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") or "embed_tokens" in name else 0.0)
        model.lm_head.weight[token] = 1.0
    return model


def test_heldout_accuracy_scores_the_models_completions_on_held_out_prompts(tmp_path):
    from rollout.evaluate import heldout_accuracy
    from rollout.tasks import CharTokenizer

    CharTokenizer().save_pretrained(tmp_path / "tok")
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(5)))
    held.write_text(
        "".join(json.dumps({"prompt": f"9+{i}=", "answer": a}) + "\n" for i, a in enumerate(["", "", "", "7"]))
    )
    task = make_task(
        TaskConfig(name="jsonl", path=str(train), heldout_path=str(held), tokenizer=str(tmp_path / "tok"),
                   verifier="exact", max_new_tokens=3),
        seed=0,
    )  # fmt: skip
    vocab = task.tokenizer.vocab_size
    # Always <eos> at once: the empty completion, right for the three empty answers of four.
    ends = heldout_accuracy(_constant_model(task.tokenizer.eos_id, vocab), task, k=4, temperature=1.0)
    assert ends == {"eval_greedy_accuracy": 0.75, "eval_sampled_accuracy": 0.75}
    # Always "7", never <eos>: a completion that never ends scores 0.
    sevens = heldout_accuracy(_constant_model(task.tokenizer.encode("7")[0], vocab), task, k=4, temperature=1.0)
    assert sevens == {"eval_greedy_accuracy": 0.0, "eval_sampled_accuracy": 0.0}


def test_schedule_and_eval_values_are_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer.lr_schedule.kind='step' \(one of constant, linear, cosine\)"):
        config.load(None, ["trainer.lr_schedule.kind=step"])
    with pytest.raises(ValueError, match=r"trainer.lr_schedule.min_lr_ratio=2.0 \(want 0..1\)"):
        config.load(None, ["trainer.lr_schedule.min_lr_ratio=2.0"])
    with pytest.raises(ValueError, match=r"eval_every=3 needs backend='torch'"):
        config.load(None, ["trainer.backend=megatron", "trainer.device=cuda", "trainer.eval_every=3"])
