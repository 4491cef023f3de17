"""Task tokenizers written as Hugging Face tokenizer folders (`save_pretrained`), read back by the
`tokenizers` library (rollout.hf_tokenizer) and by transformers, encoding exactly as the task does."""

from __future__ import annotations

import pytest

from rollout.hf_tokenizer import HFTokenizer
from rollout.tasks import AdditionTask, CharTokenizer

TEXTS = ["7+8=", "0+0=", "123+45=", "15", "="]


def test_char_tokenizer_folder_by_hand(tmp_path):
    char = CharTokenizer()
    assert char.save_pretrained(tmp_path) == ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
    back = HFTokenizer.load(tmp_path)
    assert (back.pad_id, back.bos_id, back.eos_id, back.vocab_size) == (0, 1, 2, 15)
    assert back.encode("7+8=", bos=True, eos=True) == [1, 10, 13, 11, 14, 2]  # <bos> 7 + 8 = <eos>
    for text in TEXTS:
        assert back.encode(text, bos=True) == char.encode(text, bos=True)
        assert back.decode(char.encode(text, eos=True) + [5]) == char.decode(char.encode(text, eos=True)) == text
    task = AdditionTask(digits=3)
    for i in range(20):  # every prompt the task feeds
        assert back.encode(task.tokenizer.decode(task.prompt(i).tokens), bos=True) == task.prompt(i).tokens


def test_transformers_reads_the_char_tokenizer_as_the_task_encodes(tmp_path):
    transformers = pytest.importorskip("transformers")
    char = CharTokenizer()
    char.save_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)) == (0, 1, 2, 15)
    for text in TEXTS:
        assert tok(text).input_ids == char.encode(text, bos=True)  # <bos> first, as the task's prompts
        assert tok(text, add_special_tokens=False).input_ids == char.encode(text)
        assert tok.decode(char.encode(text, bos=True, eos=True), skip_special_tokens=True) == text
    batch = tok(["7+8=", "12+3="], padding=True).input_ids
    assert batch == [[0, 1, 10, 13, 11, 14], [1, 4, 5, 13, 6, 14]]  # padded on the left, with <pad>
    with pytest.raises(Exception, match="UNK|unk"):  # no unknown token: a character outside is refused
        tok("7 + 8")
