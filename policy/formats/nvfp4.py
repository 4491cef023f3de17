"""NVFP4: E2M1 values in 16-element blocks, an E4M3 scale per block, an FP32 global scale.

Scope "tensor" (one global scale; weights) or "row" (one per row = per token; activations).
The order of operations is the contract in DESIGN.md, reproduced literally:

    amax  = max|x| over the scope
    S_enc = min(fp32(2688 / amax), FLT_MAX)        (amax == 0 -> S_enc = 1)
    S_dec = fp32(1 / S_enc)                        stored as global_scale
    k     = fp32(S_enc * fp32(1/6))
    sf    = e4m3_rne(min(bamax * k, 448))          stored block scale
    enc   = min(fp32(1 / fp32(float(sf) * S_dec)), FLT_MAX)
    code  = e2m1_rne(clamp(x * enc, -6, 6))        sign of a negative input kept, ±0 -> code 0

A block whose scale rounds to zero gets enc = FLT_MAX, so its nonzero inputs saturate to
codes ±6; their dequantized value is still 0 because the block scale is 0. That is what the
formula says and every implementation must do the same.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ._common import E4M3_MAX, FLT_MAX, Operand, blocks, check_input, check_shape, fp32, to_e4m3
from ._common import amax as abs_max

BLOCK = 16


def block_shape(**params) -> tuple[int, int]:
    """(rows, cols) of one quantization block: one row of 16 along K, whatever the scope."""
    return 1, BLOCK


SCOPES = ("tensor", "row")

# E2M1 code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between neighbouring E2M1 magnitudes, and whether a tie there rounds up: ties go to
# the even code (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


@dataclass(frozen=True)
class NVFP4Tensor:
    codes: torch.Tensor  # uint8 [M, K//2]: element 2j in the low nibble, 2j+1 in the high nibble
    block_scales: torch.Tensor  # float8_e4m3fn [M, K//16]
    global_scale: torch.Tensor  # float32 [1] (tensor scope) or [M] (row scope); this is S_dec
    shape: tuple[int, int]
    scope: str

    def parts(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "block_scales": self.block_scales, "global_scale": self.global_scale}


def e2m1_round(v: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 code (uint8 0..15) of fp32 values already clamped to [-6, 6]; `negative` sets the sign bit."""
    a = v.abs()
    mag = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for mid, tie_up in _MIDPOINTS:
        mag += (a >= mid) if tie_up else (a > mid)
    return mag | (negative.to(torch.uint8) << 3)


def quantize(x: torch.Tensor, scope: str = "tensor", *, amax: torch.Tensor | None = None) -> NVFP4Tensor:
    """`amax`: the scope's max|x| to use instead of this tensor's, fp32 [1] (tensor) or [M] (row),
    never smaller than the local one. Tensor parallelism passes the amax all-reduced over the
    TP group, which makes each rank's bytes the slice of the unsharded quantization."""
    if scope not in SCOPES:
        raise ValueError(f"nvfp4.quantize: scope must be one of {SCOPES}, got {scope!r}")
    xf = check_input(x, BLOCK, "nvfp4.quantize")
    m, k = xf.shape
    xb = blocks(xf, BLOCK)
    bamax = abs_max(xb, dim=-1)  # [M, nb]
    if scope == "row":
        gamax = bamax.amax(dim=1)  # [M]
    else:  # an empty [0, K] tensor has amax 0, like an all-zero one
        gamax = bamax.amax().reshape(1) if m else bamax.new_zeros(1)
    if amax is not None:
        given = torch.as_tensor(amax, dtype=torch.float32, device=xf.device)
        if given.shape != gamax.shape or not bool(torch.isfinite(given).all()) or bool((given < gamax).any()):
            raise ValueError(
                f"nvfp4.quantize: amax must be finite fp32 of shape {tuple(gamax.shape)} and at least "
                f"the {scope} amax of x; got shape {tuple(given.shape)}"
            )
        gamax = given

    # torch.div on two fp32 tensors is one correctly rounded IEEE division ("c / t" in Python
    # would be reciprocal(t) * c: two roundings).
    s_enc = torch.div(torch.full_like(gamax, 2688.0), gamax).clamp(max=FLT_MAX)
    s_enc = torch.where(gamax == 0, torch.ones_like(s_enc), s_enc)
    s_dec = torch.div(torch.ones_like(s_enc), s_enc)
    kk = s_enc * fp32(1.0 / 6.0)

    per_row = (lambda t: t.view(-1, 1)) if scope == "row" else (lambda t: t)
    sf = to_e4m3(torch.clamp(bamax * per_row(kk), max=E4M3_MAX))  # [M, nb]
    block_scale = sf.to(torch.float32) * per_row(s_dec)
    enc = torch.div(torch.ones_like(block_scale), block_scale).clamp(max=FLT_MAX)  # sf == 0 -> inf -> FLT_MAX
    v = torch.clamp(xb * enc.unsqueeze(-1), -6.0, 6.0)
    codes = e2m1_round(v, xb < 0).view(m, k)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return NVFP4Tensor(packed.contiguous(), sf, s_dec, (m, k), scope)


