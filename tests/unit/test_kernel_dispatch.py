"""policy.kernels on a machine without a GPU: dispatch falls back to the reference, and the
bit-level algorithms the GPU kernels use (transcribed in policy.kernels.bitmath) reproduce the
reference exactly. The kernels themselves are checked on the GPU by tests/gpu."""

from __future__ import annotations

import pytest
import torch
from mixed_formats import same_parts as _same  # tests/mixed_formats.py (conftest puts tests/ on sys.path)

import policy.kernels as K
from policy import formats
from policy.formats import int4, nvfp4
from policy.kernels import bitmath

KWARGS = {
    "bf16": {},
    "fp8_block": {"block": (1, 128)},
    "mxfp8": {},
    "nvfp4": {"scope": "row"},
    "int4": {"group_size": 32},
}


# --------------------------------------------------------------------------- dispatch


def test_cpu_tensors_use_the_reference():
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    assert K.backend(x) == "reference"
    for fmt in formats.FORMATS:
        got = K.quantize(fmt, x, **KWARGS[fmt])
        assert _same(got, formats.get(fmt).quantize(x, **KWARGS[fmt])), fmt
        assert torch.equal(K.fake_quant(fmt, x, **KWARGS[fmt]), formats.get(fmt).fake_quant(x, **KWARGS[fmt]))
        ref, op = formats.operand(got), K.operand(got)
        assert torch.equal(op.values.view(torch.uint8), ref.values.view(torch.uint8)), fmt


def test_dispatch_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown quantization format"):
        K.quantize("fp4", torch.zeros(2, 32))
    with pytest.raises(ValueError, match="non-finite"):
        K.quantize("nvfp4", torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match="not a policy.formats quantized tensor"):
        K.dequantize(torch.zeros(2))


# --------------------------------------------------------------------------- bit-level algorithms


def _e2m1_inputs() -> torch.Tensor:
    grid = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0])
    g = torch.Generator().manual_seed(0)
    parts = [
        grid,
        torch.nextafter(grid, torch.tensor(7.0)),
        torch.nextafter(grid, torch.tensor(-1.0)).clamp(min=0),
        torch.rand(200_000, generator=g) * 6.5,
        torch.rand(1000, generator=g) * 1e-38,
        torch.tensor([1e-45, 3e-39]),
    ]
    return torch.cat(parts).clamp(max=6.0)


def test_e2m1_magic_add_rounding_matches_reference():
    a = _e2m1_inputs()
    for x in (a, -a, torch.tensor([0.0, -0.0, -1e-45, -0.1])):
        ref = nvfp4.e2m1_round(torch.clamp(x, -6, 6), x < 0).to(torch.int32)
        got = bitmath.e2m1_code(x.abs().clamp(max=6.0), x.view(torch.int32))
        assert torch.equal(got, ref)
    assert bitmath.e2m1_code(torch.tensor([0.0]), torch.tensor([-0.0]).view(torch.int32)).item() == 0  # -0 -> code 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_multiply_by_reciprocal_equals_division(dtype):
    """The int4 kernel's rint(x * RN(1/s)) == the contract's rint(x / s), for every 16-bit x
    with |x / s| < 16 and every bf16 scale significand (powers of two scale both sides alike),
    plus scales at the 1e-5 floor."""
    sig = 1.0 + torch.arange(128, dtype=torch.float32) / 128  # every bf16 significand in [1, 2)
    scales = torch.cat([sig, sig * 2.0**-17, int4.quantize(torch.zeros(1, 8), group_size=8).scales.float().flatten()])
    allx = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).float()
    allx = allx[torch.isfinite(allx)]
    for s in scales:
        x = allx[allx.abs() < 16 * s]
        ref = torch.round(torch.div(x, s.expand_as(x))).to(torch.int32)
        assert torch.equal(bitmath.int4_codes_16bit(x, s.expand_as(x)), ref), float(s)


def test_e4m3_software_rounding_matches_torch_cast():
    e4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    e4 = torch.sort(e4[torch.isfinite(e4) & (e4.abs() <= 448)].unique()).values
    mids = (e4[1:] + e4[:-1]) / 2
    g = torch.Generator().manual_seed(1)
    v = torch.cat(
        [
            e4,
            mids,
            torch.nextafter(mids, torch.tensor(1e9)),
            torch.nextafter(mids, torch.tensor(-1e9)),
            (torch.rand(100_000, generator=g) * 2 - 1) * 448,
            torch.randn(1000, generator=g) * 1e-38,
            torch.tensor([0.0, -0.0]),
        ]
    ).clamp(-448, 448)
    assert torch.equal(bitmath.e4m3_byte(v), v.to(torch.float8_e4m3fn).view(torch.uint8))


def test_repack_round_trips_and_pairs_are_k_consecutive():
    g = torch.Generator().manual_seed(2)
    nib = torch.randint(0, 16, (3, 5, 128), generator=g, dtype=torch.uint8)
    words = bitmath.repack(nib)
    assert words.dtype == torch.int32 and words.shape == (3, 5, 16)
    assert torch.equal(bitmath.unrepack(words), nib)
    # Output P_j of word h in block b carries elements 16b + 4j + 2h and 16b + 4j + 2h + 1.
    flat = nib.reshape(-1, 128).to(torch.int64)
    w = words.reshape(-1, 16)
    for j in range(4):
        lo, hi = bitmath.pair_lanes(w, j)
        for word in range(16):
            b, h = divmod(word, 2)
            assert torch.equal(lo[:, word], flat[:, 16 * b + 4 * j + 2 * h])
            assert torch.equal(hi[:, word], flat[:, 16 * b + 4 * j + 2 * h + 1])


def test_nvfp4_ptx_bit_trick_gives_exact_e2m1_values():
    """P_j's bf16 lanes are e2m1 * 2^-126 for every code (sign, subnormal 0.5 and -0 included)."""
    codes = torch.arange(16, dtype=torch.uint8)
    nib = codes.repeat(8)[:128].reshape(1, 128)
    words = bitmath.repack(nib)
    for j in range(4):
        vals = bitmath.bf16_word_to_values(bitmath.nvfp4_pairs(words, j))
        lo, hi = bitmath.pair_lanes(words, j)
        expect = torch.stack([nvfp4.E2M1_VALUES[lo], nvfp4.E2M1_VALUES[hi]], dim=-1)
        assert torch.equal(vals.double() * 2.0**126, expect.double())
        assert torch.equal(torch.signbit(vals), torch.signbit(expect))


def test_nvfp4_scaled_tile_is_exact_in_bf16():
    """e2m1 * sf * 2^-7 (what the tensor cores see) is exactly representable in bf16 for every
    code and every finite E4M3 scale, so the kernel's tile carries no rounding."""
    sf = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    prod = nvfp4.E2M1_VALUES[:, None] * sf[None, :] * 2.0**-7
    assert torch.equal(prod.to(torch.bfloat16).float(), prod)


def test_int4_bit_trick_is_exact():
    n = torch.arange(16, dtype=torch.int32)
    word = (n & 0xF) | 0x4300  # bf16 of 128 + n
    v = (word << 16).view(torch.float32)
    assert torch.equal(v - 136.0, (n - 8).float())
