"""The jsonl task and the Hugging Face tokenizer: verifiers by hand, prompt order, bad files, the
shipped data and BPE tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from rollout.hf_tokenizer import HFTokenizer
from rollout.jsonl_task import JsonlTask, last_number, read_rows

REPO = Path(__file__).resolve().parents[2]
TOKENIZER = REPO / "configs/data/arith_tokenizer"
DATA = REPO / "configs/data/arith.jsonl"


@pytest.fixture(scope="module")
def tok():
    return HFTokenizer.load(TOKENIZER)


def test_last_number_by_hand():
    assert last_number("so 3 + 4 = 7") == 7.0
    assert last_number("#### 1,234") == 1234.0
    assert last_number("it is -2.5 degrees") == -2.5
    assert last_number("x=.5") == 0.5
    assert last_number("no digits here") is None
    assert last_number("12 apples, then 15.") == 15.0


def test_tokenizer_round_trip_and_specials(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    text = "Ann has 12 apples and gets 7 more. How many apples now?"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode("19", eos=True) + tok.encode("junk")) == "19"  # stops at eos
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.chat_prompt("3+4=") == "<|user|>3+4=\n<|assistant|>"


def test_tokenizer_refuses_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text((TOKENIZER / "tokenizer.json").read_text())
    with pytest.raises(ValueError, match="eos_token"):
        HFTokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="not in the vocabulary"):
        HFTokenizer.load(tmp_path)


def _task(tok, **kw) -> JsonlTask:
    return JsonlTask(rows=tuple(read_rows(DATA, "question", "answer")), tokenizer=tok, **kw)


def test_numeric_and_exact_verifiers(tok):
    task = _task(tok, verifier="numeric", tolerance=0.01)
    eos = [tok.eos_id]
    assert task.score(tok.encode("the answer is 19") + eos, {"answer": "19"}) == 1.0
    assert task.score(tok.encode("19.005") + eos, {"answer": "#### 19"}) == 1.0
    assert task.score(tok.encode("19, no 20") + eos, {"answer": "19"}) == 0.0  # the last number counts
    assert task.score(tok.encode("19"), {"answer": "19"}) == 0.0  # never ended
    assert task.score(tok.encode("nineteen") + eos, {"answer": "19"}) == 0.0
    exact = _task(tok, verifier="exact")
    assert exact.score(tok.encode(" 19 ") + eos, {"answer": "19"}) == 1.0
    assert exact.score(tok.encode("19.0") + eos, {"answer": "19"}) == 0.0


def test_prompts_are_a_pure_function_of_seed_and_index_and_cover_every_row(tok):
    task = _task(tok, seed=5)
    n = len(task.rows)
    assert sorted(task.row_of(i) for i in range(n)) == list(range(n))  # each row once per epoch
    assert [task.row_of(i) for i in range(n, n + 20)] != [task.row_of(i) for i in range(20)]  # reshuffled
    again = _task(tok, seed=5)
    assert [again.row_of(i) for i in range(50)] == [task.row_of(i) for i in range(50)]
    assert [_task(tok, seed=6).row_of(i) for i in range(50)] != [task.row_of(i) for i in range(50)]


def test_prompt_records(tok):
    task = _task(tok, seed=1)
    p = task.prompt(3)
    question, answer = task.rows[task.row_of(3)]
    assert p.tokens[0] == tok.bos_id and tok.decode(p.tokens) == question
    assert p.fields == {"answer": answer} and p.reference == tok.encode(answer, eos=True)
    chat = _task(tok, chat_template=True).example(random.Random(0))
    assert tok.decode(chat.tokens).startswith("<|user|>") and tok.decode(chat.tokens).endswith("<|assistant|>")


@pytest.mark.parametrize(
    "line,match",
    [
        ("not json", r":1: not valid JSON"),
        ("[1, 2]", r":1: expected a JSON object"),
        ('{"question": "q"}', r":1: no field 'answer'"),
        ('{"question": "", "answer": "1"}', r"must be a non-empty string"),
        ('{"question": "q", "answer": [1]}', r"must be a string or a number"),
    ],
)
def test_bad_rows_name_the_line(tmp_path, line, match):
    f = tmp_path / "d.jsonl"
    f.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        read_rows(f, "question", "answer")


def test_bad_settings(tok, tmp_path):
    with pytest.raises(ValueError, match="verifier"):
        _task(tok, verifier="fuzzy")
    with pytest.raises(ValueError, match="no number"):
        JsonlTask(rows=(("q", "seven"),), tokenizer=tok, verifier="numeric")
    with pytest.raises(ValueError, match="no such file"):
        read_rows(tmp_path / "missing.jsonl", "question", "answer")
