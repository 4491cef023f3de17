"""The grouped-GEMM MoE path (policy.model MoE.grouped, policy.compute.grouped_matmul) against the
loop over experts, and the batched expert quantizer (policy.kernels.quantize_stacked, the QAT
group refill) against quantizing each expert on its own. CPU: torch._grouped_mm's CPU kernel (or
the loop fallback of a torch without it); tests/gpu/test_grouped_gpu.py runs the CUDA kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from policy import formats, kernels
from policy.formats.params import quantize_param
from policy.model import ModelConfig, MoE, Transformer
from policy.qat import apply_qat, bits, quantize_weights
from policy.recipe import Recipe

CASES = [
    ("nvfp4", {"scope": "tensor"}),
    ("nvfp4", {"scope": "row"}),
    ("int4", {"group_size": 32}),
    ("mxfp8", {}),
    ("bf16", {}),
    ("fp8_block", {"block": (32, 32)}),
    ("fp8_block", {"block": (128, 128)}),  # block rows do not divide M: tensor by tensor
]


def _experts(dtype: torch.dtype) -> torch.Tensor:
    """[5, 64, 128] with edge cases: an all-zero expert, a tiny amax (subnormal scales), a huge one."""
    x = torch.randn(5, 64, 128, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0
    x[2] *= 1e-38
    x[3] *= 1e30
    x[4, :, :16] = 0.0  # zero blocks inside a non-zero tensor
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "kw"), CASES)
def test_quantize_stacked_equals_each_tensor_alone(fmt, kw, dtype):
    x = _experts(dtype)
    flat, qs = kernels.quantize_stacked(fmt, x, **kw)
    assert len(qs) == 5
    for e, q in enumerate(qs):
        ref = formats.get(fmt).quantize(x[e], **kw)  # the per-tensor CPU reference
        assert q.shape == ref.shape == (64, 128)
        assert set(q.parts()) == set(ref.parts())
        for part, t in ref.parts().items():
            assert q.parts()[part].dtype == t.dtype
            assert torch.equal(bits(q.parts()[part]), bits(t)), (fmt, kw, e, part)
        assert torch.equal(bits(formats.operand(q).values), bits(formats.operand(ref).values))
    if flat is not None:  # the experts' tensors are rows of one stacked tensor
        first = dataclasses.fields(qs[0])[0].name
        ptrs = {getattr(q, first).untyped_storage().data_ptr() for q in qs}
        assert len(ptrs) == 1


@pytest.mark.parametrize(("fmt", "kw"), CASES)
def test_quantize_stacked_takes_a_list_of_tensors_as_their_stack(fmt, kw):
    x = _experts(torch.float32)
    listed, _ = kernels.quantize_stacked(fmt, [t.clone() for t in x], check_finite=False, **kw)
    stacked, _ = kernels.quantize_stacked(fmt, x, check_finite=False, **kw)
    if stacked is None:
        assert listed is None
        return
    for part, t in stacked.parts().items():
        assert torch.equal(bits(listed.parts()[part]), bits(t)), (fmt, kw, part)


def test_quantize_stacked_rejects_bad_input():
    with pytest.raises(ValueError, match=r"\[E, M, K\]"):
        kernels.quantize_stacked("int4", torch.zeros(4, 32))
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        kernels.quantize_stacked("int4", [torch.zeros(4, 32), torch.zeros(4, 64)])
    with pytest.raises(ValueError, match="non-empty list"):
        kernels.quantize_stacked("int4", [])
    x = torch.zeros(2, 4, 32)
    x[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.quantize_stacked("nvfp4", x)


def _model(dtype=torch.float32) -> Transformer:
    cfg = ModelConfig.preset("tiny", n_layers=2)
    return Transformer(cfg, seed=0).to(dtype)


def _set_grouped(model: Transformer, grouped: bool) -> None:
    for m in model.modules():
        if isinstance(m, MoE):
            m.grouped = grouped


def _loss_and_grads(model: Transformer, tokens: torch.Tensor, grouped: bool):
    _set_grouped(model, grouped)
    model.zero_grad(set_to_none=True)
    logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("recipe", "backward"),
    [(None, "hp"), ("nvfp4_moe", "hp"), ("nvfp4_moe", "dequant"), ("int4_qat", "hp"), ("int4_qat", "dequant"),
     ("mxfp8", "dequant")],
)  # fmt: skip
@pytest.mark.parametrize("n_tokens", [3, 40])  # 3 tokens x top-2 of 8 experts: some experts get none
def test_grouped_equals_loop(recipe, backward, n_tokens):
    model = _model()
    if recipe is not None:
        hook = apply_qat(model, Recipe.load(recipe), backward)
        assert all(hook.can_group(s) for layer in model.model.layers for s in layer.mlp._sites)  # really grouped
    tokens = torch.randint(0, model.cfg.vocab_size, (1, n_tokens), generator=torch.Generator().manual_seed(1))
    ref_logits, ref_grads = _loss_and_grads(model, tokens, grouped=False)
    logits, grads = _loss_and_grads(model, tokens, grouped=True)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-5)
    # The loop leaves an expert that got no token without a gradient; the grouped GEMM gives it zeros.
    assert set(ref_grads) <= set(grads)
    assert all(not grads[n].any() for n in set(grads) - set(ref_grads))
    assert any(".experts." in n for n in ref_grads)
    for n, g in ref_grads.items():
        torch.testing.assert_close(grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_grouped_falls_back_to_the_loop_for_block_scales():
    """fp8_block's per-K-block scales have no grouped GEMM: the MoE loops (same result either way)."""
    model = _model()
    hook = apply_qat(model, Recipe.load("fp8_block"))
    moe = model.model.layers[0].mlp
    assert not hook.can_group(moe._sites[0])
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    ref, _ = _loss_and_grads(model, tokens, grouped=False)
    out, _ = _loss_and_grads(model, tokens, grouped=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("recipe", ["nvfp4_moe", "int4_qat", "mxfp8", "fp8_block"])
def test_group_refill_is_what_each_expert_alone_gives(recipe):
    """The QAT cache after a group refill: every expert's operand equals the per-tensor operand rule
    bit for bit, and the published parts equal quantize_weights' (the publish reuses them)."""
    model = _model()
    hook = apply_qat(model, Recipe.load(recipe))
    qp = hook.quantized_params(model)
    published = quantize_weights(model, hook.plan)
    params = dict(model.named_parameters())
    experts = [n for n in params if ".experts." in n]
    assert experts
    for n in params:
        assert set(qp[n].value.parts()) == set(published[n].parts())
        for part, t in published[n].parts().items():
            assert torch.equal(bits(qp[n].value.parts()[part]), bits(t)), (n, part)
    for n in experts:
        entry = hook.plan[n]
        ref = formats.operand(quantize_param(params[n], entry.format, **entry.kwargs).value)
        op = hook.operand(n, params[n])
        assert torch.equal(bits(op.values), bits(ref.values)), n
        for a, b in ((op.scale, ref.scale), (op.block_scale, ref.block_scale)):
            assert (a is None) == (b is None) and (a is None or torch.equal(bits(a), bits(b))), n


def test_group_refill_follows_the_weights():
    """An in-place edit of one expert (its version bumps) refills its group; invalidate() drops the
    stacked operand with the cache."""
    model = _model()
    hook = apply_qat(model, Recipe.load("nvfp4_moe"))
    p = model.model.layers[0].mlp.experts[3].gate_up_proj.weight
    name = "model.layers.0.mlp.experts.3.gate_up_proj.weight"
    before = hook.operand(name, p).values.clone()
    with torch.no_grad():
        p.mul_(2.0)
    after = hook.operand(name, p)
    ref = formats.operand(quantize_param(p, "nvfp4", scope="tensor").value)
    assert torch.equal(bits(after.values), bits(ref.values)) and torch.equal(bits(after.scale), bits(ref.scale))
    assert torch.equal(bits(after.values), bits(before))  # a power-of-two scaling moves the global scale only
    hook.invalidate()
    assert all(g.stacked is None for g in hook._groups.values())


def test_grouped_forward_follows_an_edited_expert():
    """After an in-place edit of one expert (its version bumps, no optimizer step) the grouped
    forward refills the group: it equals the forward of a fresh QAT hook."""
    model = _model()
    for m in model.modules():
        if isinstance(m, MoE):
            m.grouped = True
    apply_qat(model, Recipe.load("int4_qat"))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = model(tokens)
        model.model.layers[0].mlp.experts[3].gate_up_proj.weight.mul_(-3.0)
        edited = model(tokens)
        apply_qat(model, Recipe.load("int4_qat"))
        fresh = model(tokens)
    assert not torch.equal(edited, before)
    assert torch.equal(edited, fresh)
