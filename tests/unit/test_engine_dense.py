"""The packed rollout engine (rollout.packed_engine, on the CPU) on the model shapes Hugging Face
checkpoints bring: dense Qwen3 layers, Qwen3-MoE's mlp_only_layers, a tied LM head. Greedy tokens equal
the reference generate's, log-probs within fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.engine import generate
from rollout.packed_engine import EngineConfig, PackedEngine

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13]]
CONFIGS = {
    "dense-tied": ModelConfig.preset("tiny-dense", n_layers=2),
    "mixed": ModelConfig.preset("tiny", n_layers=3, n_experts=4, mlp_only_layers=(1,), ffn_dim=256),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("recipe", ["int4_qat", "mxfp8"])
def test_engine_matches_reference_on_dense_and_tied_models(name, recipe):
    cfg = CONFIGS[name]
    model = Transformer(cfg, seed=1)
    plan = Recipe.load(recipe).plan(model)
    packed = qat.quantize_weights(model, plan)
    ref = Transformer(cfg, seed=None)
    qat.install_packed(ref, plan, packed)
    eng = PackedEngine(
        cfg, plan, packed, device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=8, max_seq_len=64)
    )
    a = generate(ref, PROMPTS, max_new_tokens=8, temperature=0.0)
    b = eng.generate(PROMPTS, max_new_tokens=8, temperature=0.0)
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(b.logprobs, a.logprobs, rtol=0, atol=1e-5)
