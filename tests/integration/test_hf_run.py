"""A user's whole path: a Hugging Face Qwen3 folder (built here with transformers) as `model.checkpoint`,
`tandem run` for a few GRPO steps (private Redis, trainer, one rollout worker), then `tandem export` of
the run's last version as compressed-tensors int4 and as bf16, both loaded by transformers, each with
the run's tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rollout.hf_tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STEPS = 3


def tandem(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )


def _hf_checkpoint(path: Path) -> None:
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=128, tie_word_embeddings=True,
    )  # fmt: skip
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)


def _run_config(tmp: Path, task: dict) -> Path:
    cfg = {
        "run_id": "hf",
        "num_rollout_workers": 1,
        "loop": {"max_staleness": 1},
        "recipe": "int4_qat",
        "model": {"checkpoint": str(tmp / "hf")},
        "task": task,
        "trainer": {
            "max_steps": STEPS,
            "groups_per_step": 2,
            "group_size": 4,
            "minibatches": 1,
            "warmstart_steps": 2,
            "warmstart_batch": 4,
            "metrics_port": -1,
        },
    }
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_train_from_a_hf_checkpoint_on_a_jsonl_task_and_export(tmp_path):
    _hf_checkpoint(tmp_path / "hf")
    task = {
        "name": "jsonl",
        "path": str(REPO / "configs/data/arith.jsonl"),
        "prompt_field": "question",
        "answer_field": "answer",
        "tokenizer": str(REPO / "configs/data/arith_tokenizer"),
        "verifier": "numeric",
        "max_new_tokens": 6,
    }
    run_dir = tmp_path / "run"
    r = tandem("run", str(_run_config(tmp_path, task)), "--run-dir", str(run_dir), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "initial weights loaded" in r.stdout
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    version = metrics[-1]["policy_version"]

    for fmt in ("compressed-tensors", "hf"):
        r = tandem("export", str(run_dir), "--format", fmt, "--out", str(tmp_path / f"out-{fmt}"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"exported version {version}" in r.stdout
        # the run's tokenizer travels with the export: the task's own files, read by transformers
        for name in ("tokenizer.json", "tokenizer_config.json"):
            ours = REPO / "configs/data/arith_tokenizer" / name
            assert (tmp_path / f"out-{fmt}" / name).read_bytes() == ours.read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out-hf")
    task_tok = HFTokenizer.load(REPO / "configs/data/arith_tokenizer")
    text = "What is 12 plus 30?"
    assert tok(text, add_special_tokens=False).input_ids == task_tok.encode(text)
    assert tok.eos_token_id == task_tok.eos_id
    assert json.loads((tmp_path / "out-hf" / "generation_config.json").read_text())["eos_token_id"] == task_tok.eos_id
    tokens = torch.randint(0, 366, (2, 7), generator=torch.Generator().manual_seed(0))
    logits = {}
    for fmt in ("compressed-tensors", "hf"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{fmt}", dtype=torch.bfloat16).eval()
        with torch.no_grad():
            logits[fmt] = model(tokens).logits
    assert torch.equal(logits["compressed-tensors"], logits["hf"])
    # training moved the weights away from the checkpoint it started from
    start = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    trained = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out-compressed-tensors", dtype=torch.bfloat16
    )
    w0 = start.state_dict()["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(w0, trained.state_dict()["model.layers.0.self_attn.q_proj.weight"])
