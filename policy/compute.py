"""The Compute contract (DESIGN.md): what a quantized matmul consumes and how it combines it.

Every side (the trainer's QAT forward, the CPU engines, the GPU kernels, a Blackwell block-scaled
GEMM) multiplies the same effective operands, `policy.formats.operand(q)` (one function per format,
from the packed parts), and applies their scales in the same places:

    acc[m, n] = sum_b (sum_{k in K block b} x[m, k] w[n, k]) * (bx[m, b] * bw[n, b])   (block scales)
              = sum_k x[m, k] w[n, k]                                                    (none)
    y[m, n]   = dtype((acc[m, n] * sx[m]) * sw[n])        x's scale first, then w's, then one rounding

with fp32 products and sums (operands equal bit for bit; outputs up to accumulation order). A factor
an operand does not have is 1 and is skipped. `matmul` is the reference (plain torch, any device);
`grouped_matmul` the same product for an MoE layer's experts at once (one `torch._grouped_mm`; its
one extra rounding: its docstring); `GroupedLinear` its straight-through autograd. With exact=True,
`matmul` sums each K range in `policy.exact`'s fixed order (exact mode: batch-invariant)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from policy import exact as exact_ops
from policy.formats import Operand, operand

__all__ = ["GroupedLinear", "Operand", "compute_dtype", "grouped_matmul", "grouped_mm", "matmul", "operand", "plain"]


def compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype a matmul on x computes in: autocast's where it is on for x's device, else x's."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def plain(x: Tensor) -> Operand:
    """An unquantized activation [M, K] as an operand (itself, no scales)."""
    return Operand(x)


def _acc(x: Tensor, w: Tensor, exact: bool = False) -> Tensor:
    """fp32 [M, N] = x @ w.T with fp32 products and sums (exact: `policy.exact.mm`'s order)."""
    if exact:
        return exact_ops.mm(x, w)
    if x.is_cuda and x.dtype == w.dtype == torch.bfloat16:
        try:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # a torch without mm(out_dtype=)
            pass
    return x.to(torch.float32) @ w.to(torch.float32).t()


def matmul(x: Operand, w: Operand, dtype: torch.dtype, *, exact: bool = False) -> Tensor:
    """y [M, N] in `dtype` for x [M, K] and w [N, K], as the module docstring defines it. On CUDA the
    bf16 products go to cuBLAS with an fp32 result; elsewhere the operands are upcast to fp32.
    exact: every K range (the whole K, or each scale block) summed by `policy.exact.mm`."""
    xv, wv = x.values, w.values
    if xv.shape[-1] != wv.shape[-1]:
        raise ValueError(f"compute.matmul: K mismatch, x {tuple(xv.shape)} and w {tuple(wv.shape)}")
    if x.scale is None and w.scale is None and x.block_scale is None and w.block_scale is None:
        if exact:
            return exact_ops.mm(xv.to(dtype), wv.to(dtype)).to(dtype)
        return F.linear(xv.to(dtype), wv.to(dtype))  # no scale: the dtype's own matmul (fp32 accumulation)
    if xv.is_cuda and dtype == torch.bfloat16:
        xv, wv = xv.to(dtype), wv.to(dtype)
    with torch.autocast(xv.device.type, enabled=False):
        bx, bw = x.row_scale(xv.shape[0]), w.row_scale(wv.shape[0])
        if bx is None and bw is None:
            acc = _acc(xv, wv, exact)
        else:
            bk = (x if bx is not None else w).block[1]
            if bx is not None and bw is not None and x.block[1] != w.block[1]:
                raise ValueError(f"compute.matmul: K blocks differ, x {x.block} and w {w.block}")
            acc = None
            for b in range(xv.shape[1] // bk):
                part = _acc(xv[:, b * bk : (b + 1) * bk], wv[:, b * bk : (b + 1) * bk], exact)
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


# --------------------------------------------------------------------------------------------------
# Grouped (MoE experts)


def grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """torch._grouped_mm where this torch has it, else a loop (the reference; a host sync for offs).

    a [M, K], b [E, K, N], offs int32 [E] (group e = rows offs[e-1]:offs[e] of a) -> [M, N];
    a [N, M], b [M, K], groups along M -> [E, N, K] (the weight gradient). Output in a's dtype
    (torch's CUDA kernel has no fp32 output for bf16 inputs; its other paths loop on the host)."""
    if hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(a, b, offs=offs)
    ends = offs.tolist()
    starts = [0, *ends[:-1]]
    if b.dim() == 3:
        return torch.cat([a[s:t] @ b[e] for e, (s, t) in enumerate(zip(starts, ends))])
    return torch.stack([a[:, s:t] @ b[s:t] for s, t in zip(starts, ends)])


def grouped_matmul(x: Operand, w: Operand, offs: Tensor, groups: Tensor, dtype: torch.dtype) -> Tensor:
    """y [M, N] in `dtype`: row m of x [M, K] times expert groups[m]'s w, per the Compute contract.

    x's rows are sorted by expert, offs [E] int32 is where each expert's rows end, groups [M] int64
    is each row's expert. w.values [E, N, K]; w.scale None, [E, 1] or [E, N]; x.scale None or [M];
    no block scales (fp8_block: `matmul` per expert). The one departure from `matmul`: where an
    operand has a post-accumulator scale (nvfp4), torch's CUDA grouped GEMM cannot write fp32 for
    bf16 inputs, so the accumulator is rounded to bf16 before the scales (one extra rounding,
    relative error <= 2^-9). The operands are the same bits."""
    if x.block_scale is not None or w.block_scale is not None:
        raise ValueError("compute.grouped_matmul: per-K-block scales (fp8_block) are not supported")
    xv, wv = x.values.to(dtype), w.values.to(dtype)
    if x.scale is None and w.scale is None:
        return grouped_mm(xv, wv.transpose(1, 2), offs)
    with torch.autocast(xv.device.type, enabled=False):
        acc = grouped_mm(xv, wv.transpose(1, 2), offs).float()
        if x.scale is not None:
            acc = acc * x.scale.view(-1, 1)
        if w.scale is not None:
            acc = acc * w.scale.index_select(0, groups)
        return acc.to(dtype)


def _nonempty(g: Tensor, offs: Tensor) -> Tensor:
    """The weight gradient g [E, N, K] with zeros for experts that got no rows (whatever the
    grouped GEMM leaves there)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.where((counts > 0).view(-1, 1, 1), g, torch.zeros((), dtype=g.dtype, device=g.device))


class GroupedLinear(torch.autograd.Function):
    """y = grouped_matmul(x̂, Ŵ) for the experts of one MoE projection, with the straight-through
    backward of policy.qat: hp uses (x, W) (the master weights, stacked in the backward), dequant
    the dequantized operands (x̂, Ŵ). Plain training is the case x̂ = x, Ŵ = W in the compute dtype.

    apply(x [M, K], x_op, w_op (values [E, N, K]), offs, groups, hp, dtype, *weights [N, K] each)."""

    @staticmethod
    def forward(ctx, x, x_op, w_op, offs, groups, hp: bool, dtype, *weights):
        if hp:
            ctx.save_for_backward(x, offs, *weights)
        else:
            ctx.save_for_backward(offs)
            ctx.ops = (x_op, w_op)
        ctx.hp, ctx.x_dtype, ctx.w_dtype = hp, x.dtype, weights[0].dtype
        return grouped_matmul(x_op, w_op, offs, groups, dtype)

    @staticmethod
    def backward(ctx, grad):
        if ctx.hp:
            xs, offs, *weights = ctx.saved_tensors
            ws = torch.stack(weights).to(grad.dtype)
        else:
            (offs,) = ctx.saved_tensors
            x_op, w_op = ctx.ops
            xs = x_op.dequantize()
            ws = w_op.values.to(torch.float32)
            if w_op.scale is not None:
                ws = ws * w_op.scale.unsqueeze(-1)
            ws = ws.to(grad.dtype)
        grad = grad.contiguous()
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = grouped_mm(grad, ws, offs).to(ctx.x_dtype)
        if any(ctx.needs_input_grad[7:]):
            g = _nonempty(grouped_mm(grad.t(), xs.to(grad.dtype), offs), offs).to(ctx.w_dtype)
            grad_w = g.unbind(0)
        else:
            grad_w = (None,) * ws.shape[0]
        return (grad_x, None, None, None, None, None, None, *grad_w)
