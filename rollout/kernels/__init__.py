"""The rollout engine's decode matmuls: packed 4-bit weights, dense and MoE, on CUDA via Triton.

Used only by a rollout engine (the trainer computes through QAT's fake quantization), so they
live beside the engine; the byte-exact quantizers both sides use stay in `policy.kernels`.
On a CUDA tensor (sm_89+, Triton installed) the kernels in `matmul_triton` run; everywhere else
the reference: `policy.compute.matmul` of x and the weight's Compute-contract operand.

    pack(q) / pack_experts([q...])  -> PackedLinear, the layout the matmul kernels read (once per
                                       weight version; unpack() gives the format object back)
    qmatmul(x, w)                   -> x @ W.T per the contract  (w: PackedLinear or a quantized tensor)
    moe_qmatmul(x, w, topk_ids)     -> [T, topk, N], all routed experts in one launch

Semantics of the matmuls (DESIGN.md "Compute contract"): x (bf16) times the weight's operand
(nvfp4 e2m1 x sf with S_dec on the fp32 accumulator, int4 bf16(q x s), mxfp8 / bf16 values),
output in x.dtype; fp8_block is W8A8 as on Hopper: x is quantized with 1x128 tiles first, on
every backend, and each 128-wide K block's partial sum is scaled, as `torch._scaled_mm` does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import policy.kernels as K
from policy import compute, formats
from policy.formats import fp8_block as _fp8_block
from policy.formats import int4 as _int4
from policy.formats import nvfp4 as _nvfp4
from policy.kernels import bitmath

# --------------------------------------------------------------------------- packed weights


@dataclass(frozen=True)
class PackedLinear:
    """A weight [N, K] (or E experts [E, N, K]) in the layout the matmul kernels read.

    nvfp4: codes = int32 words [(E,) N, K/8] in the kernel layout (`bitmath.repack`: the
           transported nibbles regrouped within each 16-element block), scales
           float8_e4m3fn [(E,) N, K/16], global_scale fp32 [E or 1].
    int4:  codes = int32 words [(E,) N, K/8], kernel layout of the offset-8 nibbles,
           scales bf16 [(E,) N, K/g].
    other formats: `quantized` holds the format object(s) and the matmul multiplies by its
    dequantization (fp8_block on CUDA: torch._scaled_mm where supported).
    """

    fmt: str
    shape: tuple[int, int]  # (N, K) of one weight
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None
    group_size: int = 0
    num_experts: int = 0  # 0: a single weight
    quantized: tuple = ()

    def __post_init__(self):
        if self.fmt not in formats.FORMATS:
            raise ValueError(f"PackedLinear: unknown format {self.fmt!r}")


def pack(q) -> PackedLinear:
    """The kernel layout of one quantized weight (nvfp4 must be tensor scope)."""
    n, k = q.shape
    if isinstance(q, _nvfp4.NVFP4Tensor):
        if q.scope != "tensor":
            raise ValueError("pack: an nvfp4 weight must be quantized with scope='tensor'")
        return PackedLinear(
            "nvfp4", (n, k), bitmath.repack(_nvfp4.unpack_codes(q.codes)), q.block_scales, q.global_scale.reshape(1)
        )
    if isinstance(q, _int4.INT4Tensor):
        return PackedLinear("int4", (n, k), bitmath.repack(q.codes.to(torch.int16) + 8), q.scales, None, q.group_size)
    return PackedLinear(formats.format_of(q), (n, k), quantized=(q,))


def pack_experts(qs) -> PackedLinear:
    """Stack E quantized expert weights of one shape (each with its own nvfp4 global scale)."""
    packed = [pack(q) for q in qs]
    if not packed:
        raise ValueError("pack_experts: no experts given")
    first = packed[0]
    bad = [
        i for i, p in enumerate(packed) if (p.fmt, p.shape, p.group_size) != (first.fmt, first.shape, first.group_size)
    ]
    if bad:
        raise ValueError(f"pack_experts: experts {bad} differ from expert 0 in format, shape or group size")
    if first.codes is None:
        return PackedLinear(
            first.fmt, first.shape, num_experts=len(packed), quantized=tuple(q for p in packed for q in p.quantized)
        )
    gs = torch.cat([p.global_scale for p in packed]) if first.global_scale is not None else None
    return PackedLinear(
        first.fmt,
        first.shape,
        torch.stack([p.codes for p in packed]),
        torch.stack([p.scales for p in packed]),
        gs,
        first.group_size,
        len(packed),
    )


def unpack(w: PackedLinear, expert: int | None = None):
    """The format object back from a PackedLinear (one expert of a stack with `expert`)."""

    def pick(t):
        return t if expert is None else t[expert]

    n, k = w.shape
    if w.num_experts and expert is None:
        raise ValueError("unpack: a stacked PackedLinear needs expert=<index>")
    if w.fmt == "nvfp4":
        gs = w.global_scale.reshape(-1)[0 if expert is None else expert].reshape(1)
        nib = bitmath.unrepack(pick(w.codes))
        return _nvfp4.NVFP4Tensor(
            (nib[:, 0::2] | (nib[:, 1::2] << 4)).contiguous(), pick(w.scales), gs, (n, k), "tensor"
        )
    if w.fmt == "int4":
        codes = (bitmath.unrepack(pick(w.codes)).to(torch.int8) - 8).contiguous()
        return _int4.INT4Tensor(codes, pick(w.scales), w.group_size, (n, k))
    return w.quantized[0 if expert is None else expert]


# --------------------------------------------------------------------------- matmul


def _as_packed(w) -> PackedLinear:
    return w if isinstance(w, PackedLinear) else pack(w)


def _check_x(x: torch.Tensor, k: int, what: str) -> None:
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"{what}: x must be [M, {k}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{what}: x dtype {x.dtype} is not a float type")


def _kernel_fmt(w: PackedLinear, x: torch.Tensor):
    """The Triton matmul's format id if it serves (x, w), else None."""
    if w.fmt not in ("nvfp4", "int4") or K.backend(x) != "triton" or x.dtype != torch.bfloat16:
        return None
    from . import matmul_triton as mt

    fmt = mt.FMT_NVFP4 if w.fmt == "nvfp4" else mt.FMT_INT4
    return fmt if mt.check_k(w.shape[1], fmt, w.group_size) else None


