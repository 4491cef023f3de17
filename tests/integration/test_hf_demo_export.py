"""The demo's own run through Hugging Face: `tandem run configs/demo.yaml` (shortened), `tandem export
--format hf`, then transformers loads model and tokenizer and answers greedily as Tandem's CPU engine
does; the export imports back exactly (`load_hf`, `tandem import-hf`, `model.checkpoint=`). Also the
README's own-model command, checked as `tandem run` checks a config before starting anything."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policy import formats
from policy.checkpoint import load_hf
from policy.model import Transformer, parameter_shapes
from rollout.engine import generate
from rollout.tasks import CharTokenizer
from tandem import config as run_config
from tandem import services
from tandem.commands.export import from_run_dir

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["7+8=", "0+0=", "9+9=", "3+5=", "6+1=", "2+9="]  # one length: transformers needs no padding


def tandem(*args: str, timeout: float = 420) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def _demo_run(run_dir: Path) -> None:
    r = tandem(
        "run", "configs/demo.yaml", "--run-dir", str(run_dir), "num_rollout_workers=1", "trainer.max_steps=1",
        "trainer.groups_per_step=2", "trainer.group_size=4", "trainer.warmstart_steps=40", "trainer.metrics_port=-1",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _hf_greedy(model, tok, prompts: list[str], max_new_tokens: int) -> list[list[int]]:
    enc = tok(prompts, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)[:, enc.input_ids.shape[1] :]
    completions = []
    for row in out.tolist():  # up to and with eos, as Tandem's engine reports a completion
        completions.append(row[: row.index(tok.eos_token_id) + 1] if tok.eos_token_id in row else row)
    return completions


@pytest.mark.integration
@pytest.mark.slow  # a shortened demo run: trainer, one worker, private Redis
def test_the_demo_run_exports_to_transformers_with_its_tokenizer(tmp_path):
    run_dir, out = tmp_path / "run", tmp_path / "hf"
    _demo_run(run_dir)
    r = tandem("export", str(run_dir), "--format", "hf", "--out", str(out))
    assert r.returncode == 0 and r.stderr == "", r.stdout + r.stderr
    assert "tokenizer tokenizer.json, tokenizer_config.json" in r.stdout

    # the tokenizer: transformers encodes as the task's CharTokenizer does, special ids included
    char = CharTokenizer()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, len(tok)) == (0, 1, 2, char.vocab_size)
    for text in [*PROMPTS, "10+15="]:
        assert tok(text).input_ids == char.encode(text, bos=True)
        assert tok(text, add_special_tokens=False).input_ids == char.encode(text)
        assert tok.decode(char.encode(text, bos=True, eos=True), skip_special_tokens=True) == text

    # the model: transformers' greedy answers are Tandem's engine's, token for token, on the export's weights
    cfg, tensors = load_hf(out)
    ours = Transformer(cfg)
    ours.load_weights(tensors)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = [char.encode(p, bos=True) for p in PROMPTS]
    with torch.no_grad():
        assert torch.allclose(hf(torch.tensor(ids)).logits, ours(torch.tensor(ids)), atol=1e-4, rtol=0)
    expected = generate(ours, ids, max_new_tokens=3, temperature=0.0, eos_id=char.eos_id, pad_id=char.pad_id)
    assert _hf_greedy(hf, tok, PROMPTS, 3) == expected.completions()
    assert any(len(c) > 1 and c[-1] == char.eos_id for c in expected.completions())  # warm-started: it answers

    # import back: the run's model config and its published weights (bf16-rounded), bit for bit
    run_cfg, published, _, _, version, _ = from_run_dir(run_dir, None)
    assert cfg == run_cfg and json.loads((out / "config.json").read_text())["tandem"]["version"] == version
    for name, shape in parameter_shapes(cfg).items():
        assert torch.equal(tensors[name], formats.dequantize(published[name]).view(shape).bfloat16()), name
    loaded = run_config.load(REPO / "configs/demo.yaml", [f"model.checkpoint={out}"])
    assert services.task_and_model(loaded)[1] == run_cfg  # `tandem run configs/demo.yaml model.checkpoint=...`
    r = tandem("import-hf", str(out), "--recipe", "nvfp4_moe")
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_readme_own_model_command_is_accepted(tmp_path, monkeypatch):
    # tandem run configs/arith_jsonl.yaml model.checkpoint=/models/Qwen3-0.6B task.tokenizer=/models/Qwen3-0.6B
    folder = tmp_path / "Qwen3"
    config = transformers.Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    for f in (REPO / "configs/data/arith_tokenizer").iterdir():
        shutil.copy(f, folder / f.name)
    monkeypatch.chdir(REPO)  # the config's task.path is relative to the repository
    cfg = run_config.load("configs/arith_jsonl.yaml", [f"model.checkpoint={folder}", f"task.tokenizer={folder}"])
    services.check(cfg)  # what `tandem run` checks before any process or folder
    assert services.task_and_model(cfg)[1].dim == 64
