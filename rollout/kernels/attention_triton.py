"""Decode attention on CUDA: one Triton program per (row, KV head), the KV-cache write fused in.

For row b at position p = pos[b] (its new token's slot): store the new k, v at slot p of the
row's cache, then attend the G = n_heads / n_kv_heads query heads of this KV head over slots
0..p (online softmax in fp32, scores from fp32 accumulation of bf16 products, probabilities
rounded to bf16 for the p @ V product, as the torch version rounds them). Only the live keys are
read (0..p-1 from the cache, the new one from registers), so the cost grows with the context,
not with the slot's capacity; the loop bound comes from device memory, so one CUDA graph serves
every length. Replaces index_put x 2 + two batched matmuls + a softmax per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_attn_kernel(
    q_ptr,
    kn_ptr,
    vn_ptr,
    kc_ptr,
    vc_ptr,
    pos_ptr,
    o_ptr,
    stride_qb,
    stride_knb,
    stride_vnb,
    stride_cb,
    stride_ch,
    stride_cs,
    stride_ob,
    scale,
    G: tl.constexpr,
    GP: tl.constexpr,
    HD: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + b).to(tl.int32)
    d = tl.arange(0, HD)
    g = tl.arange(0, GP)
    gm = g < G
    q = tl.load(
        q_ptr + b.to(tl.int64) * stride_qb + (h * G + g)[:, None] * HD + d[None, :], mask=gm[:, None], other=0.0
    )
    kn = tl.load(kn_ptr + b.to(tl.int64) * stride_knb + h * HD + d)
    vn = tl.load(vn_ptr + b.to(tl.int64) * stride_vnb + h * HD + d)
    cache = b.to(tl.int64) * stride_cb + h.to(tl.int64) * stride_ch
    tl.store(kc_ptr + cache + p.to(tl.int64) * stride_cs + d, kn)
    tl.store(vc_ptr + cache + p.to(tl.int64) * stride_cs + d, vn)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, HD], tl.float32)
    s_off = tl.arange(0, BLOCK_S)
    for start in range(0, p, BLOCK_S):
        s_idx = start + s_off
        sm = s_idx < p
        kv_ofs = cache + s_idx.to(tl.int64)[:, None] * stride_cs + d[None, :]
        k = tl.load(kc_ptr + kv_ofs, mask=sm[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(sm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, 1)
        v = tl.load(vc_ptr + kv_ofs, mask=sm[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v)
        m_i = m_new
    # The new token itself (slot p), from registers.
    s_cur = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale
    m_new = tl.maximum(m_i, s_cur)
    alpha = tl.exp(m_i - m_new)
    pc = tl.exp(s_cur - m_new)
    l_i = l_i * alpha + pc
    acc = acc * alpha[:, None] + pc.to(vn.dtype).to(tl.float32)[:, None] * vn.to(tl.float32)[None, :]
    out = acc / l_i[:, None]
    tl.store(
        o_ptr + b.to(tl.int64) * stride_ob + (h * G + g)[:, None] * HD + d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=gm[:, None],
    )


def decode_attention(q, k_new, v_new, k_cache, v_cache, pos, scale: float) -> torch.Tensor:
    """q [n, H, hd] (contiguous rows), k_new / v_new [n, Hkv, hd] (last dim contiguous), caches
    [B >= n, Hkv, S, hd] contiguous, pos [n] int64 -> o [n, H, hd]; writes k_new / v_new at
    cache[b, :, pos[b]]."""
    n, H, hd = q.shape
    hk = k_new.shape[1]
    G = H // hk
    assert q.stride(2) == 1 and q.stride(1) == hd and k_new.stride(2) == 1 and v_new.stride(2) == 1
    assert k_new.stride(1) == hd and v_new.stride(1) == hd and k_cache.is_contiguous() and v_cache.is_contiguous()
    o = torch.empty(n, H, hd, dtype=q.dtype, device=q.device)
    _decode_attn_kernel[(n, hk)](
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        pos,
        o,
        q.stride(0),
        k_new.stride(0),
        v_new.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        o.stride(0),
        scale,
        G=G,
        GP=max(16, triton.next_power_of_2(G)),
        HD=hd,
        BLOCK_S=64,
        num_warps=4,
    )
    return o
