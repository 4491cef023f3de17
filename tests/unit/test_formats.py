"""The quantizer contract (DESIGN.md) checked with hand-derived vectors and properties.

Hand vectors are built so every intermediate value is exact: a global amax of 2688 * 2^-p
makes S_enc = 2^p and S_dec = 2^-p, and a block max of 6 * 2^(q-p) then gets the block
scale 2^q, so the codes are plain E2M1 roundings of x * 2^(p-q).
"""

from __future__ import annotations

import pytest
import torch

from policy import formats
from policy.formats import fp8_block, int4, mxfp8, nvfp4

FLT_MAX = torch.finfo(torch.float32).max


# ----------------------------------------------------------------------------------- E4M3
def _e4m3_table() -> torch.Tensor:
    """All finite non-negative E4M3 (fn) values by code 0..126, computed from the bit layout."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return torch.tensor(vals, dtype=torch.float64)


def _e4m3_rne_independent(v: torch.Tensor) -> torch.Tensor:
    """Nearest E4M3 code by exhaustive search, ties to the even code (values <= 448)."""
    table = _e4m3_table()
    a = v.abs().double().unsqueeze(-1)
    dist = (a - table).abs()
    best = dist.min(dim=-1, keepdim=True).values
    cands = dist == best
    even = cands & (torch.arange(127) % 2 == 0)
    code = torch.where(even.any(-1), even.int().argmax(-1), cands.int().argmax(-1))
    return code.to(torch.uint8) | ((v < 0) | ((v == 0) & (torch.signbit(v)))).to(torch.uint8) << 7


def test_torch_e4m3_cast_is_round_to_nearest_even_including_subnormals_and_ties():
    table = _e4m3_table().float()
    mids = (table[1:] + table[:-1]) / 2  # every tie (exact in fp32)
    near = torch.cat(
        [mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, torch.full_like(mids, 1e9))]
    )
    vals = torch.cat(
        [table, near, torch.rand(5000) * 448, torch.rand(2000) * 2**-6, torch.tensor([2**-10, 2**-11, 448.0])]
    )
    vals = torch.cat([vals, -vals]).float()
    ours = vals.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, _e4m3_rne_independent(vals))


# ----------------------------------------------------------------------------------- NVFP4
def _nib(q) -> torch.Tensor:
    return nvfp4.unpack_codes(q.codes)


def test_e2m1_ties_round_to_even_and_signs():
    mags = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]
    want = [0, 0, 1, 2, 2, 2, 3, 4, 4, 4, 5, 6, 6, 6, 7]
    v = torch.tensor(mags)
    assert nvfp4.e2m1_round(v, v < 0).tolist() == want
    neg = -v
    got = nvfp4.e2m1_round(neg, neg < 0).tolist()
    assert got[0] == 0  # exactly -0.0 is not "< 0": code 0
    assert got[1:] == [c | 8 for c in want[1:]]  # -0.25 rounds to zero but keeps its sign: code 8


def _hand_block(values_times_2p_minus_q: list[float], p: int = 10, q: int = 0) -> torch.Tensor:
    """Row of two blocks: block 0 sets amax = 2688*2^-p; block 1 holds v * 2^(q-p) with max 6*2^(q-p)."""
    b0 = [2688 * 2.0**-p] + [0.0] * 15
    b1 = [v * 2.0 ** (q - p) for v in values_times_2p_minus_q]
    return torch.tensor([b0 + b1], dtype=torch.float32)


def test_nvfp4_hand_vector_ties_and_exact_scales():
    v = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -5.0, 0.0, -0.0, 0.1, -6.0, 4.4]
    x = _hand_block(v, p=10, q=0)
    q = nvfp4.quantize(x)
    assert q.global_scale.item() == 2.0**-10  # S_dec
    assert q.block_scales.float().tolist() == [[448.0, 1.0]]
    codes = _nib(q)[0, 16:].tolist()
    assert codes == [7, 0, 2, 2, 4, 4, 6, 6, 8, 8 | 2, 8 | 6, 0, 0, 0, 8 | 7, 6]
    # packing: element 2j in the low nibble
    assert q.codes[0, 8].item() == 7 | (0 << 4) and q.codes[0, 9].item() == 2 | (2 << 4)
    deq = nvfp4.dequantize(q)[0, 16:]
    expect = torch.tensor([6, 0, 1, 1, 2, 2, 4, 4, -0.0, -1, -4, 0, 0, 0, -6, 4]) * 2.0**-10
    assert torch.equal(deq, expect)


def test_nvfp4_zero_tensor_row_and_block():
    z = torch.zeros(3, 32)
    for scope in nvfp4.SCOPES:
        q = nvfp4.quantize(z, scope=scope)
        assert q.codes.eq(0).all() and q.block_scales.float().eq(0).all()
        assert q.global_scale.eq(1.0).all()  # amax == 0 -> S_enc = 1 -> S_dec = 1
        assert nvfp4.dequantize(q).eq(0).all()
    x = torch.randn(3, 32)
    x[1] = 0.0
    x[2, :16] = 0.0
    q = nvfp4.quantize(x, scope="row")
    assert q.global_scale[1].item() == 1.0 and _nib(q)[1].eq(0).all()
    assert q.block_scales[2, 0].float().item() == 0.0 and _nib(q)[2, :16].eq(0).all()


def test_nvfp4_negative_zero_input_gives_code_zero():
    x = torch.tensor([[-0.0] * 8 + [1.0] * 8])
    assert _nib(nvfp4.quantize(x))[0, :8].eq(0).all()


def test_nvfp4_zero_block_scale_saturates_codes_but_dequantizes_to_zero():
    x = torch.zeros(1, 32)
    x[0, 0] = 1e30
    x[0, 16:] = torch.linspace(-1e-30, 1e-30, 16)
    q = nvfp4.quantize(x)
    assert q.block_scales[0, 1].float().item() == 0.0
    c = _nib(q)[0, 16:]
    nonzero = x[0, 16:] != 0
    assert (c[nonzero] & 7).eq(7).all()  # enc = FLT_MAX: clamp to ±6
    assert nvfp4.dequantize(q)[0, 16:].abs().max().item() == 0.0


def test_nvfp4_subnormal_block_scale():
    # Block 1's max is 1e-3 of the global amax: bamax * k = 0.448 * ... lands in E4M3 subnormals.
    x = torch.zeros(1, 32)
    x[0, :16] = 1.0
    x[0, 16:] = torch.linspace(-1, 1, 16) * 1e-5
    q = nvfp4.quantize(x)
    sf = q.block_scales.view(torch.uint8)[0, 1].item()
    assert 0 < sf < 8, "block scale should be an E4M3 subnormal"
    err = (nvfp4.dequantize(q)[0, 16:] - x[0, 16:]).abs().max().item()
    assert err <= 0.5e-5  # coarse (subnormal scale) but bounded by the block max


def test_nvfp4_max_finite_values():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.finfo(dtype).max
        x = torch.full((2, 16), big, dtype=dtype)
        x[:, 1::2] *= -1
        for scope in nvfp4.SCOPES:
            q = nvfp4.quantize(x, scope=scope)
            assert _nib(q)[:, 0::2].eq(7).all() and _nib(q)[:, 1::2].eq(15).all()
            assert q.block_scales.float().eq(448).all()
            d = nvfp4.dequantize(q)
            assert torch.isfinite(d).all()
            assert torch.allclose(d, x.float(), rtol=1e-6)


def test_nvfp4_rows_spanning_1e_minus30_to_1e30():
    exps = torch.arange(-30, 31, 5, dtype=torch.float64)
    x = (torch.randn(len(exps), 64, dtype=torch.float64) * 10.0 ** exps[:, None]).float()
    q = nvfp4.quantize(x, scope="row")
    d = nvfp4.dequantize(q)
    rel = (d - x).double().norm(dim=1) / x.double().norm(dim=1)  # fp64: fp32 norms over/underflow
    assert torch.isfinite(d).all() and rel.max().item() < 0.2
    # one tensor-scope scale over 60 decades: small rows collapse to zero, nothing blows up
    qt = nvfp4.quantize(x, scope="tensor")
    dt = nvfp4.dequantize(qt)
    assert torch.isfinite(dt).all()
    assert ((dt[-1] - x[-1]).double().norm() / x[-1].double().norm()).item() < 0.2
    assert dt[0].abs().max() <= x[0].abs().max()


# ----------------------------------------------------------------------------------- MXFP8
def test_mxfp8_scale_rounds_up_and_hand_vector():
    # bamax = 448 * 2^3 -> d = 8 exactly (mantissa 0): e = 127 + 3, codes = x / 8
    x = torch.zeros(1, 64)
    x[0, :32] = torch.tensor([3584.0, -3584.0, 8.0, 0.5] + [0.0] * 28)
    # bamax = 449 -> d = 449/448 > 1: rounds up to e = 128; x / 2 = 224.5 -> 224 (tie to even)
    x[0, 32:36] = torch.tensor([449.0, 448.0 + 0.0, 1.0, -0.0])
    q = mxfp8.quantize(x)
    assert q.scales.tolist() == [[130, 128]]
    assert q.codes[0, :4].float().tolist() == [448.0, -448.0, 1.0, 0.0625]
    assert q.codes[0, 32:36].float().tolist() == [224.0, 224.0, 0.5, 0.0]
    assert q.codes.view(torch.uint8)[0, 35].item() == 0x80  # IEEE -0 survives the E4M3 cast


def test_mxfp8_exponent_rounding_rule_on_exact_d():
    cases = {  # bits of d -> stored exponent
        0x00000000: 0,  # zero block
        0x00000001: 0,  # smallest subnormal: 2^-127 already covers it
        0x00400000: 0,  # d == 2^-127 exactly
        0x00400001: 1,  # just above 2^-127
        0x3F800000: 127,  # d == 1
        0x3F800001: 128,  # just above 1: round up
        0x7F000000: 254,  # 2^127
        0x7F7FFFFF: 254,  # FLT_MAX: capped, no 255 (NaN)
    }
    d = torch.tensor(list(cases), dtype=torch.int32).view(torch.float32)
    assert mxfp8.e8m0_round_up(d).tolist() == list(cases.values())


def test_mxfp8_zero_and_max_blocks():
    zero = mxfp8.quantize(torch.zeros(2, 32))
    assert zero.scales.eq(0).all() and zero.codes.view(torch.uint8).eq(0).all()
    big = mxfp8.quantize(torch.full((1, 32), FLT_MAX))
    assert big.scales.item() == 247  # FLT_MAX/448 = 2^119.x: exponent 246, mantissa != 0 -> 247
    assert big.codes.view(torch.uint8)[0, 0].item() == 0x78  # FLT_MAX * 2^-120 rounds up to 2^8
    # ... so its dequantized value 2^8 * 2^120 overflows fp32: inherent to E8M0 scaling.
    assert mxfp8.dequantize(big)[0, 0].item() == float("inf")


def test_mxfp8_requantizing_dequantized_reproduces_values_and_bytes():
    """Re-quantizing a dequantized MXFP8 tensor gives the same values, and the same bytes in
    every block except those whose max rounded to exactly 224 * 2^k: there d becomes an exact
    power of two, the round-up rule no longer fires, and the same values come back with a
    scale one smaller and codes twice as large (e.g. max 57.66 -> 224 * 2^-2 -> 448 * 2^-3)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-3, 3, 64)[:, None]
    q = mxfp8.quantize(x)
    d = mxfp8.dequantize(q)
    q2 = mxfp8.quantize(d)
    assert torch.equal(mxfp8.dequantize(q2), d)
    top = q.codes.float().abs().view(64, -1, 32).amax(-1) == 224
    assert top.any(), "the sample should contain the boundary case"
    assert torch.equal(q.scales[~top], q2.scales[~top])
    assert torch.equal(q.scales[top].int() - 1, q2.scales[top].int())
    same = (~top).repeat_interleave(32, dim=1)
    assert torch.equal(q.codes.view(torch.uint8)[same], q2.codes.view(torch.uint8)[same])


