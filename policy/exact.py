"""Batch-invariant operations of exact mode (`loop.exact`): each output element is computed by one
fixed sequence of IEEE fp32 operations on its own inputs, whatever the batch size, the row's position
in it, the sequence length, the padding, the number of threads or the device (the same torch ops run
on the CPU and on CUDA; exp and log are each device's own, so each side is exact within one kind of
device). `policy.model` and
`policy.compute` call these where the model's hook says `exact`; the default path never does.

The orders (another implementation matches these bit for bit by doing the same operations):
- tree_sum(x, dim) over n elements: append +0.0 up to P = the next power of two >= n, then while
  P > 1: P = P / 2 and element i becomes x[i] + x[i + P]. Only elementwise adds, so no thread or
  vector split can reorder it, and trailing zeros (masked keys, padding) change nothing: any P >= n
  gives the same bits.
- mm(x [M, K], w [N, K]): acc[m, n] = tree_sum over k of fp32(x[m, k]) * fp32(w[n, k]).
- attention(q, k, v, mask): s = tree_sum(q * k over head_dim) * fp32(1 / sqrt(head_dim)) for every
  key (grouped-query kv heads repeated as SDPA's enable_gqa); for each query,
  its visible keys (mask True, in key order) take ranks 0..n-1; m = max over them; e = exp(s - m),
  +0 for hidden keys; den = tree_sum over ranks of e; o = tree_sum over ranks of (e / den) * v
  (hidden keys add zeros; the sign of an all-zero sum is not part of the contract).
- rms_norm(x) = (x * (1 / sqrt(tree_sum(x * x) / K + eps))) * w; silu(x) = x / (1 + exp(-x)).
- softmax(x) = e / tree_sum(e), log_softmax(x) = (x - m) - log(tree_sum(e)), e = exp(x - m), m = max.
exp and log are torch's kernels of the device, per element on the builds used (tests/unit/test_exact.py
checks on the CPU that a value's result does not depend on where it sits; tests/gpu/test_exact_gpu.py
the whole rollout-against-trainer comparison on CUDA). Gradients: each op's backward is
the ordinary op's (`_ExactForward`); exactness is a property of the forward only.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["attention", "log_softmax", "mm", "rms_norm", "scaled_log_softmax", "silu", "softmax", "tree_sum"]

_CHUNKS = {"cpu": 1 << 21, "cuda": 1 << 26}  # elements of one product buffer (the order does not depend on it)
_LOCAL = threading.local()


def tree_sum(x: Tensor, dim: int = -1, *, keepdim: bool = False) -> Tensor:
    """The sum over `dim` in the fixed pairwise order of the module docstring."""
    dim = dim % x.ndim
    n = x.shape[dim]
    if n == 0:
        return x.sum(dim, keepdim=keepdim)
    p = 1 << (n - 1).bit_length()
    if p != n:
        pad = list(x.shape)
        pad[dim] = p - n
        x = torch.cat([x, x.new_zeros(pad)], dim)
    while p > 1:
        p //= 2
        x = x.narrow(dim, 0, p) + x.narrow(dim, p, p)
    return x if keepdim else x.squeeze(dim)


def _chunk(device: torch.device) -> int:
    """Products held at once on `device`: CUDA takes bigger buffers, to launch fewer kernels."""
    return _CHUNKS.get(device.type, _CHUNKS["cpu"])


def _scratch(shape: tuple, device: torch.device) -> Tensor:
    """An fp32 buffer of `shape`, reused by this thread (a fresh large tensor per call costs more in
    page faults than the products it holds)."""
    n = math.prod(shape)
    buf = getattr(_LOCAL, "buf", None)
    if buf is None or buf.numel() < n or buf.device != device:
        buf = _LOCAL.buf = torch.empty(max(n, _chunk(device)), dtype=torch.float32, device=device)
    return buf[:n].view(shape)


def _dot(a: Tensor, b: Tensor, dim: int = 0) -> Tensor:
    """tree_sum over `dim` of a * b (broadcast), in place in a scratch buffer (no autograd): the same
    bits as tree_sum(a * b, dim) whatever the dim's place in memory."""
    shape = list(torch.broadcast_shapes(a.shape, b.shape))
    dim = dim % len(shape)
    n = shape[dim]
    p = shape[dim] = 1 << (n - 1).bit_length()
    prod = _scratch(tuple(shape), a.device)
    torch.mul(a, b, out=prod.narrow(dim, 0, n))
    prod.narrow(dim, n, p - n).zero_()
    while p > 1:
        p //= 2
        prod = prod.narrow(dim, 0, p).add_(prod.narrow(dim, p, p))
    return prod.squeeze(dim).clone()


