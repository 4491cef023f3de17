"""A parameter quantized for publishing: its format, its quantize() kwargs and the format object.

`quantize_param` goes through policy.kernels (the GPU kernels on CUDA tensors, the reference
elsewhere: the same bytes either way); a 1-D parameter (a norm weight) is quantized and published
as [1, D]. `quantize_params` quantizes every weight as a policy.recipe Plan says: what a trainer
publishes (policy.manifest.build_manifest takes them) and what QAT (policy.qat) is compared with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from policy import kernels
from policy.tp import from_parts_kwargs


@dataclass(frozen=True)
class QuantizedParam:
    """One quantized parameter: its format, the quantize() kwargs, and the quantized object."""

    format: str
    kwargs: Mapping[str, Any]
    value: Any  # a policy.formats object: .parts(), .shape


def quantize_param(x: torch.Tensor, fmt: str, *, check_finite: bool = True, **kwargs) -> QuantizedParam:
    """Quantize a weight with format `fmt` (kwargs as for quantize(), e.g. scope="tensor"); a 1-D
    parameter (a norm weight) is quantized and published as [1, D]. Through policy.kernels: the
    GPU kernels on CUDA tensors, the reference elsewhere, the same bytes either way.
    check_finite=False skips the GPU path's NaN/Inf check (a host sync per tensor) where the caller
    checks the weights itself."""
    x = x.detach()
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    q = kernels.quantize(fmt, x2, check_finite=check_finite, **from_parts_kwargs(fmt, kwargs))
    return QuantizedParam(fmt, dict(kwargs), q)


def quantize_params(weights: Mapping[str, torch.Tensor], plan) -> dict[str, QuantizedParam]:
    """Quantize every weight as a policy.recipe Plan says: what a trainer publishes."""
    return {name: quantize_param(w, plan[name].format, **plan[name].kwargs) for name, w in weights.items()}