# ----------------------------------------------------------------------------------- INT4
def test_int4_hand_vector_ties_floor_and_packing():
    # amax = 7 -> s = bf16(7 * fp32(1/7)) = 1.0; x / 1 rounds half to even.
    row = [7.0, -7.0, 0.5, 1.5, 2.5, -0.5, -2.5, 3.49] + [0.0] * 24
    q = int4.quantize(torch.tensor([row]))
    assert q.scales.float().tolist() == [[1.0]]
    assert q.codes[0, :8].tolist() == [7, -7, 0, 2, 2, 0, -2, 3]
    w = q.packed()
    assert w.dtype == torch.int32 and w.shape == (1, 4)
    nibbles = [c + 8 for c in [7, -7, 0, 2, 2, 0, -2, 3]]
    assert w[0, 0].item() & 0xFFFFFFFF == sum(n << (4 * i) for i, n in enumerate(nibbles))
    assert torch.equal(int4.unpack(w), q.codes)
    # all-zero group: the scale floor 1e-5 (rounded to bf16), codes 0
    z = int4.quantize(torch.zeros(2, 32))
    assert z.scales.float().eq(torch.tensor(1e-5).to(torch.bfloat16).float()).all() and z.codes.eq(0).all()
    # clamp: amax/s slightly above 7 after bf16 rounding of s never escapes [-7, 7]
    r = int4.quantize(torch.randn(64, 256) * 100)
    assert r.codes.abs().max() <= 7


