"""Fused sampling on CUDA: one Triton program per row, one pass over the vocabulary.

Computes exactly what `rollout.sampling.sample_reference` defines for untruncated sampling (the
same 32-bit hash, the same uniform, libdevice's logf as torch's CUDA log): an online logsumexp of
z = logits / T together with the running argmax of z + Gumbel noise (greedy: of z), split over
~24 vocabulary chunks per row so that small batches still fill the GPU, then one combine per row
(lowest index among equal scores) and logp = z[token] - logsumexp(z). The temperature is read from device memory (<= 0: greedy), so
one CUDA graph serves every temperature. Nothing is synchronized with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_V = 1024


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, step_ptr, step_stride, row):
    seed = tl.load(seed_ptr + row).to(tl.uint64)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    k = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    step = tl.load(step_ptr + row * step_stride).to(tl.uint64)
    return _mix32(k ^ (step & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _partial_kernel(
    logits_ptr,
    stride,
    seed_ptr,
    step_ptr,
    step_stride,
    temp_ptr,
    part_ptr,
    bad_ptr,
    V,
    P,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Program (row, p) scans vocabulary chunk p: (max z, sum exp(z - max), best score, its index);
    sets *bad = 1 when a logit it read is NaN or infinite."""
    row = tl.program_id(0)
    part = tl.program_id(1)
    t = tl.load(temp_ptr)
    greedy = t <= 0.0
    tt = tl.where(greedy, 1.0, t)
    key = _row_key(seed_ptr, step_ptr, step_stride, row)
    base = logits_ptr + row.to(tl.int64) * stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    nonfinite = tl.zeros([BLOCK], tl.int32)
    offs = tl.arange(0, BLOCK)
    for it in tl.static_range(ITERS):
        v = (part * ITERS + it) * BLOCK + offs
        vm = v < V
        x = tl.load(base + v, mask=vm, other=float("-inf")).to(tl.float32)
        nonfinite = tl.maximum(nonfinite, (vm & ((x != x) | (tl.abs(x) == float("inf")))).to(tl.int32))
        z = x / tt
        m_new = tl.maximum(m, z)  # per-lane online logsumexp, lanes combined below
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.where(vm, tl.exp(z - m_safe), 0.0)
        m = m_new
        r = _mix32(_mix32(v.to(tl.uint32) ^ key) + key)
        u = ((r >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        g = -libdevice.log(-libdevice.log(u))
        score = tl.where(greedy, z, z + g)
        score = tl.where(vm, score, float("-inf"))
        upd = score > best  # strict: an earlier index keeps a tie (each lane sees increasing v)
        best = tl.where(upd, score, best)
        best_i = tl.where(upd, v, best_i)
    mx = tl.max(m, 0)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    total = tl.sum(s * tl.exp(m - mx_safe), 0)
    top = tl.max(best, 0)
    idx = tl.min(tl.where(best == top, best_i, 2147483647), 0)  # lowest index among ties
    tl.store(bad_ptr, 1, mask=tl.max(nonfinite, 0) > 0)
    out = part_ptr + (row * P + part) * 4
    tl.store(out, mx)
    tl.store(out + 1, total)
    tl.store(out + 2, top)
    tl.store(out + 3, idx.to(tl.float32, bitcast=True))


@triton.jit
def _combine_kernel(logits_ptr, stride, temp_ptr, part_ptr, tok_ptr, logp_ptr, P, PP: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr)
    tt = tl.where(t <= 0.0, 1.0, t)
    p = tl.arange(0, PP)
    pm = p < P
    base = part_ptr + (row * P + p) * 4
    m = tl.load(base, mask=pm, other=float("-inf"))
    s = tl.load(base + 1, mask=pm, other=0.0)
    best = tl.load(base + 2, mask=pm, other=float("-inf"))
    idx = tl.load(base + 3, mask=pm, other=0.0).to(tl.int32, bitcast=True)
    mx = tl.max(m, 0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), 0))
    top = tl.max(best, 0)
    tok = tl.min(tl.where(pm & (best == top), idx, 2147483647), 0)
    zt = tl.load(logits_ptr + row.to(tl.int64) * stride + tok).to(tl.float32) / tt
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, zt - lse)


def _split(V: int) -> tuple[int, int]:
    """(iterations of BLOCK_V per program, programs per row): about 24 programs per row."""
    iters = max(1, triton.cdiv(triton.cdiv(V, 24), BLOCK_V))
    return iters, triton.cdiv(V, iters * BLOCK_V)


def sample(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor, temperature, nonfinite=None) -> tuple:
    """(tokens [B] int64, logp [B] fp32) from logits [B, V] (any float dtype, read as fp32; last dim
    contiguous), seeds [B] int64, step: int64 tensor of 1 element (every row) or B (each row's own
    token index, as continuous batching needs), temperature: 1-element fp32
    tensor or float; `nonfinite` (int32 [1]) is set to 1 if a logit is NaN/Inf (else left alone).
    Two launches: per (row, vocabulary chunk) partials, then one combine per row."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor([float(temperature)], dtype=torch.float32, device=dev)
    if not isinstance(step, torch.Tensor):
        step = torch.tensor([int(step)], dtype=torch.int64, device=dev)
    if step.numel() not in (1, B):
        raise ValueError(f"step has {step.numel()} elements for {B} rows (want 1 or {B})")
    step = step.reshape(-1)
    if nonfinite is None:
        nonfinite = torch.zeros(1, dtype=torch.int32, device=dev)
    iters, P = _split(V)
    part = torch.empty(B, P, 4, dtype=torch.float32, device=dev)
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    logp = torch.empty(B, dtype=torch.float32, device=dev)
    _partial_kernel[(B, P)](
        logits,
        logits.stride(0),
        seeds,
        step,
        0 if step.numel() == 1 else step.stride(0),
        temperature,
        part,
        nonfinite,
        V,
        P,
        BLOCK=BLOCK_V,
        ITERS=iters,
        num_warps=8,
    )
    _combine_kernel[(B,)](
        logits, logits.stride(0), temperature, part, tok, logp, P, PP=triton.next_power_of_2(P), num_warps=1
    )
    return tok, logp
