"""policy.qat: STE backward modes, QAT == packed weights bit for bit, per-token activation quant, probe."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from policy import formats
from policy.model import ModelConfig, Transformer
from policy.qat import (
    ActivationQuantizer,
    QATHook,
    apply_qat,
    bits,
    dequantize_packed,
    install_packed,
    load_packed,
    probe_mismatch,
    quantize_weights,
    remove_qat,
)
from policy.recipe import BUILTINS, Recipe
from rollout.engine import generate
from tandem import cli

TINY = ModelConfig.preset("tiny")
SITE = "model.layers.0.mlp.experts.1.down_proj"  # nvfp4 weight (tensor) and input (row) in nvfp4_moe


@pytest.fixture(scope="module")
def nvfp4_plan():
    return Recipe.load("nvfp4_moe").plan(TINY)


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 7, 256, generator=g).requires_grad_()
    w = (torch.randn(128, 256, generator=g) * 0.05).requires_grad_()
    return x, w, torch.randn(2, 7, 128, generator=g)


def test_hp_backward_equals_plain_linear_gradient(nvfp4_plan):
    x, w, gy = _operands()
    hook = QATHook(nvfp4_plan, backward="hp")
    y = hook.linear(SITE, x, w)
    y.backward(gy)
    gx, gw = x.grad.clone(), w.grad.clone()

    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear(x2, w2).backward(gy)
    torch.testing.assert_close(gx, x2.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, w2.grad, rtol=1e-6, atol=1e-6)
    # ...while the forward really was the Compute contract's (weights per tensor, inputs per token):
    # (x_values . w_values in fp32) * S_dec_x[row] * S_dec_w, with values e2m1 x sf.
    xq = formats.nvfp4.quantize(x.detach().reshape(-1, 256), scope="row")
    wq = formats.nvfp4.quantize(w.detach(), scope="tensor")
    acc = formats.nvfp4.operand(xq).values.float() @ formats.nvfp4.operand(wq).values.float().T
    assert torch.equal(y.detach().view(-1, 128), acc * xq.global_scale[:, None] * wq.global_scale)
    assert not torch.equal(y.detach(), F.linear(x.detach(), w.detach()))


def test_dequant_backward_uses_the_forward_operands(nvfp4_plan):
    x, w, gy = _operands(1)
    QATHook(nvfp4_plan, backward="dequant").linear(SITE, x, w).backward(gy)
    # The dequantized operands: values x their scales (here e2m1 x sf x S_dec, = the reference dequant).
    x_hat = formats.nvfp4.fake_quant(x.detach().reshape(-1, 256), scope="row").view_as(x).requires_grad_()
    w_hat = formats.nvfp4.fake_quant(w.detach(), scope="tensor").requires_grad_()
    F.linear(x_hat, w_hat).backward(gy)
    torch.testing.assert_close(x.grad, x_hat.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, w_hat.grad, rtol=1e-6, atol=1e-6)
    # The modes differ, so the test above can tell them apart.
    x.grad = w.grad = None
    QATHook(nvfp4_plan, backward="hp").linear(SITE, x, w).backward(gy)
    assert not torch.allclose(w.grad, w_hat.grad)


def test_bad_backward_mode(nvfp4_plan):
    with pytest.raises(ValueError, match="backward='fp8'"):
        QATHook(nvfp4_plan, backward="fp8")


def test_qat_model_trains_and_every_parameter_gets_a_gradient():
    m = Transformer(TINY, seed=0)
    apply_qat(m, Recipe.load("nvfp4_moe"), backward="hp")
    toks = torch.randint(0, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    m.token_logprobs(toks, toks.roll(-1, 1)).mean().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None]
    # Experts that no token was routed to get no gradient; everything else must.
    assert all(".experts." in n for n in missing)
    assert m.lm_head.weight.grad.abs().sum() > 0 and m.model.embed_tokens.weight.grad.abs().sum() > 0
    assert m.model.layers[0].input_layernorm.weight.grad.abs().sum() > 0


def test_effective_weights_follow_optimizer_steps_even_fused():
    """The cache must notice fused AdamW updates, which do not bump the autograd version counter:
    the optimizer given to apply_qat invalidates it after every step."""
    m = Transformer(TINY, seed=0)
    toks = torch.randint(0, TINY.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True)
    hook = apply_qat(m, Recipe.load("int4_qat"), optimizer=opt)
    m.token_logprobs(toks, toks).sum().backward()
    name = "model.layers.0.self_attn.q_proj.weight"
    before = hook.effective(name, m.get_parameter(name)).clone()
    opt.step()
    after = hook.effective(name, m.get_parameter(name))
    assert not torch.equal(before, after)
    assert torch.equal(after, m.get_parameter(name).detach().to(torch.bfloat16).float())


@pytest.mark.parametrize("recipe", BUILTINS)
def test_qat_and_packed_operands_are_bitwise_identical(recipe):
    """Trainer (QAT) and CPU rollout (the published tensors after transport) compute with the same operands."""
    g = torch.Generator().manual_seed(2)
    trainer = Transformer(TINY, seed=3)
    with torch.no_grad():  # make the weights less uniform than the init: heavier tails, an outlier
        for p in trainer.parameters():
            if p.ndim == 2:
                p.mul_(1 + torch.rand(p.shape, generator=g) * 3)
        trainer.model.layers[0].mlp.experts[0].down_proj.weight[3, 5] = 0.9
    r = Recipe.load(recipe)
    hook = apply_qat(trainer, r)

    # Transport: parts() / from_parts() as the gRPC path does.
    packed = quantize_weights(trainer, r)
    plan = hook.plan
    shipped = {}
    for n, q in packed.items():
        e = plan[n]
        kw = {"scope": q.scope} if e.format == "nvfp4" else e.kwargs
        shipped[n] = formats.get(e.format).from_parts({k: v.clone() for k, v in q.parts().items()}, q.shape, **kw)
    rollout = Transformer(TINY, seed=99)
    packed_hook = install_packed(rollout, r, shipped)

    for n, p in trainer.named_parameters():
        a, b = hook.operand(n, p), packed_hook.operand(n, rollout.get_parameter(n))
        assert a.values.dtype == torch.bfloat16 and a.block == b.block, n
        for u, v in ((a.values, b.values), (a.scale, b.scale), (a.block_scale, b.block_scale)):
            assert (u is None and v is None) or torch.equal(bits(u), bits(v)), n
        assert torch.equal(bits(hook.effective(n, p)), bits(packed_hook.effective(n, p))), n
    toks = torch.randint(0, TINY.vocab_size, (3, 10), generator=g)
    with torch.no_grad():  # the same code on the same shapes: outputs equal bit for bit too
        assert torch.equal(bits(trainer(toks)), bits(rollout(toks)))
    eff = hook.effective_weights(trainer)
    if recipe != "bf16":  # the recipe really changed something
        assert not torch.equal(
            eff["model.layers.0.mlp.experts.0.down_proj.weight"],
            trainer.model.layers[0].mlp.experts[0].down_proj.weight.detach(),
        )


def test_gate_and_up_share_one_global_scale():
    m = Transformer(TINY, seed=0)
    with torch.no_grad():  # make up's range very different from gate's
        m.model.layers[0].mlp.experts[2].gate_up_proj.weight[256:] *= 10
    q = quantize_weights(m, Recipe.load("nvfp4_moe"))["model.layers.0.mlp.experts.2.gate_up_proj.weight"]
    assert q.shape == (512, 128) and q.scope == "tensor" and q.global_scale.shape == (1,)
    w = m.model.layers[0].mlp.experts[2].gate_up_proj.weight.detach()
    gate_alone = formats.nvfp4.quantize(w[:256])
    assert not torch.equal(gate_alone.global_scale, q.global_scale)


def test_activation_quant_is_per_token(nvfp4_plan):
    aq = ActivationQuantizer(nvfp4_plan)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 128, generator=g) * torch.logspace(-3, 3, 9)[:, None]
    name = "model.layers.1.mlp.experts.0.gate_up_proj.input"
    full = aq(name, x)
    for i in range(9):
        one = aq(name, x[i : i + 1])
        assert torch.equal(bits(one.values), bits(full.values[i : i + 1]))
        assert torch.equal(bits(one.scale), bits(full.scale[i : i + 1]))
    q = formats.nvfp4.quantize(x, scope="row")
    assert torch.equal(bits(full.values), bits(formats.nvfp4.operand(q).values)) and torch.equal(
        full.scale, q.global_scale
    )
    torch.testing.assert_close(full.dequantize(), formats.nvfp4.dequantize(q), rtol=2**-23, atol=0)
    assert aq("model.layers.1.self_attn.q_proj.input", x) is None  # bf16 site: unquantized


def test_grouped_input_quant_equals_per_site(nvfp4_plan):
    """The MoE block quantizes all experts' inputs in one call; that must equal one call per expert."""
    aq = ActivationQuantizer(nvfp4_plan)
    x = torch.randn(10, 256, generator=torch.Generator().manual_seed(8)) * torch.logspace(-2, 2, 10)[:, None]
    counts = [2, 5, 3]
    for layers in ((0, 0, 0), (0, 3, 1)):  # layer 3 is kept in bf16: a mixed group
        names = [f"model.layers.{i}.mlp.experts.{e}.down_proj.input" for i, e in zip(layers, (0, 3, 5))]
        grouped = aq.quantize_rows(names, x, counts).split(counts)
        per_site = [aq(n, c) for n, c in zip(names, x.split(counts))]
        for a, b in zip(grouped, per_site):
            assert (a is None and b is None) or (
                torch.equal(bits(a.values), bits(b.values)) and torch.equal(bits(a.scale), bits(b.scale))
            )
    assert grouped[1] is None  # the bf16 layer's chunk
    assert aq.quantize_rows(["model.layers.3.mlp.experts.0.down_proj.input"], x, [10]) is None


