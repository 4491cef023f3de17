"""The trainer's QAT on a GPU: the CUDA quantizers give the CPU reference's published bytes, the
cache refreshes once per optimizer step under bf16 autocast, and publishing from the QAT cache
equals a fresh quantization. Runs on the device machine only (bench/run_device.sh)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

from policy import manifest as mf  # noqa: E402
from policy import qat  # noqa: E402
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.recipe import Recipe  # noqa: E402

CFG = ModelConfig.preset("tiny", n_layers=2)


def _manifest(model: Transformer, recipe: Recipe, tensors) -> dict[str, bytes]:
    contract = mf.contract_from_recipe(model_config=CFG, recipe=recipe)
    packed = mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors)
    return {t.name: t.sha256 for t in packed.manifest.tensors}


@pytest.mark.parametrize("recipe_name", ["nvfp4_moe", "int4_qat", "mxfp8", "fp8_block"])
def test_gpu_qat_publishes_the_cpu_reference_bytes_and_refreshes_per_step(recipe_name):
    recipe = Recipe.load(recipe_name)
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    hook = qat.apply_qat(model, recipe, optimizer=opt)
    tokens = torch.randint(0, CFG.vocab_size, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    with torch.autocast("cuda", dtype=torch.bfloat16):
        logp = model.token_logprobs(tokens[:, :-1], tokens[:, 1:])
    assert torch.isfinite(logp).all()
    cached = hook.quantized_params(model)
    cpu_master = {n: p.detach().cpu() for n, p in model.named_parameters()}
    reference = mf.quantize_params(cpu_master, recipe.plan(CFG))  # the CPU reference quantizers
    assert _manifest(model, recipe, cached) == _manifest(model, recipe, reference)

    (-logp.mean()).backward()
    opt.step()  # fused: no version bump; the step post-hook must invalidate
    after = hook.quantized_params(model)
    assert any(after[n] is not cached[n] for n in cached)
    moved = {n: p.detach().cpu() for n, p in model.named_parameters()}
    assert _manifest(model, recipe, after) == _manifest(model, recipe, mf.quantize_params(moved, recipe.plan(CFG)))
