"""Kernel dispatch for quantization: the functions QAT, the manifest and the engines call.

On a CUDA tensor, when Triton imports and the GPU is sm_89 or newer (the E4M3 conversions),
the Triton quantizers in `quant_triton` run; everywhere else the CPU reference in
`policy.formats` does (the same bytes: the GPU tests check that). Triton is an optional extra
(`tandem-rl[gpu]`); nothing here imports it until a CUDA tensor asks for it.

    quantize(fmt, x, **kw)          -> the format's quantized object (NVFP4Tensor, ...)
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
    if not isinstance(x, torch.Tensor) or x.device.type == "cpu" or fmt == "bf16":
        return mod.quantize(x, **kw)  # bf16 is a plain cast: torch does it on any device
    if backend(x) != "triton":
        return _reference_quantize(fmt, x, kw)
    from . import quant_triton as qt

    if not qt.kernel_supports(fmt, x, kw):
        return _reference_quantize(fmt, x, kw)
    x = x.detach().contiguous()
    if fmt == "nvfp4":
        scope = kw.get("scope", "tensor")
        if scope not in _nvfp4.SCOPES:
            raise ValueError(f"nvfp4.quantize: scope must be one of {_nvfp4.SCOPES}, got {scope!r}")
        _check(fmt, x, _nvfp4.BLOCK)
        codes, sf, gs, status = qt.nvfp4_quantize(x, scope)
        out = _nvfp4.NVFP4Tensor(codes, sf, gs, tuple(x.shape), scope)
    elif fmt == "mxfp8":
        _check(fmt, x, _mxfp8.BLOCK)
        codes, scales, status = qt.mxfp8_quantize(x)
        out = _mxfp8.MXFP8Tensor(codes, scales, tuple(x.shape))
    elif fmt == "int4":
        g = kw.get("group_size", _int4.DEFAULT_GROUP)
        _check(fmt, x, g)
        codes, scales, status = qt.int4_quantize(x, g)
        out = _int4.INT4Tensor(codes, scales, g, tuple(x.shape))
    elif fmt == "fp8_block":
        block = tuple(kw.get("block", _fp8_block.WEIGHT_BLOCK))
        _check(fmt, x, block[1])
        codes, sinv, status = qt.fp8_block_quantize(x, block)
        out = _fp8_block.FP8BlockTensor(codes, sinv, block, tuple(x.shape))
    else:  # pragma: no cover - formats.get already rejected it
        raise ValueError(f"unknown format {fmt!r}")
    if check_finite:
        _raise_if_nonfinite(fmt, status)
    return out


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
    "quantize",
    "to_device",
]
