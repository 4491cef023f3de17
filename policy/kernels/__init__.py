"""Kernel dispatch for quantization: the functions QAT, the manifest and the engines call.

On a CUDA tensor, when Triton imports and the GPU is sm_89 or newer (the E4M3 conversions),
the Triton quantizers in `quant_triton` run; everywhere else the CPU reference in
`policy.formats` does (the same bytes: the GPU tests check that). Triton is an optional extra
(`tandem-rl[gpu]`); nothing here imports it until a CUDA tensor asks for it.

    quantize(fmt, x, **kw)          -> the format's quantized object (NVFP4Tensor, ...)
    quantize_stacked(fmt, xs, **kw) -> E same-shape tensors (a list or [E, M, K]), each quantized as
                                       its own tensor in one call (an MoE layer's experts); the same
                                       bytes as E calls (`quantize_group`: the stacked result alone,
                                       `rows_of`: its per-tensor views)
    operand(q)                      -> the Compute contract's operand (`formats.operand(q)`, the
                                       same bytes), nvfp4 and int4 values in one Triton pass on CUDA
    dequantize(q) / fake_quant(...) -> fp32 / x.dtype, via the reference (device-agnostic torch)
    backend(x)                      -> "triton" or "reference" for x's device

Only the byte-exact quantizers live here, because both sides (trainer and rollout) use them.
The decode matmuls (`qmatmul`, `moe_qmatmul`, the packed weight layout and MoE routing) are
used only by a rollout engine and live beside it in `rollout.kernels`.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from policy import formats
from policy.formats import bf16 as _bf16
from policy.formats import fp8_block as _fp8_block
from policy.formats import int4 as _int4
from policy.formats import mxfp8 as _mxfp8
from policy.formats import nvfp4 as _nvfp4

NONFINITE_BITS = 0x7F800000


# --------------------------------------------------------------------------- backend choice


@functools.cache
def _triton_ok(device_index: int) -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def backend(x: torch.Tensor) -> str:
    """ "triton" when the GPU kernels serve tensors on x's device, else "reference"."""
    if x.device.type != "cuda":
        return "reference"
    return (
        "triton"
        if _triton_ok(x.device.index if x.device.index is not None else torch.cuda.current_device())
        else "reference"
    )


def to_device(q, device):
    """The same quantized object with its tensors on `device`."""
    moved = {
        f.name: getattr(q, f.name).to(device)
        for f in dataclasses.fields(q)
        if isinstance(getattr(q, f.name), torch.Tensor)
    }
    return dataclasses.replace(q, **moved)


def _reference_quantize(fmt: str, x: torch.Tensor, kw: dict):
    """The CPU reference, for any device: compute on the CPU, bring the result back."""
    return to_device(formats.get(fmt).quantize(x.cpu(), **kw), x.device)


def _check(fmt: str, x: torch.Tensor, block: int) -> None:
    """The reference's shape/dtype checks, without its fp32 copy of the input."""
    what = f"{fmt}.quantize"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    if x.dim() != 2:
        raise ValueError(f"{what}: expected a 2-D [M, K] tensor, got {x.dim()}-D shape {tuple(x.shape)}")
    if x.shape[1] == 0 or x.shape[1] % block:
        raise ValueError(f"{what}: last dim K={x.shape[1]} is not a positive multiple of the block size {block}")


def _raise_if_nonfinite(fmt: str, status: torch.Tensor) -> None:
    if int(status.item()) >= NONFINITE_BITS:
        raise ValueError(f"{fmt}.quantize: input has non-finite value(s) (NaN or Inf)")


# --------------------------------------------------------------------------- quantize


def quantize(fmt: str, x: torch.Tensor, *, check_finite: bool = True, **kw):
    """Quantize 2-D `x` with format `fmt` (kwargs as the format's quantize: scope, group_size, block).

    On the GPU path `check_finite=True` reads one status word back (a host sync) to raise
    ValueError on NaN/Inf like the reference; pass False on a hot path whose inputs are known
    finite (the bytes for non-finite input are then unspecified)."""
    mod = formats.get(fmt)
    if fmt == "bf16" and not check_finite and isinstance(x, torch.Tensor) and x.device.type != "cpu":
        _check(fmt, x, 1)  # the reference's cast without its fp32 copy and finite check (a host sync)
        return mod.BF16Tensor(x.detach().to(torch.bfloat16, copy=True), tuple(x.shape))
    if not isinstance(x, torch.Tensor) or x.device.type == "cpu" or fmt == "bf16":
        return mod.quantize(x, **kw)  # bf16 is a plain cast: torch does it on any device
    if backend(x) != "triton":
        return _reference_quantize(fmt, x, kw)
    from . import quant_triton as qt

    if not qt.kernel_supports(fmt, x, kw):
        return _reference_quantize(fmt, x, kw)
    return _quantize_triton(fmt, x.detach().contiguous(), tuple(x.shape), check_finite, kw)