def test_rollout_generation_is_batch_independent():
    m = Transformer(TINY, seed=5)
    r = Recipe.load("nvfp4_moe")
    install_packed(m, r, quantize_weights(m, r))
    prompts = [[1, 2, 3, 4], [5], [6, 7]]
    batch = generate(m, prompts, max_new_tokens=6, seeds=[1, 2, 3])
    alone = generate(m, [prompts[1]], max_new_tokens=6, seeds=[2])
    assert alone.tokens[0].tolist() == batch.tokens[1].tolist()
    torch.testing.assert_close(alone.logprobs[0], batch.logprobs[1], rtol=2e-5, atol=2e-5)


def test_load_packed_rejects_incomplete_sets():
    m = Transformer(TINY, seed=0)
    packed = quantize_weights(m, Recipe.load("bf16"))
    packed.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing"):
        load_packed(m, packed)
    with pytest.raises(ValueError, match="not a policy.formats"):
        dequantize_packed(torch.zeros(2, 2))


def test_probe_mismatch():
    m = Transformer(TINY, seed=0)
    toks = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(6))
    res = probe_mismatch(m, Recipe.load("nvfp4_moe"), toks)
    assert res["weights_bitwise_equal"] and res["logits_bitwise_equal"]
    assert res["pairs"]["qat~packed"] == {"mean_abs_dlogp": 0.0, "max_abs_dlogp": 0.0, "kl": 0.0}
    assert res["pairs"]["bf16~qat"]["mean_abs_dlogp"] > 0 and res["pairs"]["bf16~qat"]["kl"] > 0
    assert res["tokens"] == 2 * 15
    assert m.quant_hook is None  # restored
    base = probe_mismatch(m, Recipe.load("bf16"), toks)
    assert all(v == 0.0 for pair in base["pairs"].values() for v in pair.values())


