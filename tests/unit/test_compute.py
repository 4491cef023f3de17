"""The Compute contract (policy.compute, policy.formats.operand): hand-checked operands per format,
the matmul's scale placement, and QAT == the CPU engines' operands bit for bit for every recipe."""

from __future__ import annotations

import pytest
import torch

from policy import compute, formats, qat
from policy.formats import bf16, fp8_block, int4, mxfp8, nvfp4
from policy.model import ModelConfig, Transformer
from policy.recipe import BUILTINS, Recipe
from rollout.packed_engine import EngineConfig, PackedEngine

E4M3_BYTES = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # every finite E4M3


def _e4m3(byts: torch.Tensor) -> torch.Tensor:
    return byts.view(torch.float8_e4m3fn)


def _bits(t):
    return qat.bits(t)


def test_nvfp4_operand_is_e2m1_times_block_scale_exactly_for_every_code_and_scale():
    """All 16 codes x every non-negative finite E4M3 block scale: bf16 values equal the exact product."""
    sf = _e4m3(E4M3_BYTES[E4M3_BYTES < 0x80])  # block scales are non-negative
    m = sf.numel()
    codes = torch.arange(16, dtype=torch.uint8).repeat(m, 1)  # one block per row: codes 0..15
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    q = nvfp4.NVFP4Tensor(packed, sf[:, None], torch.full((1,), 0.37), (m, 16), "tensor")
    op = nvfp4.operand(q)
    assert op.values.dtype == torch.bfloat16 and op.block_scale is None and op.scale is q.global_scale
    want = nvfp4.E2M1_VALUES.double()[None, :] * sf.double()[:, None]
    assert torch.equal(op.values.double(), want)
    assert torch.equal(op.values[:, 8].view(torch.int16), torch.full((m,), -32768, dtype=torch.int16))  # -0 kept


def test_nvfp4_operand_of_a_quantization_and_its_row_scales():
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 4, 5)[:, None]
    q = nvfp4.quantize(x, scope="row")
    op = nvfp4.operand(q)
    vals = nvfp4.E2M1_VALUES[nvfp4.unpack_codes(q.codes).long()].view(5, 4, 16) * q.block_scales.float()[..., None]
    assert torch.equal(op.values.float(), vals.view(5, 64)) and torch.equal(op.scale, q.global_scale)
    torch.testing.assert_close(op.dequantize(), nvfp4.dequantize(q), rtol=2**-23, atol=0)


def test_mxfp8_operand_is_exact_for_scale_bytes_3_to_246_and_rounded_outside():
    codes = _e4m3(E4M3_BYTES)
    exact = 0
    for e in range(255):
        q = mxfp8.MXFP8Tensor(codes[:224].view(7, 32), torch.full((7, 1), e, dtype=torch.uint8), (7, 32))
        op = mxfp8.operand(q)
        assert op.values.dtype == torch.bfloat16 and op.scale is None and op.block_scale is None
        product = codes[:224].double().view(7, 32) * 2.0 ** (e - 127)
        if 3 <= e <= 246:
            assert torch.equal(op.values.double(), product), e
            exact += 1
        else:  # the fp32 product (what dequantize gives) rounded to bf16
            assert torch.equal(_bits(op.values), _bits(mxfp8.dequantize(q).to(torch.bfloat16))), e
            assert not torch.equal(op.values.double(), product), e  # some products leave bf16 there
    assert exact == 244


def test_int4_operand_is_bf16_of_q_times_s_rounded_once():
    scales = torch.tensor([0.0123, 1.0, 3.3e-5, 0.7], dtype=torch.bfloat16)
    codes = torch.arange(-7, 8, dtype=torch.int8)
    codes = torch.cat([codes, codes.new_zeros(1)]).repeat(4, 2)  # [4, 32]
    q = int4.INT4Tensor(codes, scales[:, None], 32, (4, 32))
    op = int4.operand(q)
    exact = codes.double() * scales.double()[:, None]  # q x s is exact in fp32 (3 x 8 bits)
    assert torch.equal(op.values, exact.to(torch.bfloat16)) and op.scale is None
    assert not torch.equal(op.values.double(), exact)  # the rounding to bf16 really happens


def test_fp8_block_and_bf16_operands():
    w = torch.randn(200, 256, generator=torch.Generator().manual_seed(1))
    q = fp8_block.quantize(w)
    op = fp8_block.operand(q)
    assert torch.equal(op.values.double(), q.codes.double()) and op.values.dtype == torch.bfloat16
    assert op.block_scale is q.scale_inv and op.block == (128, 128) and op.scale is None
    assert torch.equal(op.dequantize(), fp8_block.dequantize(q))  # one product per element either way
    b = bf16.quantize(w)
    assert bf16.operand(b).values is b.values


