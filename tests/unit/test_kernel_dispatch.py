"""policy.kernels on a machine without a GPU: dispatch falls back to the reference, and the
bit-level algorithms the GPU kernels use (transcribed in policy.kernels.bitmath) reproduce the
reference exactly. The kernels themselves are checked on the GPU by tests/gpu."""

from __future__ import annotations

import pytest
import torch

import policy.kernels as K
from policy import formats
from policy.formats import fp8_block, int4, mxfp8, nvfp4
from policy.kernels import bitmath
from policy.kernels.routing import BLOCK_M, moe_align

KWARGS = {
    "bf16": {},
    "fp8_block": {"block": (1, 128)},
    "mxfp8": {},
    "nvfp4": {"scope": "row"},
    "int4": {"group_size": 32},
}


def _same(a, b) -> bool:
    pa, pb = a.parts(), b.parts()
    return pa.keys() == pb.keys() and all(
        pa[n].dtype == pb[n].dtype
        and torch.equal(pa[n].contiguous().view(torch.uint8), pb[n].contiguous().view(torch.uint8))
        for n in pa
    )


# --------------------------------------------------------------------------- dispatch


def test_cpu_tensors_use_the_reference():
    x = torch.randn(8, 256, dtype=torch.bfloat16)
    assert K.backend(x) == "reference"
    for fmt in formats.FORMATS:
        got = K.quantize(fmt, x, **KWARGS[fmt])
        assert _same(got, formats.get(fmt).quantize(x, **KWARGS[fmt])), fmt
        assert torch.equal(K.fake_quant(fmt, x, **KWARGS[fmt]), formats.get(fmt).fake_quant(x, **KWARGS[fmt]))


def test_dispatch_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown quantization format"):
        K.quantize("fp4", torch.zeros(2, 32))
    with pytest.raises(ValueError, match="non-finite"):
        K.quantize("nvfp4", torch.tensor([[float("nan")] * 16]))
    with pytest.raises(ValueError, match="scope='tensor'"):
        K.pack(nvfp4.quantize(torch.randn(4, 32), scope="row"))
    with pytest.raises(ValueError, match="not a policy.formats quantized tensor"):
        K.dequantize(torch.zeros(2))
    with pytest.raises(ValueError, match="unknown format"):
        K.PackedLinear("fp3", (1, 1))


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


# --------------------------------------------------------------------------- packing and matmul


def test_pack_unpack_round_trip():
    w = torch.randn(64, 256)
    for q in (nvfp4.quantize(w, scope="tensor"), int4.quantize(w, group_size=32), int4.quantize(w, group_size=64)):
        p = K.pack(q)
        assert p.codes.dtype == torch.int32 and p.codes.shape == (64, 32)
        assert _same(K.unpack(p), q)
    # int4 words hold the compressed-tensors offset-8 nibbles.
    q = int4.quantize(w)
    assert torch.equal(bitmath.unrepack(K.pack(q).codes).to(torch.int16) - 8, q.codes.to(torch.int16))


def test_reference_qmatmul_is_dequant_matmul():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 256, generator=g)
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    for q in (nvfp4.quantize(w), int4.quantize(w), mxfp8.quantize(w), formats.bf16.quantize(w)):
        y = K.qmatmul(x, q)
        assert y.dtype == torch.bfloat16 and y.shape == (5, 48)
        assert torch.equal(y, (x.float() @ formats.get(K._format_name(q)).dequantize(q).T).to(torch.bfloat16))
    # fp8_block is W8A8: x goes through 1x128 tiles first, on every backend.
    q = fp8_block.quantize(w, block=(128, 128))
    xq = fp8_block.dequantize(fp8_block.quantize(x, block=(1, 128)))
    assert torch.equal(K.qmatmul(x, q), (xq @ fp8_block.dequantize(q).T).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"x must be \[M, 256\]"):
        K.qmatmul(x[:, :128], q)


def test_moe_qmatmul_reference_equals_per_token_loop():
    g = torch.Generator().manual_seed(4)
    experts = [nvfp4.quantize(torch.randn(32, 128, generator=g)) for _ in range(6)]
    stack = K.pack_experts(experts)
    assert stack.num_experts == 6 and stack.codes.shape == (6, 32, 16) and stack.global_scale.shape == (6,)
    x = torch.randn(7, 128, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(6, generator=g)[:3] for _ in range(7)])
    y = K.moe_qmatmul(x, stack, ids)
    for t in range(7):
        for j in range(3):
            assert torch.equal(y[t, j], K.qmatmul(x[t : t + 1], experts[int(ids[t, j])])[0])
    with pytest.raises(ValueError, match="expert ids"):
        K.moe_qmatmul(x, stack, ids + 6)
    with pytest.raises(ValueError, match="moe_qmatmul"):
        K.qmatmul(x, stack)
    with pytest.raises(ValueError, match="differ from expert 0"):
        K.pack_experts([experts[0], nvfp4.quantize(torch.randn(16, 128))])


def test_moe_align_groups_pairs_by_expert_in_blocks():
    g = torch.Generator().manual_seed(5)
    for t, e, topk in [(1, 128, 8), (9, 8, 2), (40, 5, 3)]:
        ids = torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(t)])
        pairs, block_expert, num_blocks, max_blocks = moe_align(ids, e)
        nb = int(num_blocks)
        assert nb <= max_blocks and pairs.shape == (max_blocks * BLOCK_M,)
        seen = []
        for b in range(nb):
            rows = pairs[b * BLOCK_M : (b + 1) * BLOCK_M]
            valid = rows[rows >= 0]
            assert valid.numel() > 0
            assert bool((ids.reshape(-1)[valid.long()] == block_expert[b]).all())  # one expert per block
            assert torch.equal(valid, torch.sort(valid).values)  # stable: pair order kept
            seen += valid.tolist()
        assert sorted(seen) == list(range(t * topk))  # every pair exactly once
        assert bool((pairs[nb * BLOCK_M :] == -1).all())