def test_cli_probe_json(capsys):
    assert (
        cli.main(["probe", "--model", "tiny", "--recipe", "int4_qat", "--batch", "2", "--seq-len", "8", "--json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    (res,) = out["results"]
    assert res["recipe"] == "int4_qat" and res["weights_bitwise_equal"]
    assert res["pairs"]["qat~packed"]["kl"] == 0.0 and res["pairs"]["bf16~packed"]["mean_abs_dlogp"] > 0


def test_remove_qat_restores_plain_forward():
    m = Transformer(TINY, seed=0)
    toks = torch.randint(0, TINY.vocab_size, (1, 5))
    with torch.no_grad():
        plain = m(toks)
        apply_qat(m, Recipe.load("nvfp4_moe"))
        assert not torch.equal(m(toks), plain)
        remove_qat(m)
        assert torch.equal(m(toks), plain)


def test_qat_cache_is_refreshed_by_in_place_edits_and_feeds_the_publish():
    """Outside a registered optimizer, an in-place edit bumps the autograd version counter and the
    cache refreshes; the publish reuses the forward's quantized objects, which equal a fresh quantize."""
    from policy.formats.params import quantize_params

    m = Transformer(TINY, seed=0)
    recipe = Recipe.load("int4_qat")
    hook = apply_qat(m, recipe)
    name = "model.layers.0.self_attn.q_proj.weight"
    p = m.get_parameter(name)
    before = hook.effective(name, p).clone()
    with torch.no_grad():
        p.mul_(1.5)
    assert not torch.equal(before, hook.effective(name, p))
    cached = hook.quantized_params(m)
    assert hook.quantized_params(m)[name] is cached[name]  # no second quantization
    fresh = quantize_params(dict(m.named_parameters()), recipe.plan(m))
    for n, q in fresh.items():
        assert q.format == cached[n].format and q.kwargs == cached[n].kwargs
        for part, t in q.value.parts().items():
            assert torch.equal(bits(t), bits(cached[n].value.parts()[part])), (n, part)