def test_int4_group_sizes_and_max_values():
    x = torch.randn(4, 128)
    for g in (8, 16, 32, 64, 128):
        q = int4.quantize(x, group_size=g)
        assert q.scales.shape == (4, 128 // g)
    big = int4.quantize(torch.full((1, 32), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16))
    assert big.codes.eq(7).all() and torch.isfinite(int4.dequantize(big)).all()


# ----------------------------------------------------------------------------------- FP8 block
def test_fp8_block_hand_vector_and_partial_rows():
    x = torch.zeros(130, 256)
    x[0, 0] = 448.0 * 4  # block (0,0): S = 0.25 exactly
    x[1, 1] = -3.0
    x[129, 200] = 7.0  # partial row-block (1, 1): S = 64
    q = fp8_block.quantize(x)
    assert q.scale_inv.shape == (2, 2)
    s11 = torch.div(torch.tensor(1.0), torch.div(torch.tensor(448.0), torch.tensor(7.0))).item()
    assert q.scale_inv.tolist() == [[4.0, 1.0], [1.0, s11]]  # empty blocks: S = 1
    assert q.codes[0, 0].float().item() == 448.0 and q.codes[1, 1].float().item() == -0.75
    a = fp8_block.quantize(x, block=(1, 128))
    assert a.scale_inv.shape == (130, 2)
    assert torch.equal(fp8_block.dequantize(a)[1], x[1])


# ----------------------------------------------------------------------------------- all formats
CASES = [
    ("nvfp4", {"scope": "tensor"}, 16),
    ("nvfp4", {"scope": "row"}, 16),
    ("mxfp8", {}, 32),
    ("int4", {"group_size": 32}, 32),
    ("fp8_block", {"block": (128, 128)}, 128),
    ("fp8_block", {"block": (1, 128)}, 128),
    ("bf16", {}, 1),
]


def _bytes(q) -> dict[str, torch.Tensor]:
    return {k: v.contiguous().view(torch.uint8) for k, v in q.parts().items()}


@pytest.mark.parametrize("name,kw,block", CASES)
def test_input_errors(name, kw, block):
    m = formats.get(name)
    with pytest.raises(ValueError, match="2-D"):
        m.quantize(torch.randn(256), **kw)
    with pytest.raises(ValueError, match="dtype"):
        m.quantize(torch.ones(2, 256, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="non-finite"):
        bad = torch.randn(2, 256)
        bad[1, 3] = float("nan")
        m.quantize(bad, **kw)
    with pytest.raises(ValueError, match="non-finite"):
        m.quantize(torch.full((2, 256), float("inf")), **kw)
    if block > 1:
        with pytest.raises(ValueError, match="divisible"):
            m.quantize(torch.randn(2, 256 + block // 2 if block > 1 else 257), **kw)


def test_bad_parameters_and_unknown_format():
    with pytest.raises(ValueError, match="scope"):
        nvfp4.quantize(torch.randn(2, 16), scope="column")
    for g in (0, 4, 12, True, 32.0):
        with pytest.raises(ValueError, match="group_size"):
            int4.quantize(torch.randn(2, 48), group_size=g)
    with pytest.raises(ValueError, match="outside"):
        int4.from_parts(
            {"packed": torch.zeros(1, 4, dtype=torch.int32), "scales": torch.ones(1, 1, dtype=torch.bfloat16)}, (1, 32)
        )
    with pytest.raises(ValueError, match="block"):
        fp8_block.quantize(torch.randn(2, 128), block=(128,))
    with pytest.raises(ValueError, match="unknown quantization format 'fp4'"):
        formats.get("fp4")


@pytest.mark.parametrize("name,kw,block", CASES)
def test_parts_round_trip_and_fake_quant_dtype(name, kw, block):
    m = formats.get(name)
    x = torch.randn(128, 256, dtype=torch.bfloat16)
    q = m.quantize(x, **kw)
    q2 = m.from_parts({k: v.clone() for k, v in q.parts().items()}, q.shape, **kw)
    assert torch.equal(m.dequantize(q), m.dequantize(q2))
    fq = m.fake_quant(x, **kw)
    assert fq.dtype == x.dtype and fq.shape == x.shape
    with pytest.raises(ValueError, match="part"):
        parts = dict(q.parts())
        k0 = next(iter(parts))
        parts[k0] = parts[k0][:-1]
        m.from_parts(parts, q.shape, **kw)


@pytest.mark.parametrize("name,kw,block", CASES)
def test_inputs_of_every_float_dtype_agree_after_upcast(name, kw, block):
    m = formats.get(name)
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    a, b = _bytes(m.quantize(x, **kw)), _bytes(m.quantize(x.float(), **kw))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "name,kw,bound",
    [
        ("nvfp4", {"scope": "tensor"}, 0.11),
        ("nvfp4", {"scope": "row"}, 0.11),
        ("mxfp8", {}, 0.035),
        ("int4", {"group_size": 32}, 0.11),
        ("fp8_block", {"block": (128, 128)}, 0.035),
        ("fp8_block", {"block": (1, 128)}, 0.035),
        ("bf16", {}, 0.003),
    ],
)
def test_relative_error_bounds(name, kw, bound):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g)
    m = formats.get(name)
    rel = ((m.dequantize(m.quantize(x, **kw)) - x).norm() / x.norm()).item()
    assert rel < bound, rel


def test_elementwise_error_bounds_per_block():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-2, 2, 64)[:, None]
    # nvfp4 row scope: half the top E2M1 gap (1 of 6) plus E4M3 scale rounding (2^-4)
    d = nvfp4.dequantize(nvfp4.quantize(x, scope="row")) - x
    bmax = x.abs().view(64, -1, 16).amax(-1, keepdim=True)
    assert (d.abs().view(64, -1, 16) <= bmax * (1 / 6 + 1 / 16)).all()
    # mxfp8: 3 mantissa bits -> half ulp is 2^-4 of the block max's binade
    d = mxfp8.dequantize(mxfp8.quantize(x)) - x
    assert (d.abs().view(64, -1, 32) <= x.abs().view(64, -1, 32).amax(-1, keepdim=True) * 2**-4).all()
    # int4: half a step plus the bf16 rounding of the scale
    q = int4.quantize(x)
    d = (int4.dequantize(q) - x).abs().view(64, -1, 32)
    s = q.scales.float().unsqueeze(-1)
    assert (d <= 0.5 * s + x.abs().view(64, -1, 32).amax(-1, keepdim=True) * 2**-7).all()
    d = fp8_block.dequantize(fp8_block.quantize(x, block=(1, 128))) - x
    assert (d.abs().view(64, -1, 128) <= x.abs().view(64, -1, 128).amax(-1, keepdim=True) * 2**-4).all()


def test_nvfp4_given_amax_equals_quantizing_the_whole_row():
    """A TP rank passes the all-reduced amax: its bytes are the slice of the unsharded result."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=g)
    full = nvfp4.quantize(x, scope="row")
    left = nvfp4.quantize(x[:, :32], scope="row", amax=x.abs().amax(dim=1))
    assert torch.equal(left.codes, full.codes[:, :16]) and torch.equal(left.global_scale, full.global_scale)
    assert torch.equal(left.block_scales.view(torch.uint8), full.block_scales[:, :2].view(torch.uint8))
    same = nvfp4.quantize(x, scope="tensor", amax=x.abs().amax().reshape(1))
    assert torch.equal(same.codes, nvfp4.quantize(x).codes)
    with pytest.raises(ValueError, match="at least the row amax"):
        nvfp4.quantize(x, scope="row", amax=x.abs().amax(dim=1) / 2)
    with pytest.raises(ValueError, match="shape"):
        nvfp4.quantize(x, scope="row", amax=torch.ones(1))


@pytest.mark.parametrize(
    ("fmt", "kwargs", "shape"),
    [
        ("nvfp4", {"scope": "row"}, (1, 16)),
        ("mxfp8", {}, (1, 32)),
        ("int4", {"group_size": 64}, (1, 64)),
        ("fp8_block", {"block": (128, 128)}, (128, 128)),
        ("fp8_block", {"block": (1, 128)}, (1, 128)),
        ("bf16", {}, (1, 1)),
    ],
)
def test_block_shape_is_the_grid_of_the_stored_scales(fmt, kwargs, shape):
    """Each format module's block_shape(**quantize kwargs) is the block its scales are stored per."""
    mod = formats.get(fmt)
    assert mod.block_shape(**kwargs) == shape
    x = torch.randn(256, 256)
    q = mod.quantize(x, **kwargs)
    scale = {"nvfp4": "block_scales", "mxfp8": "scales", "int4": "scales", "fp8_block": "scale_inv"}.get(fmt)
    grid = (256, 256) if scale is None else tuple(getattr(q, scale).shape)
    assert grid == (256 // shape[0], 256 // shape[1])
