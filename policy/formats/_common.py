"""Shared pieces of the quantizer contract: input checks and the fp32/E4M3 primitives.

Every format is a pure function of its input bits: the input is upcast to fp32 (exact for
bf16/fp16), every operation is a single correctly rounded IEEE fp32 operation done by a
torch kernel on fp32 tensors (never Python float64 arithmetic, which would round twice),
and the results are stored in the dtypes the contract names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SPEC_VERSION = "tandem-quant-2"
"""Bumped whenever any format's bytes or effective operands (DESIGN.md "Compute contract") change;
part of the contract fingerprint. 2: matmuls consume the Compute contract's operands (nvfp4 global
scales on the fp32 accumulator, fp8_block per-K-block partial sums, bf16-rounded operands)."""

FLT_MAX = torch.finfo(torch.float32).max
E4M3_MAX = 448.0
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class NonFinite(ValueError):
    """NaN or Inf where the contract computes with finite values only (a quantizer's input, an
    engine's activations or logits): a rollout blames the policy version that computed them."""


def check_input(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    """Validate a quantizer input and return it as a contiguous fp32 [M, K] tensor."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"{what}: dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D [M, K] tensor, got {x.dim()}-D shape {tuple(x.shape)}")
    if x.shape[1] == 0:
        raise ValueError(f"{what}: last dim K is 0; nothing to quantize")
    if x.shape[1] % block != 0:
        raise ValueError(f"{what}: last dim K={x.shape[1]} is not divisible by the block size {block}")
    xf = x.detach().to(torch.float32).contiguous()
    if not bool(torch.isfinite(xf).all()):
        bad = int((~torch.isfinite(xf)).sum())
        raise NonFinite(f"{what}: input has {bad} non-finite value(s) (NaN or Inf)")
    return xf


def fp32(value: float) -> torch.Tensor:
    """A python constant rounded once to fp32 (e.g. fp32(1/6))."""
    return torch.tensor(value, dtype=torch.float32)


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round to nearest even (incl. subnormals). Callers clamp to ±448 first:
    torch's cast does not saturate (out-of-range becomes NaN), so the clamp is part of the contract."""
    return v.to(torch.float8_e4m3fn)


def blocks(xf: torch.Tensor, block: int) -> torch.Tensor:
    """[M, K] -> [M, K // block, block] view (blocks run along K)."""
    m, k = xf.shape
    return xf.view(m, k // block, block)


def amax(v: torch.Tensor, dim=None) -> torch.Tensor:
    """max |v| (exact in fp32: no rounding involved)."""
    a = v.abs()
    return a.amax() if dim is None else a.amax(dim=dim)


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Check one part of a transported quantized tensor (used by every from_parts)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"part {name!r}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != tuple(shape):
        raise ValueError(f"part {name!r}: expected {dtype} {tuple(shape)}, got {t.dtype} {tuple(t.shape)}")
    return t


@dataclass(frozen=True)
class Operand:
    """The effective operand of a quantized matmul (DESIGN.md "Compute contract"), from the packed parts.

    values       [M, K]: what the tensor cores multiply: bf16, exact (nvfp4 e2m1 x sf, mxfp8 code x
                 2^(e-127), fp8_block codes, int4 bf16(q x s), bf16 values); an unquantized activation
                 is itself, in the compute dtype.
    scale        fp32 [1] or [M], or None: applied to the fp32 accumulator after the K sum (nvfp4 S_dec).
    block_scale  fp32 [ceil(M / block[0]), K / block[1]], or None: each K block's partial sum is
                 multiplied by it (fp8_block scale_inv).
    block        (rows, cols) of one block_scale entry.

    `policy.compute.matmul(x, w, dtype)` is the matmul these define; `dequantize()` is values times
    their scales in fp32 (the `dequant` straight-through backward); `split(sizes)` splits the rows.
    """

    values: torch.Tensor
    scale: torch.Tensor | None = None
    block_scale: torch.Tensor | None = None
    block: tuple[int, int] = (1, 1)

    def row_scale(self, rows: int) -> torch.Tensor | None:
        """block_scale expanded to one row per operand row: [rows, K / block[1]] (None without one)."""
        if self.block_scale is None:
            return None
        return self.block_scale.repeat_interleave(self.block[0], dim=0)[:rows]

    def dequantize(self) -> torch.Tensor:
        """fp32 [M, K] = values x block scales x scale."""
        v = self.values.to(torch.float32)
        m, k = v.shape
        bs = self.row_scale(m)
        if bs is not None:
            v = (v.view(m, bs.shape[1], -1) * bs.unsqueeze(-1)).view(m, k)
        if self.scale is not None:
            v = v * self.scale.view(-1, 1)
        return v

    def split(self, sizes) -> tuple[Operand, ...]:
        """Row chunks (per-row scales split with them, one-row blocks only; a [1] scale is shared)."""
        sizes = list(sizes)
        if self.block_scale is not None and self.block[0] != 1:
            raise ValueError(f"Operand.split: block rows {self.block[0]} != 1")
        per_row = self.scale is not None and self.scale.numel() == self.values.shape[0] and self.values.shape[0] != 1
        vs = self.values.split(sizes)
        ss = self.scale.split(sizes) if per_row else [self.scale] * len(vs)
        bs = self.block_scale.split(sizes) if self.block_scale is not None else [None] * len(vs)
        return tuple(Operand(v, s, b, self.block) for v, s, b in zip(vs, ss, bs))