def _quantize_triton(fmt: str, x, shape: tuple[int, int], check_finite: bool, kw: dict):
    """The Triton kernel's quantized object of `x`: a contiguous tensor of `shape`, or (nvfp4, int4)
    a list of same-shape tensors quantized as their rows stacked (`shape`), read where they are."""
    from . import quant_triton as qt

    x0 = x if isinstance(x, torch.Tensor) else x[0]
    if fmt == "nvfp4":
        scope = kw.get("scope", "tensor")
        if scope not in _nvfp4.SCOPES:
            raise ValueError(f"nvfp4.quantize: scope must be one of {_nvfp4.SCOPES}, got {scope!r}")
        _check(fmt, x0, _nvfp4.BLOCK)
        codes, sf, gs, status = qt.nvfp4_quantize(x, scope)
        out = _nvfp4.NVFP4Tensor(codes, sf, gs, shape, scope)
    elif fmt == "mxfp8":
        _check(fmt, x0, _mxfp8.BLOCK)
        codes, scales, status = qt.mxfp8_quantize(x)
        out = _mxfp8.MXFP8Tensor(codes, scales, shape)
    elif fmt == "int4":
        g = kw.get("group_size", _int4.DEFAULT_GROUP)
        _check(fmt, x0, g)
        codes, scales, status = qt.int4_quantize(x, g)
        out = _int4.INT4Tensor(codes, scales, g, shape)
    elif fmt == "fp8_block":
        block = tuple(kw.get("block", _fp8_block.WEIGHT_BLOCK))
        _check(fmt, x0, block[1])
        codes, sinv, status = qt.fp8_block_quantize(x, block)
        out = _fp8_block.FP8BlockTensor(codes, sinv, block, shape)
    else:  # pragma: no cover - formats.get already rejected it
        raise ValueError(f"unknown format {fmt!r}")
    if check_finite:
        _raise_if_nonfinite(fmt, status)
    return out


def quantize_stacked(fmt: str, xs, *, check_finite: bool = True, **kw):
    """Quantize each of E tensors [M, K] of one shape and dtype on its own (as `quantize(fmt, xs[e],
    **kw)`, bit for bit) in one call -> (flat, [q_0, ..., q_{E-1}]). xs: a list of them (an MoE
    projection's experts, each its own parameter) or an [E, M, K] tensor.

    `flat` is one object over the E * M rows whose parts hold every q_e's, stacked along rows
    (q_e's parts are views of them): nvfp4 tensor scope has a global_scale [E], one per tensor;
    every other case is `quantize` of the rows stacked, because its scales are row-local (per row,
    per row group, per 1 x 16/32 block; fp8_block when its block rows divide M).
    On CUDA, nvfp4 (per-tensor amax, then the codes: one launch each) and int4 read a list where it
    lies, through a table of its tensors' addresses: no stacked copy of the inputs is made; bf16
    without the finite check is cast by the stacking copy itself. Other formats, and the CPU, stack
    first (nvfp4 tensor scope on the CPU: the reference with each tensor's amax given per row, the
    same arithmetic as tensor scope). Shapes that fit none of these (fp8_block with M not a
    multiple of its block rows, M = 0) are quantized tensor by tensor; `flat` is then None."""
    stacked, xs = _as_group(xs)
    flat = _quantize_group(fmt, xs, stacked, check_finite, kw)
    if flat is None:
        return None, [quantize(fmt, x, check_finite=check_finite, **kw) for x in xs]
    return flat, rows_of(flat, len(xs), tuple(xs[0].shape))


def quantize_group(fmt: str, xs, *, check_finite: bool = True, **kw):
    """`quantize_stacked`'s flat object alone, without the per-tensor views (what a QAT refill needs
    every step), or None where the tensors are to be quantized one by one."""
    stacked, xs = _as_group(xs)
    return _quantize_group(fmt, xs, stacked, check_finite, kw)


def _quantize_group(fmt: str, xs: list[torch.Tensor], stacked: torch.Tensor | None, check_finite: bool, kw: dict):
    """`quantize_group` of validated tensors xs (`stacked`: their rows as one tensor, if given so)."""
    e, (m, k) = len(xs), xs[0].shape
    if m == 0 or (fmt == "fp8_block" and m % tuple(kw.get("block", _fp8_block.WEIGHT_BLOCK))[0]):
        return None
    flat = _quantize_in_place(fmt, xs, check_finite, kw)
    if flat is None and fmt == "bf16" and not check_finite:  # the cast is the stacking copy
        _check(fmt, xs[0], 1)
        values = xs[0].new_empty(e * m, k, dtype=torch.bfloat16)
        flat = _bf16.BF16Tensor(torch.cat([x.detach() for x in xs], out=values), (e * m, k))
    if flat is None:
        flat_x = stacked if stacked is not None else torch.cat(xs)
        if fmt == "nvfp4" and kw.get("scope", "tensor") == "tensor":
            flat = _nvfp4_stacked(flat_x, e, check_finite)
        else:
            flat = quantize(fmt, flat_x, check_finite=check_finite, **kw)
    return flat


