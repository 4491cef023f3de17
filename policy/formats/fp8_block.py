"""FP8 block scaling (Hopper-native, DeepSeek-V3 shapes): E4M3 values, an fp32 scale per block.

128x128 blocks for weights, 1x128 tiles for activations (any (rows, cols) block is accepted;
K must divide by cols, M need not divide by rows: the last block of rows is partial, as in
DeepSeek-V3's weight_scale_inv of shape [ceil(M/128), K/128]).

    S = min(fp32(448 / amax), FLT_MAX)     (amax == 0 -> S = 1)
    code = e4m3_rne(clamp(x * S, -448, 448));  stored scale_inv = fp32(1 / S)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from policy.fields import is_int

from ._common import E4M3_MAX, FLT_MAX, Operand, check_input, check_shape, to_e4m3

WEIGHT_BLOCK = (128, 128)
ACTIVATION_BLOCK = (1, 128)


def block_shape(*, block=WEIGHT_BLOCK, **params) -> tuple[int, int]:
    """(rows, cols) of one quantization block: `block` (128x128 weights, 1x128 activations)."""
    bm, bk = block
    return int(bm), int(bk)


@dataclass(frozen=True)
class FP8BlockTensor:
    codes: torch.Tensor  # float8_e4m3fn [M, K]
    scale_inv: torch.Tensor  # float32 [ceil(M/bm), K//bk]
    block: tuple[int, int]
    shape: tuple[int, int]

    def parts(self) -> dict[str, torch.Tensor]:
        return {"codes": self.codes, "scale_inv": self.scale_inv}


def _check_block(block) -> tuple[int, int]:
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    ok = ok and all(is_int(b, lo=1) for b in block)
    if not ok:
        raise ValueError(f"fp8_block: block must be two positive ints like (128, 128) or (1, 128), got {block!r}")
    return int(block[0]), int(block[1])


def _tiles(xf: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """[M, K] -> [ceil(M/bm), bm, K/bk, bk], zero-padding the rows (zeros do not change an amax)."""
    m, k = xf.shape
    pad = -m % bm
    if pad:
        xf = torch.cat([xf, xf.new_zeros(pad, k)])
    return xf.view((m + pad) // bm, bm, k // bk, bk)


def quantize(x: torch.Tensor, block=WEIGHT_BLOCK) -> FP8BlockTensor:
    bm, bk = _check_block(block)
    xf = check_input(x, bk, "fp8_block.quantize")
    m, k = xf.shape
    t = _tiles(xf, bm, bk)
    a = t.abs().amax(dim=(1, 3))  # [ceil(M/bm), K/bk]
    s = torch.div(torch.full_like(a, E4M3_MAX), a).clamp(max=FLT_MAX)
    s = torch.where(a == 0, torch.ones_like(s), s)
    v = torch.clamp(t * s[:, None, :, None], -E4M3_MAX, E4M3_MAX)
    codes = to_e4m3(v).view(-1, k)[:m]
    return FP8BlockTensor(codes.contiguous(), torch.div(torch.ones_like(s), s), (bm, bk), (m, k))


def dequantize(q: FP8BlockTensor) -> torch.Tensor:
    m, k = q.shape
    bm, bk = q.block
    t = _tiles(q.codes.to(torch.float32), bm, bk)
    return (t * q.scale_inv[:, None, :, None]).view(-1, k)[:m]


def operand(q: FP8BlockTensor) -> Operand:
    """The Compute contract's operand: the E4M3 codes (exact in bf16); each K block's fp32 partial
    sum is multiplied by scale_inv_x x scale_inv_w (DeepSeek-V3's promotion)."""
    return Operand(q.codes.to(torch.bfloat16), block_scale=q.scale_inv, block=q.block)


def fake_quant(x: torch.Tensor, block=WEIGHT_BLOCK) -> torch.Tensor:
    return dequantize(quantize(x, block=block)).to(x.dtype)


def from_parts(parts: dict[str, torch.Tensor], shape, block=WEIGHT_BLOCK) -> FP8BlockTensor:
    m, k = (int(s) for s in shape)
    bm, bk = _check_block(block)
    if k % bk:
        raise ValueError(f"fp8_block.from_parts: K={k} is not divisible by block cols {bk}")
    return FP8BlockTensor(
        check_shape("codes", parts["codes"], (m, k), torch.float8_e4m3fn),
        check_shape("scale_inv", parts["scale_inv"], (-(-m // bm), k // bk), torch.float32),
        (bm, bk),
        (m, k),
    )