def reference_qmatmul(x: torch.Tensor, w: PackedLinear, expert: int | None = None) -> torch.Tensor:
    """policy.compute.matmul of x (fp8_block: its 1x128 quantization) and W's operand, in x.dtype."""
    q = K.to_device(unpack(w, expert), x.device)
    xo = compute.plain(x)
    if w.fmt == "fp8_block":
        xo = formats.operand(_fp8_block.quantize(x, block=_fp8_block.ACTIVATION_BLOCK))
    return compute.matmul(xo, formats.operand(q), x.dtype)


def qmatmul(x: torch.Tensor, w) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(W).T for a quantized weight W [N, K]."""
    w = _as_packed(w)
    if w.num_experts:
        raise ValueError("qmatmul: got a stack of experts; use moe_qmatmul")
    _check_x(x, w.shape[1], "qmatmul")
    fmt = _kernel_fmt(w, x)
    if fmt is not None:
        from . import matmul_triton as mt

        return mt.w4a16_matmul(x, w.codes, w.scales, w.global_scale, fmt, w.group_size)
    if w.fmt == "fp8_block" and K.backend(x) == "triton":
        y = _scaled_mm_fp8_block(x, w.quantized[0])
        if y is not None:
            return y
    return reference_qmatmul(x, w)


def moe_qmatmul(x: torch.Tensor, w: PackedLinear, topk_ids: torch.Tensor) -> torch.Tensor:
    """y [T, topk, N]: y[t, j] = x[t] @ dequant(W[topk_ids[t, j]]).T, every expert in one launch on GPU."""
    if not w.num_experts:
        raise ValueError("moe_qmatmul: w must be a stack of experts (pack_experts)")
    _check_x(x, w.shape[1], "moe_qmatmul")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_qmatmul: topk_ids must be [T={x.shape[0]}, topk], got {tuple(topk_ids.shape)}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= w.num_experts):
        raise ValueError(f"moe_qmatmul: expert ids must lie in [0, {w.num_experts})")
    fmt = _kernel_fmt(w, x)
    if fmt is not None:
        from . import matmul_triton as mt

        return mt.moe_w4a16_matmul(x, w.codes, w.scales, w.global_scale, topk_ids, fmt, w.group_size)
    t, topk = topk_ids.shape
    y = torch.empty(t, topk, w.shape[0], dtype=x.dtype, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        y[rows, slots] = reference_qmatmul(x[rows], w, expert=e)
    return y


@functools.cache
def _scaled_mm_state(device_index: int) -> dict:
    return {"ok": None}


def _scaled_mm_fp8_block(x: torch.Tensor, wq) -> torch.Tensor | None:
    """W8A8 fp8 block matmul through cuBLAS (torch scaled_mm, 1x128 x 128x128 scales).

    Returns None where this torch/GPU does not support blockwise scaling (then the caller
    uses the dequantized reference path). cuBLAS wants the token count a multiple of 4, the
    activation scales outer-dim-major and the weight's K blocks a multiple of 4."""
    state = _scaled_mm_state(x.device.index or 0)
    n, k = wq.shape
    if state["ok"] is False or wq.block != (128, 128) or n % 128 or k % 128:
        return None
    m = x.shape[0]
    xp = torch.nn.functional.pad(x, (0, 0, 0, -m % 4)) if m % 4 else x
    xq = K.quantize("fp8_block", xp.to(torch.bfloat16), block=(1, 128), check_finite=False)
    kb = k // 128
    s_b = wq.scale_inv
    if kb % 4:
        s_b = torch.nn.functional.pad(s_b, (0, -kb % 4))
    s_a = xq.scale_inv.t().contiguous().t()
    try:
        F = torch.nn.functional
        if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):
            y = F.scaled_mm(
                xq.codes,
                wq.codes.t(),
                s_a,
                F.ScalingType.BlockWise1x128,
                s_b.t(),
                F.ScalingType.BlockWise128x128,
                output_dtype=x.dtype,
            )
        else:
            y = torch._scaled_mm(xq.codes, wq.codes.t(), s_a, s_b.t(), out_dtype=x.dtype)
        state["ok"] = True
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        state["ok"] = False
        return None
    return y[:m]


__all__ = [
    "PackedLinear",
    "moe_qmatmul",
    "pack",
    "pack_experts",
    "qmatmul",
    "reference_qmatmul",
    "unpack",
]