def test_matmul_applies_block_partial_sums_then_x_then_w_scales():
    """y = dtype((acc * sx[m]) * sw): against float64 arithmetic, and the order of the two scales."""
    g = torch.Generator().manual_seed(2)
    xv = (torch.randn(6, 32, generator=g) * 8).to(torch.bfloat16)
    wv = (torch.randn(4, 32, generator=g) * 8).to(torch.bfloat16)
    acc = xv.double() @ wv.double().T
    # Scales picked so that (acc * sx) * sw and acc * (sx * sw) round differently in fp32.
    for seed in range(100):
        sx = torch.rand(6, generator=torch.Generator().manual_seed(seed)) + 0.5
        sw = torch.rand(1, generator=torch.Generator().manual_seed(seed + 1000)) + 0.5
        a32 = xv.float() @ wv.float().T
        if not torch.equal((a32 * sx[:, None]) * sw, a32 * (sx[:, None] * sw)):
            break
    y = compute.matmul(formats.Operand(xv, scale=sx), formats.Operand(wv, scale=sw), torch.float32)
    assert torch.equal(y, ((xv.float() @ wv.float().T) * sx[:, None]) * sw)
    assert not torch.equal(y, (xv.float() @ wv.float().T) * (sx[:, None] * sw))
    torch.testing.assert_close(y.double(), acc * sx.double()[:, None] * sw.double(), rtol=1e-6, atol=0)
    # fp8_block: per-K-block partial sums times scale_inv_x x scale_inv_w.
    bx = torch.rand(6, 2, generator=g) + 0.1
    bw = torch.rand(1, 2, generator=g) + 0.1
    y = compute.matmul(
        formats.Operand(xv, block_scale=bx, block=(1, 16)),
        formats.Operand(wv, block_scale=bw, block=(8, 16)),
        torch.float32,
    )
    want = sum(
        (xv.double()[:, b * 16 : b * 16 + 16] @ wv.double()[:, b * 16 : b * 16 + 16].T)
        * (bx[:, b, None] * bw[0, b]).double()
        for b in range(2)
    )
    torch.testing.assert_close(y.double(), want, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="K mismatch"):
        compute.matmul(formats.Operand(xv), formats.Operand(wv[:, :16]), torch.float32)


def test_operand_split_keeps_row_scales_with_their_rows():
    v = torch.randn(5, 32).to(torch.bfloat16)
    op = formats.Operand(v, scale=torch.arange(5.0), block_scale=torch.rand(5, 2), block=(1, 16))
    a, b = op.split([2, 3])
    assert torch.equal(a.values, v[:2]) and torch.equal(b.scale, torch.arange(2.0, 5.0))
    assert torch.equal(b.block_scale, op.block_scale[2:]) and a.block == (1, 16)


CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=4)


# bf16 and fp8_block take over 2 s each on a 2-core box: `make test` runs them, `make test-fast` does not.
@pytest.mark.parametrize(
    "recipe", [pytest.param(r, marks=pytest.mark.slow) if r in ("bf16", "fp8_block") else r for r in BUILTINS]
)
def test_qat_and_both_cpu_engines_use_bitwise_identical_operands(recipe):
    """Weights: QAT's operand == rollout.engine's (PackedHook) == PackedEngine's, bit for bit;
    activations: PackedEngine's site quantizer == QAT's; outputs agree up to accumulation order."""
    model = Transformer(CFG, seed=4)
    r = Recipe.load(recipe)
    hook = qat.apply_qat(model, r)
    plan = hook.plan
    packed = qat.quantize_weights(model, plan)
    eng = PackedEngine(CFG, plan, packed, device="cpu", dtype=torch.float32, engine=EngineConfig(max_batch=4))
    ref = Transformer(CFG, seed=None)
    packed_hook = qat.install_packed(ref, plan, packed)
    params = dict(model.named_parameters())

    def same(a: formats.Operand, b: formats.Operand) -> bool:
        pairs = ((a.values, b.values), (a.scale, b.scale), (a.block_scale, b.block_scale))
        return all((u is None and v is None) or torch.equal(_bits(u), _bits(v)) for u, v in pairs)

    for n, p in params.items():
        assert same(hook.operand(n, p), packed_hook.operand(n, p)), n
    L = eng.layers[0]
    lin = {"self_attn.q_proj": L.q, "self_attn.o_proj": L.o, "mlp.gate": L.gate}
    for site, linear in lin.items():
        want = hook.operand(f"model.layers.0.{site}.weight", params[f"model.layers.0.{site}.weight"])
        assert same(want, linear.w), site
    for e in range(CFG.n_experts):
        for kind, attr in (("gate_up_proj", "gu"), ("down_proj", "dn")):
            name = f"model.layers.0.mlp.experts.{e}.{kind}.weight"
            want = hook.operand(name, params[name])
            if L.experts.plain:
                assert torch.equal(_bits(getattr(L.experts, f"w_{attr}")[e]), _bits(want.values.float())), name
            else:
                assert same(want, getattr(L.experts, f"op_{attr}")[e]), name
    x = torch.randn(7, CFG.dim, generator=torch.Generator().manual_seed(5)) * 3
    for site, act in (("self_attn.q_proj", L.q.act), ("mlp.experts.0.gate_up_proj", L.experts.act_gu)):
        mine = hook.act_quant(f"model.layers.0.{site}.input", x)
        assert (mine is None) == (act is None), site
        if act is not None:
            assert same(mine, act(x, eng.plain)), site
    # Outputs: the engine's behavior log-probs against QAT's recompute of the same sequence.
    prompt = [1, 2, 3, 4, 5]
    g = eng.generate([prompt], max_new_tokens=8, temperature=1.0, seeds=[7])
    seq = torch.tensor([prompt + g.tokens[0].tolist()])
    with torch.no_grad():
        lp = model.token_logprobs(seq[:, :-1], seq[:, 1:])[0, len(prompt) - 1 :]
    d = (g.logprobs[0] - lp).abs()
    assert d.median() < 1e-5 and d.max() < 5e-3, d
