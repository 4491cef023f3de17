"""The bit-exact quantizer library shared by trainer, rollout and kernels (DESIGN.md,
"The quantizer contract"). One module per format, each with quantize / dequantize /
fake_quant / from_parts; these CPU functions are the reference every kernel must match
byte for byte."""

from __future__ import annotations

from types import ModuleType

from . import bf16, fp8_block, int4, mxfp8, nvfp4
from ._common import SPEC_VERSION

FORMATS = ("bf16", "fp8_block", "mxfp8", "nvfp4", "int4")
_MODULES = {"bf16": bf16, "fp8_block": fp8_block, "mxfp8": mxfp8, "nvfp4": nvfp4, "int4": int4}


def get(name: str) -> ModuleType:
    """The module of format `name`; ValueError naming the known formats otherwise."""
    try:
        return _MODULES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown quantization format {name!r}; known formats: {', '.join(FORMATS)}") from None


__all__ = ["FORMATS", "SPEC_VERSION", "get", "bf16", "fp8_block", "int4", "mxfp8", "nvfp4"]
