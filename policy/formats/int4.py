"""INT4 W4A16: symmetric int4 in [-7, 7], groups along K, one bf16 scale per group.

    s = bf16_rne(max(amax * fp32(1/7), 1e-5))      stored scale (bfloat16)
    q = clamp(rne(x / fp32(s)), -7, 7)             correctly rounded division, ties to even
    dequant = q * s

QAT uses exactly this formula. `packed()` gives the compressed-tensors `pack-quantized`
layout: values offset by +8 to 1..15 and eight to an int32 along K, element i of each
eight in bits [4i, 4i+4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policy.fields import is_int

from ._common import Operand, amax, blocks, check_input, check_shape, fp32

DEFAULT_GROUP = 32


def block_shape(*, group_size: int = DEFAULT_GROUP, **params) -> tuple[int, int]:
    """(rows, cols) of one quantization block: one row of `group_size` along K."""
    return 1, int(group_size)


PACK = 8  # int4 values per int32
SCALE_FLOOR = 1e-5


@dataclass(frozen=True)
class INT4Tensor:
    codes: torch.Tensor  # int8 [M, K] in [-7, 7]
    scales: torch.Tensor  # bfloat16 [M, K//group_size]
    group_size: int
    shape: tuple[int, int]

    def parts(self) -> dict[str, torch.Tensor]:
        """Transported packed (4 bits per value), as compressed-tensors stores it."""
        return {"packed": self.packed(), "scales": self.scales}

    def packed(self) -> torch.Tensor:
        """int32 [M, K//8] in the compressed-tensors pack-quantized layout (`weight_packed`)."""
        m, k = self.shape
        u = (self.codes.to(torch.int64) + 8).view(m, k // PACK, PACK)
        word = (u << (4 * torch.arange(PACK, dtype=torch.int64, device=u.device))).sum(dim=-1)
        # Reinterpret the unsigned 32-bit words as int32 (two's complement).
        return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _check_group(group_size) -> int:
    if not is_int(group_size, lo=1) or group_size % PACK:
        raise ValueError(
            f"int4: group_size must be a positive multiple of {PACK} (eight values pack into one int32), got {group_size!r}"
        )
    return group_size


def quantize(x: torch.Tensor, group_size: int = DEFAULT_GROUP) -> INT4Tensor:
    g = _check_group(group_size)
    xf = check_input(x, g, "int4.quantize")
    m, k = xf.shape
    xg = blocks(xf, g)
    s = torch.maximum(amax(xg, dim=-1) * fp32(1.0 / 7.0), fp32(SCALE_FLOOR)).to(torch.bfloat16)
    q = torch.round(torch.div(xg, s.to(torch.float32).unsqueeze(-1))).clamp(-7, 7)
    return INT4Tensor(q.to(torch.int8).view(m, k), s, g, (m, k))


def dequantize(q: INT4Tensor) -> torch.Tensor:
    m, k = q.shape
    g = q.group_size
    return (q.codes.to(torch.float32).view(m, k // g, g) * q.scales.to(torch.float32).unsqueeze(-1)).view(m, k)


def operand(q: INT4Tensor) -> Operand:
    """The Compute contract's W4A16 weight operand: bf16(q x s), rounded once (q x s is exact in
    fp32), as Marlin-style kernels dequantize; no post-accumulator scale."""
    return Operand(dequantize(q).to(torch.bfloat16))


def fake_quant(x: torch.Tensor, group_size: int = DEFAULT_GROUP) -> torch.Tensor:
    return dequantize(quantize(x, group_size=group_size)).to(x.dtype)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of INT4Tensor.packed(): int32 [M, K//8] -> int8 codes [M, K]."""
    m, w = packed.shape
    shifts = 4 * torch.arange(PACK, dtype=torch.int64, device=packed.device)
    nib = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    return (nib - 8).to(torch.int8).view(m, w * PACK)


def from_parts(parts: dict[str, torch.Tensor], shape, group_size: int = DEFAULT_GROUP) -> INT4Tensor:
    m, k = (int(s) for s in shape)
    g = _check_group(group_size)
    if k % g:
        raise ValueError(f"int4.from_parts: K={k} is not divisible by group_size {g}")
    codes = unpack(check_shape("packed", parts["packed"], (m, k // PACK), torch.int32))
    if bool(((codes < -7) | (codes > 7)).any()):
        raise ValueError("int4.from_parts: packed codes outside [-7, 7] (nibble 0 encodes -8, which int4 never uses)")
    return INT4Tensor(codes, check_shape("scales", parts["scales"], (m, k // g), torch.bfloat16), g, (m, k))
