"""The Compute contract (DESIGN.md): what a quantized matmul consumes and how it combines it.

Every side (the trainer's QAT forward, the CPU engines, the GPU kernels, a Blackwell block-scaled
GEMM) multiplies the same effective operands, `policy.formats.operand(q)` (one function per format,
from the packed parts), and applies their scales in the same places:

    acc[m, n] = sum_b (sum_{k in K block b} x[m, k] w[n, k]) * (bx[m, b] * bw[n, b])   (block scales)
              = sum_k x[m, k] w[n, k]                                                    (none)
    y[m, n]   = dtype((acc[m, n] * sx[m]) * sw[n])        x's scale first, then w's, then one rounding

with fp32 products and sums (the K order inside a block is the implementation's: outputs are
equal up to accumulation order; the operands are equal bit for bit). A factor that an operand does
not have is 1 and is skipped. `matmul` below is the reference: plain torch, any device (on CUDA the
bf16 products go to cuBLAS with an fp32 result; elsewhere the operands are upcast to fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from policy.formats import Operand, operand

__all__ = ["Operand", "compute_dtype", "matmul", "operand", "plain"]


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on x computes in: autocast's where it is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def plain(x: Tensor) -> Operand:
    """An unquantized activation [M, K] as an operand (itself, no scales)."""
    return Operand(x)


def _acc(x: Tensor, w: Tensor) -> Tensor:
    """fp32 [M, N] = x @ w.T with fp32 products and sums."""
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm(out_dtype=)
            pass
    return x.to(torch.float32) @ w.to(torch.float32).t()


def matmul(x: Operand, w: Operand, dtype: torch.dtype) -> Tensor:
    """y [M, N] in `dtype` for x [M, K] and w [N, K], as the module docstring defines it."""
    xv, wv = x.values, w.values
    if xv.shape[-1] != wv.shape[-1]:
        raise ValueError(f"compute.matmul: K mismatch, x {tuple(xv.shape)} and w {tuple(wv.shape)}")
    if x.scale is None and w.scale is None and x.block_scale is None and w.block_scale is None:
        return F.linear(xv.to(dtype), wv.to(dtype))  # no scale: the dtype's own matmul (fp32 accumulation)
    if xv.is_cuda and dtype == torch.bfloat16:
        xv, wv = xv.to(dtype), wv.to(dtype)
    with torch.autocast(xv.device.type, enabled=False):
        bx, bw = x.row_scale(xv.shape[0]), w.row_scale(wv.shape[0])
        if bx is None and bw is None:
            acc = _acc(xv, wv)
        else:
            bk = (x if bx is not None else w).block[1]
            if bx is not None and bw is not None and x.block[1] != w.block[1]:
                raise ValueError(f"compute.matmul: K blocks differ, x {x.block} and w {w.block}")
            acc = None
            for b in range(xv.shape[1] // bk):
                part = _acc(xv[:, b * bk : (b + 1) * bk], wv[:, b * bk : (b + 1) * bk])
                if bx is not None and bw is not None:
                    s = bx[:, b : b + 1] * bw[:, b][None, :]
                else:
                    s = bx[:, b : b + 1] if bx is not None else bw[:, b][None, :]
                part = part * s
                acc = part if acc is None else acc + part
        if x.scale is not None:
            acc = acc * x.scale.view(-1, 1)
        if w.scale is not None:
            acc = acc * w.scale.view(1, -1)
        return acc.to(dtype)