def _mm(x: Tensor, w: Tensor) -> Tensor:
    """[M, N] fp32 for x [M, K], w [N, K], rows in chunks. Few rows: the products [M, N, K] as the
    operands lie; else [K, M, N] (k leading: contiguous halves), from transposed copies."""
    x, w = x.float(), w.float()
    M, K, N, chunk = x.shape[0], x.shape[1], w.shape[0], _chunk(x.device)
    cols = max(1, min(N, chunk // max(1, K * min(M, 16))))
    if M < 16:
        return torch.cat([_dot(x[:, None, :], w[j : j + cols][None], -1) for j in range(0, N, cols)], 1)
    xt, wt = x.t().contiguous(), w.t().contiguous()  # [K, M], [K, N]
    rows = max(1, chunk // max(1, K * cols))
    return torch.cat(
        [
            torch.cat([_dot(xt[:, i : i + rows, None], wt[:, None, j : j + cols]) for j in range(0, N, cols)], 1)
            for i in range(0, M, rows)
        ]
    )


def mm(x: Tensor, w: Tensor) -> Tensor:
    """fp32 x @ w.T for x [..., K], w [N, K], each element a tree_sum over K (differentiable)."""
    lead = x.shape[:-1]
    y = _apply(_mm, lambda a, b: F.linear(a.float(), b.float()), x.reshape(-1, x.shape[-1]), w)
    return y.view(*lead, w.shape[0])


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """q [B, H, T, hd], k/v [B, H, S, hd] fp32, mask [B, 1, T, S] bool -> [B, H, T, hd]."""
    qd, kd = q.permute(3, 0, 1, 2).contiguous(), k.permute(3, 0, 1, 2).contiguous()  # [hd, B, H, T|S]
    s = _dot(qd[..., None], kd[:, :, :, None, :]) * (1.0 / math.sqrt(q.shape[-1]))
    mask = mask.expand(-1, s.shape[1], -1, -1).contiguous()
    m = torch.where(mask, s, -torch.inf).amax(dim=-1, keepdim=True)
    e = torch.where(mask, torch.exp(s - m), 0.0)
    prefix, order = _ranks(mask)
    if not prefix:  # visible keys first, in key order: rank r at index r
        e = e.gather(-1, order)
    den = tree_sum(e, keepdim=True)
    p = (e / den).permute(3, 0, 1, 2).contiguous()[..., None]  # keys first: [S, B, H, T, 1]
    vs = v.permute(2, 0, 1, 3).contiguous()[:, :, :, None] if prefix else _gather_keys(v, order)
    return _dot(p, vs)


def _ranks(mask: Tensor) -> tuple[bool, Tensor | None]:
    """(True, None) when every query's visible keys are slots 0..n-1 (a right-padded causal batch);
    else (False, order [B, H, T, S]): per query, its visible key slots first, in key order."""
    n = mask.sum(dim=-1, keepdim=True)
    if bool((mask == (torch.arange(mask.shape[-1], device=mask.device) < n)).all()):
        return True, None
    return False, (~mask).to(torch.int8).argsort(dim=-1, stable=True)


def _gather_keys(v: Tensor, order: Tensor) -> Tensor:
    """v [B, H, S, hd] -> [S, B, H, T, hd]: for query t, the keys in `order[b, h, t]` (keys first)."""
    B, H, S, hd = v.shape
    idx = order[..., None].expand(-1, -1, -1, -1, hd)
    return v[:, :, None].expand(B, H, order.shape[2], S, hd).gather(3, idx).permute(3, 0, 1, 2, 4).contiguous()


def _attention_chunks(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """_attention over chunks of batch rows and queries (each output independent of the others)."""
    B, H, T, hd = q.shape
    per_query, chunk = H * k.shape[2] * hd, _chunk(q.device)  # products of one row's query
    bs = max(1, min(B, chunk // per_query))
    ts = max(1, chunk // (bs * per_query))
    q, k, v = q.float(), k.float(), v.float()
    return torch.cat(
        [
            torch.cat(
                [
                    _attention(
                        q[b : b + bs, :, t : t + ts], k[b : b + bs], v[b : b + bs], mask[b : b + bs, :, t : t + ts]
                    )
                    for t in range(0, T, ts)
                ],
                2,
            )
            for b in range(0, B, bs)
        ]
    )


def _attention_ref(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)


def attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """Scaled dot-product attention, q [B, H, T, hd], k/v [B, Hkv, S, hd] (grouped-query heads as
    SDPA's enable_gqa: head h reads kv head h // (H / Hkv)), mask [B, 1, T, S] True = attend; every
    query must see at least one key. -> [B, H, T, hd] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return _apply(_attention_chunks, _attention_ref, q, k, v, mask).to(q.dtype)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    ms = tree_sum(xf * xf, keepdim=True) / xf.shape[-1]
    return (xf * (1.0 / torch.sqrt(ms + eps))) * weight.float()


def _rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim in x's dtype (`policy.model.rms_norm`'s function)."""
    return _apply(lambda a, b: _rms_norm(a, b, eps), lambda a, b: _rms_norm_ref(a, b, eps), x, weight).to(x.dtype)


def _silu(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def silu(x: Tensor) -> Tensor:
    return _apply(_silu, F.silu, x)


def _softmax(x: Tensor) -> Tensor:
    e = torch.exp(x - x.amax(dim=-1, keepdim=True))
    return e / tree_sum(e, keepdim=True)


def softmax(x: Tensor) -> Tensor:
    """Softmax over the last dim (fp32 x)."""
    return _apply(_softmax, lambda a: a.softmax(dim=-1), x)


def _log_softmax(x: Tensor) -> Tensor:
    z = x - x.amax(dim=-1, keepdim=True)
    return z - torch.log(tree_sum(torch.exp(z), keepdim=True))


def log_softmax(x: Tensor) -> Tensor:
    """Log-softmax over the last dim (fp32 x)."""
    return _apply(_log_softmax, lambda a: a.log_softmax(dim=-1), x)


def scaled_log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) in fp32: the one formula the engine's sampler and the
    trainer's log-probs share in exact mode (no division at temperature 1)."""
    x = logits.float()
    return log_softmax(x if temperature == 1.0 else x / temperature)


class _ExactForward(torch.autograd.Function):
    """y = exact(*xs); the backward is the gradient of ref(*xs), the ordinary op, at the same inputs."""

    @staticmethod
    def forward(ctx, exact, ref, *xs):
        ctx.ref = ref
        ctx.save_for_backward(*xs)
        return exact(*xs)

    @staticmethod
    def backward(ctx, grad):
        xs = [x.detach().requires_grad_(need) for x, need in zip(ctx.saved_tensors, ctx.needs_input_grad[2:])]
        wanted = [x for x in xs if x.requires_grad]
        with torch.enable_grad():
            y = ctx.ref(*xs)
        grads = iter(torch.autograd.grad(y, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if x.requires_grad else None for x in xs))


def _apply(exact, ref, *xs: Tensor) -> Tensor:
    """exact(*xs), differentiable through ref's backward where autograd needs it."""
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        return _ExactForward.apply(exact, ref, *xs)
    return exact(*xs)
