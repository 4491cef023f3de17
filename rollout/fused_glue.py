"""The packed engine's decode-step glue: the elementwise pieces between its matmuls, fused on CUDA.

Each piece is a pure function with the arithmetic of `policy.model` (RMSNorm and RoPE are
policy.model's own `rms_norm` / `rope`). `Ops(fuse=True)` holds each one compiled by
`compile_glue` (torch.compile, static shapes, one graph per piece), falling back to the plain
function, with one warning, the first time compilation fails; `Ops(fuse=False)` holds them plain
(the CPU, prefill, tests). Compile settings live in `compile_glue` alone."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from policy.formats import nvfp4 as _nvfp4
from policy.model import rms_norm, rope

__all__ = ["OPS", "Ops", "compile_glue"]


def _qk_norm_rope(q, k, q_norm, k_norm, cos, sin, eps):
    return rope(rms_norm(q, q_norm, eps), cos, sin), rope(rms_norm(k, k_norm, eps), cos, sin)


def _attn_decode(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """q [n, Hkv, G, hd], k / v [n, Hkv, S, hd], bias [n, 1, 1, S] (0 or -inf) -> [n, Hkv, G, hd]."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    return torch.matmul(s.softmax(dim=-1).to(q.dtype), v)


def _add_rms(x: Tensor, y: Tensor, w: Tensor, eps: float):
    x = x + y
    return x, rms_norm(x, w, eps)


def _route(logits: Tensor, k: int, norm: bool):
    probs = logits.float().softmax(dim=-1)
    weights, ids = probs.topk(k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _swiglu(gu: Tensor, ffn: int) -> Tensor:
    gate, up = gu.split(ffn, dim=-1)
    return F.silu(gate) * up


def _combine(h: Tensor, weights: Tensor) -> Tensor:
    n, k = weights.shape
    return (h.view(n, k, -1) * weights.unsqueeze(-1).to(h.dtype)).sum(dim=1)


def _nvfp4_operand(codes: Tensor, block_scales: Tensor) -> Tensor:
    """policy.formats.nvfp4.operand_values: e2m1 x sf in bf16 (the activation operand's values)."""
    return _nvfp4.operand_values(codes, block_scales)


OPS = {
    "rms": rms_norm,
    "qk_norm_rope": _qk_norm_rope,
    "attn_decode": _attn_decode,
    "add_rms": _add_rms,
    "route": _route,
    "swiglu": _swiglu,
    "combine": _combine,
    "nvfp4_operand": _nvfp4_operand,
}


def compile_glue(fn):
    """torch.compile of one glue function: static shapes, one graph (one compiled variant per batch bucket)."""
    # One compiled variant per batch bucket (static shapes): room for every bucket of a few engines.
    dynamo = torch._dynamo.config
    for key in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo, key):
            setattr(dynamo, key, max(getattr(dynamo, key), 64))
    return torch.compile(fn, dynamic=False, fullgraph=True)


class _Fused:
    """compile_glue(fn), falling back to fn for good on the first error."""

    def __init__(self, fn):
        self.fn, self.compiled, self.failed = fn, compile_glue(fn), False

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - any compiler failure: run the plain function
                self.failed = True
                warnings.warn(
                    f"packed engine: torch.compile of {self.fn.__name__} failed, running it unfused: {e}", stacklevel=2
                )
        return self.fn(*args)


class Ops:
    """The glue functions as attributes (ops.rms, ops.route, ...), fused (torch.compile) or plain."""

    def __init__(self, fuse: bool):
        for name, fn in OPS.items():
            setattr(self, name, _Fused(fn) if fuse else fn)