def unpack_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [M, K//2] -> uint8 [M, K] codes 0..15."""
    m, half = codes.shape
    out = torch.empty(m, half, 2, dtype=torch.uint8, device=codes.device)
    out[..., 0] = codes & 0xF
    out[..., 1] = codes >> 4
    return out.view(m, 2 * half)


@functools.cache
def _e2m1_values(device: torch.device) -> torch.Tensor:
    """E2M1_VALUES on `device`, copied once: a host-to-device copy per call is a stream sync."""
    return E2M1_VALUES.to(device)


def dequantize(q: NVFP4Tensor) -> torch.Tensor:
    m, k = q.shape
    values = _e2m1_values(q.codes.device)[unpack_codes(q.codes).long()].view(m, k // BLOCK, BLOCK)
    gs = q.global_scale.view(-1, 1) if q.scope == "row" else q.global_scale
    scale = q.block_scales.to(torch.float32) * gs  # fp32(float(sf) * S_dec)
    return (values * scale.unsqueeze(-1)).view(m, k)


def e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes (uint8 0..15), from bits on any device (no table): the code's
    e1 e0 m bits as fp16 exponent/mantissa bits 11..9 and its sign as bit 15 give value * 2^-14."""
    c = codes.to(torch.int16)
    return (((c & 7) << 9) | ((c & 8) << 12)).view(torch.float16).to(torch.float32) * 16384.0


def operand_values(codes: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """bf16 [M, K] = e2m1 x sf: at most 6 significant bits in [2^-10, 2688], exact in bf16."""
    m, k = codes.shape[0], 2 * codes.shape[1]  # explicit K: a [0, K] tensor (an expert without tokens)
    v = e2m1_value(unpack_codes(codes)).view(m, k // BLOCK, BLOCK) * block_scales.to(torch.float32).unsqueeze(-1)
    return v.view(m, k).to(torch.bfloat16)


def operand(q: NVFP4Tensor) -> Operand:
    """The Compute contract's operand: values e2m1 x sf (bf16, exact); scale S_dec ([1] tensor
    scope, [M] row scope), applied to the fp32 accumulator."""
    return Operand(operand_values(q.codes, q.block_scales), scale=q.global_scale)


def fake_quant(x: torch.Tensor, scope: str = "tensor") -> torch.Tensor:
    return dequantize(quantize(x, scope=scope)).to(x.dtype)


def from_parts(parts: dict[str, torch.Tensor], shape, scope: str = "tensor") -> NVFP4Tensor:
    m, k = (int(s) for s in shape)
    if scope not in SCOPES or k % BLOCK:
        raise ValueError(f"nvfp4.from_parts: bad scope {scope!r} or K={k} not divisible by {BLOCK}")
    return NVFP4Tensor(
        check_shape("codes", parts["codes"], (m, k // 2), torch.uint8),
        check_shape("block_scales", parts["block_scales"], (m, k // BLOCK), torch.float8_e4m3fn),
        check_shape("global_scale", parts["global_scale"], (1,) if scope == "tensor" else (m,), torch.float32),
        (m, k),
        scope,
    )
