"""Fused sampling on CUDA: one Triton program per row, one pass over the vocabulary.

Computes exactly what `rollout.sampling.sample_reference` defines for untruncated sampling (the
same 32-bit hash, the same uniform, libdevice's logf as torch's CUDA log): per row, an online
logsumexp of z = logits / T together with the running argmax of z + Gumbel noise (greedy: of z),
then logp = z[token] - logsumexp(z). The temperature is read from device memory (<= 0: greedy), so
one CUDA graph serves every temperature. Nothing is synchronized with the host.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

BLOCK_V = 2048


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_kernel(logits_ptr, stride, seed_ptr, step_ptr, temp_ptr, tok_ptr, logp_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr)
    greedy = t <= 0.0
    tt = tl.where(greedy, 1.0, t)
    seed = tl.load(seed_ptr + row).to(tl.uint64)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = (seed >> 32).to(tl.uint32)
    k = _mix32(lo ^ _mix32(hi ^ 0x9E3779B9))
    step = tl.load(step_ptr).to(tl.uint64)
    key = _mix32(k ^ (step & 0xFFFFFFFF).to(tl.uint32))
    base = logits_ptr + row.to(tl.int64) * stride
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.zeros([BLOCK], tl.int32)
    offs = tl.arange(0, BLOCK)
    for v0 in range(0, V, BLOCK):
        v = v0 + offs
        vm = v < V
        x = tl.load(base + v, mask=vm, other=float("-inf")).to(tl.float32)
        z = x / tt
        # Per-lane online logsumexp (combined across lanes at the end).
        m_new = tl.maximum(m, z)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.where(vm, tl.exp(z - m_safe), 0.0)
        m = m_new
        r = _mix32(_mix32(v.to(tl.uint32) ^ key) + key)
        u = ((r >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        g = -libdevice.log(-libdevice.log(u))
        score = tl.where(greedy, z, z + g)
        score = tl.where(vm, score, float("-inf"))
        upd = score > best  # strict: an earlier index keeps a tie (each lane sees increasing v)
        best = tl.where(upd, score, best)
        best_i = tl.where(upd, v, best_i)
    mx = tl.max(m, 0)
    total = tl.sum(s * tl.exp(m - mx), 0)
    lse = mx + tl.log(total)
    top = tl.max(best, 0)
    tok = tl.min(tl.where(best == top, best_i, 2147483647), 0)  # lowest index among ties
    zt = tl.load(base + tok).to(tl.float32) / tt
    tl.store(tok_ptr + row, tok.to(tl.int64))
    tl.store(logp_ptr + row, zt - lse)


def sample(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor, temperature) -> tuple:
    """(tokens [B] int64, logp [B] fp32) from logits [B, V] (any float dtype, last dim contiguous),
    seeds [B] int64, step: int64 tensor of 1 element, temperature: 1-element fp32 tensor or float."""
    B, V = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not isinstance(temperature, torch.Tensor):
        temperature = torch.tensor([float(temperature)], dtype=torch.float32, device=logits.device)
    if not isinstance(step, torch.Tensor):
        step = torch.tensor([int(step)], dtype=torch.int64, device=logits.device)
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    logp = torch.empty(B, dtype=torch.float32, device=logits.device)
    _sample_kernel[(B,)](logits, logits.stride(0), seeds, step, temperature, tok, logp, V, BLOCK=BLOCK_V, num_warps=8)
    return tok, logp
