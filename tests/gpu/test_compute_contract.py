"""The Compute contract on the GPU (device machine only: bench/run_device.sh).

The Triton 4-bit matmuls' effective operands equal `policy.formats.operand` bit for bit: run on
one-hot inputs (x = I, global scales 1) each output is a single product, so the kernel returns the
operand it multiplied, exactly; with one-hot activation operands and the real scales each output is
one product through the contract's epilogue, so it must equal `policy.compute.matmul` bit for bit;
on random inputs the outputs agree up to accumulation order. QAT on CUDA (Triton quantizers) and
the engine's fused activation quantizer give the CPU reference's operands bit for bit.
(Bitwise here means up to the sign of zero: a sum of products of zeros has sign +.)"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

import policy.kernels as K  # noqa: E402
import rollout.kernels as RK  # noqa: E402
from policy import compute, formats, qat  # noqa: E402
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.recipe import BUILTINS, Recipe  # noqa: E402
from rollout import fused_glue, packed_weights  # noqa: E402
from rollout.kernels import matmul_triton as mt  # noqa: E402

DEV = "cuda"
FID = {"nvfp4": mt.FMT_NVFP4, "int4": mt.FMT_INT4}
FUSED = fused_glue.Ops(True)  # the engine's torch.compile'd glue (nvfp4 activation operand values)


def _weight(fmt: str, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, n)[:, None]
    return formats.nvfp4.quantize(w) if fmt == "nvfp4" else formats.int4.quantize(w, group_size=32)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal up to the sign of zero."""
    a, b = a.detach().cpu().float() + 0.0, b.detach().cpu().float() + 0.0
    return torch.equal(qat.bits(a), qat.bits(b))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
@pytest.mark.parametrize("use_asm", [True, False])
def test_kernels_read_back_the_weight_operand_bitwise(fmt, use_asm):
    n, k, e = 256, 512, 3
    qs = [_weight(fmt, n, k, seed) for seed in range(e)]
    ops = [formats.operand(q) for q in qs]
    eye = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    p = RK.pack(K.to_device(qs[0], DEV))
    ones = torch.ones(1, device=DEV) if fmt == "nvfp4" else None
    for cfg in (None, (32, 256, 2, 2, 1), (64, 128, 2, 2, 4)):  # default (split-K), unsplit, two MMA tiles per warp
        y = mt.w4a16_matmul(eye, p.codes, p.scales, ones, FID[fmt], p.group_size, config=cfg, use_asm=use_asm)
        assert _same(y.T, ops[0].values), (fmt, cfg)
    stack = RK.pack_experts([K.to_device(q, DEV) for q in qs])
    ids = (torch.arange(k, device=DEV) % e)[:, None]
    ones = torch.ones(e, device=DEV) if fmt == "nvfp4" else None
    y = mt.moe_w4a16_matmul(eye, stack.codes, stack.scales, ones, ids, FID[fmt], stack.group_size, use_asm=use_asm)
    for j in range(e):
        assert _same(y[j::e, 0].T, ops[j].values[:, j::e]), (fmt, j)


def _one_hot_activations(k: int, seed: int):
    """nvfp4 row-scope activation operand whose row m has one nonzero value, at column m."""
    g = torch.Generator().manual_seed(seed)
    x = torch.diag(torch.randn(k, generator=g) * torch.logspace(-3, 3, k))
    return formats.nvfp4.operand(formats.nvfp4.quantize(x.to(torch.bfloat16), scope="row"))


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_epilogue_applies_x_then_w_scales_bitwise(fmt):
    n, k = 384, 512
    q = _weight(fmt, n, k, seed=7)
    w_op = formats.operand(q)
    x_op = _one_hot_activations(k, seed=8)
    want = compute.matmul(x_op, w_op, torch.bfloat16)  # CPU reference: one product per output
    p = RK.pack(K.to_device(q, DEV))
    xv, xs = x_op.values.to(DEV), x_op.scale.to(DEV)
    for cfg in (None, (32, 256, 2, 2, 1)):
        y = mt.w4a16_matmul(xv, p.codes, p.scales, p.global_scale, FID[fmt], p.group_size, config=cfg, x_scale=xs)
        assert _same(y, want), (fmt, cfg)
    stack = RK.pack_experts([K.to_device(q, DEV)])
    ids = torch.zeros(k, 1, dtype=torch.int64, device=DEV)
    y = mt.moe_w4a16_matmul(xv, stack.codes, stack.scales, stack.global_scale, ids, FID[fmt], 32, x_scale=xs)
    assert _same(y[:, 0], want)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4"])
def test_random_inputs_match_the_contract_up_to_accumulation_order(fmt):
    for n, k, m in [(1024, 2048, 1), (1024, 2048, 37), (2048, 768 * 2, 16)]:
        q = _weight(fmt, n, k, seed=n + m)
        w_op = formats.operand(q)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        for x_op in (compute.plain(x), formats.nvfp4.operand(formats.nvfp4.quantize(x, scope="row"))):
            want = compute.matmul(x_op, w_op, torch.float32)
            p = RK.pack(K.to_device(q, DEV))
            xs = None if x_op.scale is None else x_op.scale.to(DEV)
            y = mt.w4a16_matmul(x_op.values.to(DEV), p.codes, p.scales, p.global_scale, FID[fmt], 32, x_scale=xs)
            # fp32 sums in another order, then one bf16 rounding: within a bf16 ulp or two of the row scale.
            tol = want.abs().amax(dim=1, keepdim=True) * 2**-12 + want.abs() * 2**-8
            assert ((y.cpu().float() - want).abs() <= tol).all(), (fmt, n, k, m)


CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=4)


@pytest.mark.parametrize("recipe", BUILTINS)
def test_qat_on_cuda_uses_the_cpu_operands_bitwise(recipe):
    cpu = Transformer(CFG, seed=3)
    gpu = Transformer(CFG, seed=3).to(DEV)
    r = Recipe.load(recipe)
    h_cpu, h_gpu = qat.apply_qat(cpu, r), qat.apply_qat(gpu, r)
    gp = dict(gpu.named_parameters())
    for n, p in cpu.named_parameters():
        a, b = h_cpu.operand(n, p), h_gpu.operand(n, gp[n])
        assert b.values.is_cuda and a.block == b.block, n
        for u, v in ((a.values, b.values), (a.scale, b.scale), (a.block_scale, b.block_scale)):
            assert (u is None and v is None) or torch.equal(qat.bits(u), qat.bits(v.cpu())), n
    for e in h_cpu.plan.activations:
        if e.format == "bf16":
            continue
        site, spec = e.name, h_cpu.act_quant.sites[e.name]
        x = torch.randn(40, e.shape[1], generator=torch.Generator().manual_seed(1)) * 5
        a, b = h_cpu.act_quant(site, x), h_gpu.act_quant(site, x.to(DEV))
        assert torch.equal(qat.bits(a.values), qat.bits(b.values.cpu())), site
        # the engine's site quantizer (fused nvfp4 operand on CUDA) gives the same operand
        c = packed_weights.ActQuant(*spec)(x.to(DEV), FUSED)
        assert torch.equal(qat.bits(a.values), qat.bits(c.values.cpu())), site
        for s in ("scale", "block_scale"):
            u, v, w = getattr(a, s), getattr(b, s), getattr(c, s)
            assert (u is None and v is None and w is None) or (
                torch.equal(qat.bits(u), qat.bits(v.cpu())) and torch.equal(qat.bits(u), qat.bits(w.cpu()))
            ), (site, s)