def _as_group(xs) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """(the rows of an [E, M, K] tensor as one [E * M, K] view, or None for a list; xs as a list of
    2-D tensors of one shape, dtype and device), or ValueError."""
    if isinstance(xs, torch.Tensor):
        if xs.dim() != 3:
            raise ValueError(f"quantize_stacked: expected an [E, M, K] tensor, got shape {tuple(xs.shape)}")
        return xs.reshape(-1, xs.shape[-1]), list(xs.unbind(0))
    xs = list(xs)
    if not xs or any(not isinstance(x, torch.Tensor) for x in xs):
        raise ValueError("quantize_stacked: expected a non-empty list of tensors")
    first = xs[0]
    for x in xs:
        if x.dim() != 2 or x.shape != first.shape or x.dtype != first.dtype or x.device != first.device:
            raise ValueError(
                f"quantize_stacked: expected 2-D tensors of one shape, dtype and device; got {tuple(x.shape)} "
                f"{x.dtype} on {x.device} beside {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    return None, xs


def _quantize_in_place(fmt: str, xs: list[torch.Tensor], check_finite: bool, kw: dict):
    """The flat object of `quantize_stacked` from the Triton kernels reading each tensor where it
    is (nvfp4, int4 on CUDA; each tensor contiguous and 16-byte aligned), or None."""
    x0 = xs[0]
    if fmt not in ("nvfp4", "int4") or x0.device.type != "cuda" or backend(x0) != "triton":
        return None
    from . import quant_triton as qt

    if not qt.kernel_supports(fmt, x0, kw) or any(not x.is_contiguous() or x.data_ptr() % 16 for x in xs):
        return None
    shape = (len(xs) * x0.shape[0], x0.shape[1])
    return _quantize_triton(fmt, [x.detach() for x in xs], shape, check_finite, kw)


def _nvfp4_stacked(x: torch.Tensor, groups: int, check_finite: bool):
    """nvfp4 tensor scope over `groups` stacked tensors: NVFP4Tensor over all rows, global_scale [groups]."""
    m = x.shape[0] // groups
    if x.device.type == "cuda":  # the kernels, on the stack's rows as a group (contiguous and aligned)
        flat = _quantize_in_place("nvfp4", list(x.contiguous().view(groups, m, -1).unbind(0)), check_finite, {})
        if flat is not None:
            return flat
    # The reference: row scope with every row given its tensor's amax is tensor scope's arithmetic
    # (the same fp32 operations on the same values, per row instead of broadcast).
    xc = x.detach().cpu()
    _check("nvfp4", xc, _nvfp4.BLOCK)
    amax = xc.float().abs().view(groups, -1).amax(dim=1)  # exact; the reference rejects non-finite x
    q = _nvfp4.quantize(xc, scope="row", amax=amax.repeat_interleave(m))
    flat = _nvfp4.NVFP4Tensor(q.codes, q.block_scales, q.global_scale[::m].contiguous(), q.shape, "tensor")
    return to_device(flat, x.device)


def rows_of(flat, n: int, shape: tuple[int, int]) -> list:
    """The n tensors stacked in `flat`: tensor i's parts are rows i * (rows / n) ... (i + 1) * (rows / n)
    of flat's (codes and scales per row, per block row, or per tensor: a global_scale [n]); one
    split per part."""
    fields = {f.name: getattr(flat, f.name) for f in dataclasses.fields(flat)}
    names = [name for name, v in fields.items() if isinstance(v, torch.Tensor)]
    pieces = [fields.pop(name).split(getattr(flat, name).shape[0] // n) for name in names]
    fields["shape"] = shape
    return [type(flat)(**fields, **dict(zip(names, ps))) for ps in zip(*pieces)]


def operand(q) -> formats.Operand:
    """`formats.operand(q)`, bit for bit; nvfp4 and int4 values from one Triton kernel on CUDA (the
    reference builds them with a chain of elementwise torch ops, each a pass over memory)."""
    fmt = _format_name(q)
    if fmt not in ("nvfp4", "int4") or backend(q.codes) != "triton":
        return formats.operand(q)
    from . import quant_triton as qt

    if fmt == "nvfp4":
        return formats.Operand(qt.nvfp4_operand(q.codes, q.block_scales), scale=q.global_scale)
    return formats.Operand(qt.int4_operand(q.codes, q.scales, q.group_size))


def dequantize(q) -> torch.Tensor:
    """fp32 [M, K], by the reference formula (plain torch: runs on the tensors' device)."""
    return _module_of(q).dequantize(q)


def fake_quant(fmt: str, x: torch.Tensor, **kw) -> torch.Tensor:
    """dequantize(quantize(x)) in x.dtype: QAT's forward, with the kernels on the GPU."""
    return dequantize(quantize(fmt, x, **kw)).to(x.dtype)


_format_name = formats.format_of  # one lookup of an object's format, shared with QAT


def _module_of(q):
    return formats.get(_format_name(q))


__all__ = [
    "backend",
    "dequantize",
    "fake_quant",
    "operand",
    "quantize",
    "quantize_group",
    "quantize_stacked",
    "rows_of",
    "to_device",
]
