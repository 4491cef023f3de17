"""MXFP8 (OCP microscaling): E4M3 values in 32-element blocks with an E8M0 (power-of-two) scale.

The scale is rounded up so that the block maximum never exceeds 448 after scaling:

    d    = fp32(bamax * fp32(1/448))
    e    = biased exponent of d, +1 if its mantissa != 0
           (except e == 254, or e == 0 with mantissa <= 0x400000: d <= 2^-127 already fits)
    code = e4m3_rne(clamp(x * 2^(127 - e), -448, 448));  stored scale byte = e
    dequant = code * 2^(e - 127)

Zeros keep their IEEE sign through the E4M3 cast (-0 -> 0x80), as the hardware converts do.
Row-wise and column-wise copies are separate quantizations of the high-precision input:
quantize `x` and `x.t()` separately; a transpose of the codes is not a valid column copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import E4M3_MAX, Operand, amax, blocks, check_input, check_shape, fp32, to_e4m3

BLOCK = 32


def block_shape(**params) -> tuple[int, int]:
    """(rows, cols) of one quantization block: one row of 32 along K."""
    return 1, BLOCK


@dataclass(frozen=True)
class MXFP8Tensor:
    codes: torch.Tensor  # float8_e4m3fn [M, K]
    scales: torch.Tensor  # uint8 biased E8M0 exponents [M, K//32]
    shape: tuple[int, int]

    def parts(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scales": self.scales}


def pow2(n: torch.Tensor) -> torch.Tensor:
    """Exact fp32 2**n for integer n in [-127, 127], built from bits (2^-127 is subnormal)."""
    n = n.to(torch.int32)
    bits = torch.where(n >= -126, (n + 127) << 23, torch.full_like(n, 1 << 22))
    return bits.view(torch.float32)


def e8m0_round_up(d: torch.Tensor) -> torch.Tensor:
    """Biased E8M0 exponent (int32) of the smallest power of two >= d, for fp32 d >= 0."""
    bits = d.view(torch.int32)
    e = (bits >> 23) & 0xFF
    mant = bits & 0x7FFFFF
    up = (mant != 0) & (e != 254) & ~((e == 0) & (mant <= 0x400000))
    return e + up.to(torch.int32)


def scale_exponent(bamax: torch.Tensor) -> torch.Tensor:
    """Stored scale byte for block maxima `bamax` (fp32): the exponent of d = fp32(bamax * fp32(1/448))."""
    return e8m0_round_up(bamax * fp32(1.0 / 448.0))


def quantize(x: torch.Tensor) -> MXFP8Tensor:
    xf = check_input(x, BLOCK, "mxfp8.quantize")
    m, k = xf.shape
    xb = blocks(xf, BLOCK)
    e = scale_exponent(amax(xb, dim=-1))
    v = torch.clamp(xb * pow2(127 - e).unsqueeze(-1), -E4M3_MAX, E4M3_MAX)
    return MXFP8Tensor(to_e4m3(v).view(m, k), e.to(torch.uint8), (m, k))


def dequantize(q: MXFP8Tensor) -> torch.Tensor:
    m, k = q.shape
    scale = pow2(q.scales.to(torch.int32) - 127)
    return (q.codes.to(torch.float32).view(m, k // BLOCK, BLOCK) * scale.unsqueeze(-1)).view(m, k)


def operand(q: MXFP8Tensor) -> Operand:
    """The Compute contract's operand: code x 2^(e-127) in bf16 (exact for scale bytes 3..246; at
    0-2 and 247-254 the fp32 product rounded to bf16, nearest even); no post-accumulator scale."""
    return Operand(dequantize(q).to(torch.bfloat16))


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    return dequantize(quantize(x)).to(x.dtype)


def from_parts(parts: dict[str, torch.Tensor], shape) -> MXFP8Tensor:
    m, k = (int(s) for s in shape)
    if k % BLOCK:
        raise ValueError(f"mxfp8.from_parts: K={k} is not divisible by {BLOCK}")
    scales = check_shape("scales", parts["scales"], (m, k // BLOCK), torch.uint8)
    if bool((scales == 255).any()):
        raise ValueError("mxfp8.from_parts: scale byte 255 (E8M0 NaN) is not a valid scale")
    return MXFP8Tensor(check_shape("codes", parts["codes"], (m, k), torch.float8_e4m3fn), scales, (m, k))
