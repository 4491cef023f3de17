"""The bit-exact quantizer library shared by trainer, rollout and kernels (DESIGN.md,
"The quantizer contract"). One module per format, each with quantize / dequantize /
fake_quant / from_parts; these CPU functions are the reference every kernel must match
byte for byte."""

from __future__ import annotations

from types import ModuleType

from . import bf16, fp8_block, int4, mxfp8, nvfp4
from ._common import SPEC_VERSION, NonFinite, Operand

FORMATS = ("bf16", "fp8_block", "mxfp8", "nvfp4", "int4")
_MODULES = {"bf16": bf16, "fp8_block": fp8_block, "mxfp8": mxfp8, "nvfp4": nvfp4, "int4": int4}


def get(name: str) -> ModuleType:
    """The module of format `name`; ValueError naming the known formats otherwise."""
    try:
        return _MODULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantization format {name!r}; known formats: {', '.join(FORMATS)}") from None


_TYPES = {
    bf16.BF16Tensor: "bf16",
    fp8_block.FP8BlockTensor: "fp8_block",
    mxfp8.MXFP8Tensor: "mxfp8",
    nvfp4.NVFP4Tensor: "nvfp4",
    int4.INT4Tensor: "int4",
}


def format_of(q) -> str:
    """The format name of a quantized object; ValueError for anything else."""
    name = _TYPES.get(type(q))
    if name is None:
        raise ValueError(f"not a policy.formats quantized tensor: {type(q).__name__}")
    return name


def dequantize(q):
    """fp32 [M, K] values of a quantized object of any format."""
    return get(format_of(q)).dequantize(q)


def operand(q) -> Operand:
    """The Compute contract's effective operand of a quantized object of any format."""
    return get(format_of(q)).operand(q)


__all__ = [
    "FORMATS",
    "SPEC_VERSION",
    "NonFinite",
    "Operand",
    "dequantize",
    "format_of",
    "get",
    "operand",
    "bf16",
    "fp8_block",
    "int4",
    "mxfp8",
    "nvfp4",
]
