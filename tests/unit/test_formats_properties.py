"""Property tests of the quantizer contract (hypothesis): row independence, power-of-two
scale invariance and sign symmetry, for every format where the property holds."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from policy.formats import fp8_block, int4, mxfp8, nvfp4

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def matrices(draw, block: int, nonzero: bool = False, exp_range=(-8, 8)):
    """[M, K] fp32 with rows of very different magnitudes, some zeros and exact ties."""
    m = draw(st.integers(1, 6))
    k = block * draw(st.integers(1, 3))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    row_exp = torch.randint(exp_range[0], exp_range[1] + 1, (m, 1), generator=g).float()
    x = (torch.rand(m, k, generator=g) * 2 - 1) * torch.exp2(row_exp)
    if draw(st.booleans()):  # values on the E2M1/E4M3 grid produce exact rounding ties
        x = torch.round(x * 8) / 8
    if nonzero:
        x = torch.where(x == 0, torch.exp2(row_exp).expand_as(x), x)
        # every group also holds a large element, keeping int4 away from its 1e-5 scale floor
        x[:, ::block] = torch.exp2(row_exp) * 0.75
    elif draw(st.booleans()):
        x[torch.rand(m, k, generator=g) < 0.3] = 0.0
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    return x.to(dtype)


def _u8(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


# Row-local formats: (name, quantize, row view of every byte part)
ROW_LOCAL = {
    "nvfp4-row": (16, lambda x: nvfp4.quantize(x, scope="row")),
    "mxfp8": (32, mxfp8.quantize),
    "int4": (32, int4.quantize),
    "fp8-1x128": (128, lambda x: fp8_block.quantize(x, block=(1, 128))),
}


def _row_bytes(q, i: int) -> list[torch.Tensor]:
    return [_u8(p[i : i + 1]) for p in q.parts().values()]


@SETTINGS
@given(data=st.data(), which=st.sampled_from(sorted(ROW_LOCAL)))
def test_row_bytes_do_not_depend_on_other_rows(data, which):
    block, quant = ROW_LOCAL[which]
    x = data.draw(matrices(block))
    q = quant(x)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    other = x.clone()
    other[1:] = other[1:] * 1000 + 1  # change every other row
    qp, qo = quant(x[perm]), quant(other)
    for new_pos, old_row in enumerate(perm.tolist()):
        assert all(torch.equal(a, b) for a, b in zip(_row_bytes(qp, new_pos), _row_bytes(q, old_row)))
    assert all(torch.equal(a, b) for a, b in zip(_row_bytes(qo, 0), _row_bytes(q, 0)))


@SETTINGS
@given(data=st.data(), scope=st.sampled_from(nvfp4.SCOPES), p=st.integers(-20, 20))
def test_nvfp4_power_of_two_scaling(data, scope, p):
    x = data.draw(matrices(16))
    a, b = nvfp4.quantize(x, scope=scope), nvfp4.quantize(x * 2.0**p, scope=scope)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(_u8(a.block_scales), _u8(b.block_scales))
    nz = a.global_scale != 1.0  # all-zero scope keeps S_dec = 1
    assert torch.equal(a.global_scale[nz] * 2.0**p, b.global_scale[nz])


@SETTINGS
@given(data=st.data(), p=st.integers(-20, 20))
def test_mxfp8_and_fp8_block_power_of_two_scaling(data, p):
    x = data.draw(matrices(128, nonzero=True))
    a, b = mxfp8.quantize(x), mxfp8.quantize(x * 2.0**p)
    assert torch.equal(_u8(a.codes), _u8(b.codes))
    assert torch.equal(a.scales.int() + p, b.scales.int())
    for block in ((128, 128), (1, 128)):
        a, b = fp8_block.quantize(x, block=block), fp8_block.quantize(x * 2.0**p, block=block)
        assert torch.equal(_u8(a.codes), _u8(b.codes))
        assert torch.equal(a.scale_inv * 2.0**p, b.scale_inv)


@SETTINGS
@given(data=st.data(), p=st.integers(-6, 6))
def test_int4_power_of_two_scaling_above_the_scale_floor(data, p):
    x = data.draw(matrices(32, nonzero=True, exp_range=(-4, 8)))
    a, b = int4.quantize(x), int4.quantize(x * 2.0**p)
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.scales.float() * 2.0**p, b.scales.float())


@SETTINGS
@given(data=st.data())
def test_negation_flips_only_sign_bits(data):
    x = data.draw(matrices(128, nonzero=True))
    for scope in nvfp4.SCOPES:
        a, b = nvfp4.quantize(x, scope=scope), nvfp4.quantize(-x, scope=scope)
        assert torch.equal(a.codes ^ 0x88, b.codes)
        assert torch.equal(_u8(a.block_scales), _u8(b.block_scales)) and torch.equal(a.global_scale, b.global_scale)
    a, b = mxfp8.quantize(x), mxfp8.quantize(-x)
    assert torch.equal(_u8(a.codes) ^ 0x80, _u8(b.codes)) and torch.equal(a.scales, b.scales)
    a, b = fp8_block.quantize(x), fp8_block.quantize(-x)
    assert torch.equal(_u8(a.codes) ^ 0x80, _u8(b.codes)) and torch.equal(a.scale_inv, b.scale_inv)
    a, b = int4.quantize(x), int4.quantize(-x)  # int4 is two's complement: the code negates
    assert torch.equal(-a.codes, b.codes) and torch.equal(_u8(a.scales), _u8(b.scales))
