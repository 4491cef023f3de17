"""Shared by the manifest, policy-transport and kernel tests: which format each tensor of the tiny
model gets, so one policy mixes every format (TP-friendly: no 128x128 blocks on 128-wide tensors),
and a byte-level comparison of two quantized objects."""

from __future__ import annotations

import torch


def same_parts(a, b) -> bool:
    """Two quantized objects have the same parts, dtypes and bytes."""
    pa, pb = a.parts(), b.parts()
    return pa.keys() == pb.keys() and all(
        pa[n].dtype == pb[n].dtype
        and torch.equal(pa[n].contiguous().view(torch.uint8), pb[n].contiguous().view(torch.uint8))
        for n in pa
    )


def mixed_tensors(cfg, seed: int) -> dict:
    """Every parameter of `cfg` (random, 1-D ones as [1, N]) quantized as format_for says."""
    from policy.formats.params import quantize_param
    from policy.model import parameter_shapes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in parameter_shapes(cfg).items():
        w = torch.randn(*shape, generator=g) if len(shape) == 2 else torch.randn(1, shape[0], generator=g)
        fmt, kw = format_for(name)
        out[name] = quantize_param(w, fmt, **kw)
    return out


def format_for(name: str) -> tuple[str, dict]:
    if ".experts." in name:
        return "nvfp4", {"scope": "tensor"}
    if "o_proj" in name:
        return "mxfp8", {}
    if "q_proj" in name:
        return "int4", {"group_size": 32}
    if "lm_head" in name:
        return "fp8_block", {"block": (128, 128)}
    if "shared_expert.down" in name:
        return "fp8_block", {"block": (1, 64)}
    return "bf16", {}
