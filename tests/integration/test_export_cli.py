"""`tandem export HOST:PORT` against a real policy server on loopback, and `tandem import-hf`, as a
user runs them (subprocesses of the `tandem` command)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from broker.policy_server import PolicyServer, PolicyServerConfig
from policy import formats
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.integration, pytest.mark.slow]  # subprocesses of the tandem command

CFG = ModelConfig(
    vocab_size=64, dim=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_experts=2, top_k=1,
    expert_ffn_dim=128, rope_theta=10_000.0, max_seq_len=64,
)  # fmt: skip


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=240, env=os.environ
    )


@pytest.fixture
def server():
    s = PolicyServer(PolicyServerConfig(keep_versions=2))
    s.start()
    yield s
    s.stop()


def test_export_from_a_policy_server(tmp_path, server):
    recipe = Recipe.load("int4_qat")
    model = Transformer(CFG, seed=3)
    contract = contract_from_recipe(model_config=CFG, recipe=recipe)
    tensors = quantize_params(dict(model.named_parameters()), recipe.plan(CFG))
    for v in (1, 2):
        server.publish(mf.build_manifest(version=v, parent_version=v - 1 or None, contract=contract, tensors=tensors))
    r = tandem(
        "export", server.address, "--version", "1", "--format", "compressed-tensors", "--out", str(tmp_path / "o")
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "exported version 1" in r.stdout and "no tokenizer (a policy server does not know" in r.stdout
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["tandem"]["contract_fingerprint"] == contract.fingerprint() and config["tandem"]["version"] == 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.bfloat16)
    w = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"]  # bf16 under int4_qat: in `ignore`
    assert torch.equal(w, formats.dequantize(tensors["model.layers.0.self_attn.q_proj.weight"].value).bfloat16())

    # bad input: one line, exit 2, no traceback
    r = tandem("export", server.address, "--version", "9", "--format", "hf", "--out", str(tmp_path / "x"))
    assert (
        r.returncode == 2
        and "Traceback" not in r.stdout + r.stderr
        and r.stderr.startswith("tandem export:")
        and r.stdout == ""
    )
    r = tandem("export", server.address, "--format", "nvfp4", "--out", str(tmp_path / "y"))
    assert r.returncode == 2 and "has no nvfp4 weights" in r.stderr
    r = tandem("export", str(tmp_path / "nothing"), "--format", "hf", "--out", str(tmp_path / "z"))
    assert r.returncode == 2 and "neither a run folder" in r.stderr


def test_export_of_a_model_with_a_shared_expert_is_one_line(tmp_path, server):
    cfg = dataclasses.replace(CFG, shared_expert_ffn_dim=128)
    recipe = Recipe.load("bf16")
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    tensors = quantize_params(dict(Transformer(cfg, seed=3).named_parameters()), recipe.plan(cfg))
    server.publish(mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors))
    r = tandem("export", server.address, "--format", "hf", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stdout + r.stderr
    assert r.stderr.startswith("tandem export: shared_expert_ffn_dim=128: neither Hugging Face qwen3_moe")
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_import_hf_plans_without_loading(tmp_path):
    torch.manual_seed(0)
    c = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        mlp_only_layers=[1],
    )  # fmt: skip
    transformers.Qwen3MoeForCausalLM(c).save_pretrained(tmp_path / "m")
    r = tandem("import-hf", str(tmp_path / "m"), "--recipe", "int4_qat")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "int4/group" in r.stdout and "on disk:" in r.stdout
    r = tandem("import-hf", str(tmp_path / "m"), "--recipe", "nvfp4_moe", "--json")
    lines = r.stdout.strip().splitlines()
    plan, extra = json.loads("\n".join(lines[:-1])), json.loads(lines[-1])
    assert plan["summary"]["numel_by_format"]["nvfp4"] > 0
    # int4: 4 bits + a bf16 scale per 32 -> 4.5 bits; bf16 elsewhere
    assert extra["bytes"]["published"] < extra["bytes"]["on_disk"]
    cfgfile = tmp_path / "m" / "config.json"
    cfgfile.write_text(json.dumps({**json.loads(cfgfile.read_text()), "use_sliding_window": True}))
    r = tandem("import-hf", str(tmp_path / "m"), "--recipe", "int4_qat")
    assert r.returncode == 2 and "use_sliding_window" in r.stderr and "Traceback" not in r.stderr


def test_plan_says_a_dense_model_is_all_bf16_under_nvfp4_moe():
    r = tandem("plan", "nvfp4_moe", "--model", "tiny-dense")
    assert r.returncode == 0 and "leaves every parameter of this model in bf16 (a dense model" in r.stdout
    r = tandem("plan", "int4_qat", "--model", "tiny-dense")
    assert "int4/group" in r.stdout and "leaves every parameter" not in r.stdout
