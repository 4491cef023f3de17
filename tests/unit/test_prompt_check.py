"""rollout.prompt_check: each rule by a hand-made prompt group that breaks it alone, and the tasks'
own field checks (what their verifiers would raise on)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from broker.codec import PromptGroup
from rollout.hf_tokenizer import HFTokenizer
from rollout.jsonl_task import JsonlTask
from rollout.prompt_check import PromptRules, check_prompt
from rollout.tasks import AdditionTask

# vocab 15 (the addition task's), 32 positions, 4 new tokens, 8 slots, groups of 4
RULES = PromptRules(vocab_size=15, max_seq_len=32, max_new_tokens=4, max_batch=8, group_size=4)
TASK = AdditionTask(digits=1)


def group(tokens=(1, 5, 13, 6, 14), n=4, task=None) -> PromptGroup:
    return PromptGroup(
        prompt_id="p0", group_id="p0", prompt_tokens=np.array(tokens, dtype=np.int32), n_samples=n,
        task={"answer": "5"} if task is None else task,
    )  # fmt: skip


def check(g: PromptGroup, rules: PromptRules = RULES) -> str | None:
    return check_prompt(g, rules, check_fields=TASK.check_fields)


def test_a_prompt_the_worker_can_run_passes():
    assert check(group()) is None
    assert check(group(tokens=[14] * 28)) is None  # 28 + 4 == 32: exactly fills a slot
    assert check(group(tokens=[0])) is None  # id 0 and id 14 (vocab - 1) are in range


def test_group_size_is_the_runs_else_at_most_the_kv_slots():
    assert check(group(n=4096)) == "n_samples=4096, the run's group size is 4"
    assert check(group(n=1)) == "n_samples=1, the run's group size is 4"
    unknown = PromptRules(vocab_size=15, max_seq_len=32, max_new_tokens=4, max_batch=8)
    assert check(group(n=8), unknown) is None
    assert check(group(n=9), unknown) == "n_samples=9 (want 1..8, the KV slots)"


def test_token_ids_outside_the_vocabulary():
    assert check(group(tokens=[1, 15])) == "prompt token ids in [1, 15], vocab is [0, 15)"
    assert check(group(tokens=[1, 2**31 - 1])) == f"prompt token ids in [1, {2**31 - 1}], vocab is [0, 15)"


def test_a_prompt_that_with_its_new_tokens_does_not_fit_a_slot():
    assert check(group(tokens=[5] * 29)) == "29 prompt tokens + 4 new > max_seq_len=32"


def test_task_fields_the_verifier_needs():
    assert check(group(task={})) == "task fields: want 'answer' as a string, got NoneType"
    assert check(group(task={"answer": 5})) == "task fields: want 'answer' as a string, got int"
    assert check_prompt(group(task={}), RULES) is None  # a task without check_fields: not checked here


def test_the_first_broken_rule_is_named():
    assert check(group(tokens=[99] * 40, n=2, task={})).startswith("n_samples=2")
    assert check(group(tokens=[99] * 40, task={})).startswith("prompt token ids")


def test_jsonl_task_fields():
    tok = HFTokenizer.load(Path(__file__).resolve().parents[2] / "configs/data/arith_tokenizer")
    rows = (("what is 2+2?", "4"),)
    numeric = JsonlTask(rows=rows, tokenizer=tok, verifier="numeric")
    assert numeric.check_fields({"answer": "#### 42"}) is None
    assert numeric.check_fields({"answer": 4.5}) is None
    assert numeric.check_fields({}) == "want 'answer' as a string or a number, got NoneType"
    assert numeric.check_fields({"answer": True}) == "want 'answer' as a string or a number, got bool"
    assert numeric.check_fields({"answer": "none"}) == "answer 'none' has no number (verifier numeric)"
    exact = JsonlTask(rows=rows, tokenizer=tok, verifier="exact")
    assert exact.check_fields({"answer": "none"}) is None


def test_rules_are_validated():
    with pytest.raises(ValueError, match=r"vocab_size=0 .*max_batch=0 .*group_size=0"):
        PromptRules(vocab_size=0, max_seq_len=8, max_new_tokens=1, max_batch=0, group_size=0)
