"""Weight-only 4-bit matmul for decoding: y = x @ dequant(W).T with bf16 x, on CUDA via Triton.

W is nvfp4 (tensor scope) or int4 (groups along K), dequantized in registers (never written out in
bf16) and fed to the tensor cores with x:
- nvfp4: pairs of codes become bf16 bit patterns by bit moves, and one bf16x2 multiply gives the
  Compute contract's operand e2m1 x sf times 2^-7, exactly; the epilogue applies the contract's
  post-accumulator scales (per-token `x_scale` for nvfp4 activations, then S_dec_w), each product
  rounded once.
- int4: exactly `dequantize(W).to(bf16)`, i.e. bf16(q * s) rounded once, as Marlin-style kernels.
The tile is [BN weight rows] x [BM = 16 tokens] for every M, with no split-K by M and a fixed K
order, so a row's result does not depend on its batch (the batch invariance DESIGN.md asks of the
rollout engine). MoE: all routed experts of a layer in one launch, weights stacked [E, N, K/8],
tokens grouped by expert into 16-row blocks (`moe_align`, no host sync, CUDA-graph safe), one
program per (block, N tile) or a persistent grid walking those items (the same bits). The bit
tricks and the code layout (`bitmath.repack`) are described where they are written, below."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from policy.kernels.quant_triton import _sm_count, e2m1_f32

from .routing import BLOCK_M, moe_align

FMT_NVFP4 = 0
FMT_INT4 = 1

# nvfp4 dequantization: two codes at a time become bf16 bit patterns worth e2m1 * 2^-126 (bit moves
# only: the nibble's e1 e0 m bits land on bf16 bits 6-8, which makes the E2M1 subnormal 0.5 the bf16
# subnormal 2^-127), and one bf16x2 multiply by sf * 2^119 gives e2m1 * sf * 2^-7, exact in bf16 (at
# most 6 significant bits, magnitude in [2^-17, 21]): the Compute contract's operand e2m1 x sf
# (`policy.formats.nvfp4.operand`) times 2^-7, exactly. The epilogue computes
# y = (acc * (2^7 * S_dec_x[row])) * S_dec_w with per-token activation scales (`x_scale`: x is then
# their operand e2m1 x sf), else acc * (2^7 * S_dec_w); both equal (acc_contract * S_dec_x) * S_dec_w
# rounded once per product, as 2^7 scalings are exact.
#
# Code layout (`bitmath.repack`, once per weight by `rollout.kernels.pack`): the transported codes
# (byte j = elements 2j, 2j+1) are regrouped into int32 words, two per 16-element block; word h of
# block b holds, in nibbles j and j+4 (j = 0..3), elements 16b + 4j + 2h and 16b + 4j + 2h + 1. One
# shift + mask then puts a pair of K-consecutive codes in the two 16-bit lanes of a register, so four
# bf16x2 values (P_0..P_3) come out of each word with no byte shuffling, and P_j across a tile is a
# dense [BN, BK/4] operand whose K index is 16 * (c // 4) + 4j + c % 4: x is loaded in that order
# (8-byte pieces) for the j-th of four dots. The tile is "swap AB": weights are the wide operand of
# the dot, tokens the narrow one.

# Four bf16x2 outputs from one word of eight codes: P_j from nibbles j (low lane) and j+4
# (high lane), scaled by the bf16x2 scale word $5.
_NVFP4_ASM = tl.constexpr("""
{
.reg .b32 u, s, nz;
mov.b32 nz, 0x80008000;
shl.b32 u, $4, 6;
and.b32 u, u, 0x03C003C0;
and.b32 s, u, 0x02000200;
mad.lo.u32 u, s, 63, u;
fma.rn.bf16x2 $0, u, $5, nz;
shl.b32 u, $4, 2;
and.b32 u, u, 0x03C003C0;
and.b32 s, u, 0x02000200;
mad.lo.u32 u, s, 63, u;
fma.rn.bf16x2 $1, u, $5, nz;
shr.b32 u, $4, 2;
and.b32 u, u, 0x03C003C0;
and.b32 s, u, 0x02000200;
mad.lo.u32 u, s, 63, u;
fma.rn.bf16x2 $2, u, $5, nz;
shr.b32 u, $4, 6;
and.b32 u, u, 0x03C003C0;
and.b32 s, u, 0x02000200;
mad.lo.u32 u, s, 63, u;
fma.rn.bf16x2 $3, u, $5, nz;
}
""")

# int4: the nibble of each lane goes into the mantissa of bf16 128 (one LOP3: (w & 0xF000F) |
# 0x43004300), minus 136 (exact), times the scale (one rounding): 15 instructions per word.
_INT4_ASM = tl.constexpr("""
{
.reg .b32 u, t, magic, one, n136, nz;
mov.b32 magic, 0x43004300;
mov.b32 one, 0x3F803F80;
mov.b32 n136, 0xC308C308;
mov.b32 nz, 0x80008000;
lop3.b32 u, $4, 0x000F000F, magic, 0xEA;
fma.rn.bf16x2 u, u, one, n136;
fma.rn.bf16x2 $0, u, $5, nz;
shr.b32 t, $4, 4;
lop3.b32 u, t, 0x000F000F, magic, 0xEA;
fma.rn.bf16x2 u, u, one, n136;
fma.rn.bf16x2 $1, u, $5, nz;
shr.b32 t, $4, 8;
lop3.b32 u, t, 0x000F000F, magic, 0xEA;
fma.rn.bf16x2 u, u, one, n136;
fma.rn.bf16x2 $2, u, $5, nz;
shr.b32 t, $4, 12;
lop3.b32 u, t, 0x000F000F, magic, 0xEA;
fma.rn.bf16x2 u, u, one, n136;
fma.rn.bf16x2 $3, u, $5, nz;
}
""")


@triton.jit
def _lanes(o, BN: tl.constexpr, BK: tl.constexpr):
    """int32 [BN, BK/8] words of two bf16 (low lane first) -> bf16 [BN, BK/4]."""
    lo = (o & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (o >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), (BN, BK // 4))


@triton.jit
def _plain_pair(q, j: tl.constexpr, f, FMT: tl.constexpr):
    """USE_ASM=False: the same bf16 values as the PTX, with ordinary Triton ops (cross-check)."""
    c_lo = (q >> (4 * j)) & 0xF
    c_hi = (q >> (4 * j + 16)) & 0xF
    if FMT == 0:  # the E2M1 value (exact) times sf * 2^-7 (f holds sf as fp32)
        lo = (e2m1_f32(c_lo) * (f * 0.0078125)).to(tl.bfloat16)
        hi = (e2m1_f32(c_hi) * (f * 0.0078125)).to(tl.bfloat16)
    else:
        lo = ((c_lo - 8).to(tl.float32) * f).to(tl.bfloat16)
        hi = ((c_hi - 8).to(tl.float32) * f).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _scale_words(s_ptr, stride_sn, n64, nmask, k0, FMT: tl.constexpr, G: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """The K tile's scales, one per weight word [BN, BK/8]: the bf16x2 word the PTX multiplies by
    (nvfp4: sf * 2^119, int4: the group scale, in both lanes), or fp32 for the plain dequant."""
    NB: tl.constexpr = BK // 16
    if FMT == 0:
        sb = tl.load(
            s_ptr + n64[:, None] * stride_sn + (k0 // 16 + tl.arange(0, NB)[None, :]), mask=nmask[:, None], other=0
        )
        sf = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [BN, NB]
        if USE_ASM:
            fb = (sf * 6.646139978924579e35).to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            f = fb | (fb << 16)  # sf * 2^119 in both lanes
        else:
            f = sf
    else:
        if G <= BK:
            ng = tl.arange(0, BK // G)
            sg = tl.load(s_ptr + n64[:, None] * stride_sn + (k0 // G + ng[None, :]), mask=nmask[:, None], other=0.0)
            sg = tl.reshape(tl.broadcast_to(sg[:, :, None], (BN, BK // G, G // 16)), (BN, NB))
        else:
            sg = tl.load(
                s_ptr + n64[:, None] * stride_sn + (k0 + tl.arange(0, NB)[None, :] * 16) // G,
                mask=nmask[:, None],
                other=0.0,
            )
        if USE_ASM:
            fb = sg.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            f = fb | (fb << 16)
        else:
            f = sg.to(tl.float32)
    # One scale per 16-block = per two words.
    return tl.reshape(tl.broadcast_to(f[:, :, None], (BN, NB, 2)), (BN, BK // 8))


@triton.jit
def _operands(q, f, FMT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):
    """Words q [BN, BK/8] and their scales f -> the four bf16 operands P_0..P_3 [BN, BK/4]."""
    if USE_ASM:
        if FMT == 0:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _NVFP4_ASM,
                "=r,=r,=r,=r,r,r",
                [q, f],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        else:
            p0, p1, p2, p3 = tl.inline_asm_elementwise(
                _INT4_ASM,
                "=r,=r,=r,=r,r,r",
                [q, f],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32),
                is_pure=True,
                pack=1,
            )
        return _lanes(p0, BN, BK), _lanes(p1, BN, BK), _lanes(p2, BN, BK), _lanes(p3, BN, BK)
    lo, hi = _plain_pair(q, 0, f, FMT)
    u0 = tl.reshape(tl.join(lo, hi), (BN, BK // 4))
    lo, hi = _plain_pair(q, 1, f, FMT)
    u1 = tl.reshape(tl.join(lo, hi), (BN, BK // 4))
    lo, hi = _plain_pair(q, 2, f, FMT)
    u2 = tl.reshape(tl.join(lo, hi), (BN, BK // 4))
    lo, hi = _plain_pair(q, 3, f, FMT)
    u3 = tl.reshape(tl.join(lo, hi), (BN, BK // 4))
    return u0, u1, u2, u3


@triton.jit
def _tile_dot(acc, w_base, s_ptr, stride_sn, n64, nmask, x_base, xmask, k0, FMT: tl.constexpr, G: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """acc [BN, BM] plus the K tile at k0: weight words from w_base [BN, BK/8] (K tile 0), block scales
    from s_ptr's rows n64, x from x_base [BK/4, BM] (operand column c's K offset for j = 0)."""
    q = tl.load(w_base + k0 // 8, mask=nmask[:, None], other=0)
    f = _scale_words(s_ptr, stride_sn, n64, nmask, k0, FMT, G, BN, BK, USE_ASM)
    u0, u1, u2, u3 = _operands(q, f, FMT, BN, BK, USE_ASM)
    acc = tl.dot(u0, tl.load(x_base + k0, mask=xmask, other=0.0), acc)
    acc = tl.dot(u1, tl.load(x_base + (k0 + 4), mask=xmask, other=0.0), acc)
    acc = tl.dot(u2, tl.load(x_base + (k0 + 8), mask=xmask, other=0.0), acc)
    acc = tl.dot(u3, tl.load(x_base + (k0 + 12), mask=xmask, other=0.0), acc)
    return acc


@triton.jit
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_wn,
    stride_sn,
    pair_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    stride_we,
    stride_se,
    ws_ptr,
    lock_ptr,
    xs_ptr,
    FMT: tl.constexpr,
    G: tl.constexpr,
    MOE: tl.constexpr,
    HAS_XS: tl.constexpr,
    TOPK: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BM: tl.constexpr,
    USE_ASM: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """w: int32 words [N, K/8] (kernel layout), stride_wn = K/8; s: nvfp4 e4m3 bytes [N, K/16]
    or int4 bf16 [N, K/G], stride_sn = its row length (separate args so the launcher's
    divisible-by-16 specialization gives vector loads).

    SPLIT > 1 splits K over program_id(2): each program writes its fp32 partial tile to ws, and
    the last of a tile's SPLIT programs to arrive (a counter in lock, acq_rel) adds the
    partials in the fixed order 0..SPLIT-1 and writes y: deterministic, and the same for every
    M. Decode has too few output tiles to keep the GPU's warps busy without it."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    tok = tl.arange(0, BM)
    if MOE:
        if pid_m >= tl.load(num_blocks_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(pair_ptr + pid_m * BM + tok)  # -1 pads the block
        rmask = pair >= 0
        x_row = tl.where(rmask, pair // TOPK, 0)
        y_row = tl.where(rmask, pair, 0)
        w_ptr += expert * stride_we
        s_ptr += expert * stride_se
        gs_ptr += expert
    else:
        rows = pid_m * BM + tok
        rmask = rows < M
        x_row = rows
        y_row = rows

    n = pid_n * BN + tl.arange(0, BN)
    nmask = n < N
    n64 = n.to(tl.int64)
    w_base = w_ptr + n64[:, None] * stride_wn + tl.arange(0, BK // 8)[None, :]  # [BN, BK/8]
    c = tl.arange(0, BK // 4)
    x_k = 16 * (c // 4) + (c % 4)  # K offset of operand column c, for j = 0
    x_base = x_ptr + x_row.to(tl.int64)[None, :] * stride_xm + x_k[:, None]  # [BK/4, BM]
    xmask = rmask[None, :]

    acc = tl.zeros([BN, BM], dtype=tl.float32)
    tiles_per_split = tl.cdiv(K // BK, SPLIT)
    k_lo = pid_s * tiles_per_split * BK
    k_hi = tl.minimum(K, k_lo + tiles_per_split * BK)
    for k0 in range(k_lo, k_hi, BK):
        acc = _tile_dot(acc, w_base, s_ptr, stride_sn, n64, nmask, x_base, xmask, k0, FMT, G, BN, BK, USE_ASM)

    y = y_ptr + y_row.to(tl.int64)[None, :] * stride_ym + n64[:, None]
    ymask = nmask[:, None] & rmask[None, :]
    xs = _x_scales(xs_ptr, x_row, rmask, HAS_XS, BM)
    if SPLIT == 1:
        _store_tile(acc, y, ymask, gs_ptr, xs, FMT, HAS_XS)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        t_ofs = tl.arange(0, BN)[:, None] * BM + tok[None, :]
        base = ws_ptr + tile.to(tl.int64) * (SPLIT * BN * BM) + t_ofs
        tl.store(base + pid_s * (BN * BM), acc)
        arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.load(base, cache_modifier=".cg")
            for s_i in tl.static_range(1, SPLIT):
                total += tl.load(base + s_i * (BN * BM), cache_modifier=".cg")
            _store_tile(total, y, ymask, gs_ptr, xs, FMT, HAS_XS)
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch


@triton.jit
def _moe_persistent_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    gs_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    stride_wn,
    stride_sn,
    pair_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    stride_we,
    stride_se,
    xs_ptr,
    FMT: tl.constexpr,
    G: tl.constexpr,
    HAS_XS: tl.constexpr,
    TOPK: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    BM: tl.constexpr,
    USE_ASM: tl.constexpr,
):
    """The MoE launch on a fixed grid of P programs: program p takes the items (16-row block, N tile)
    p, p + P, p + 2P, ... and runs all their K tiles as one loop, so the next item's loads are in
    flight while a tile's epilogue runs (one program per item starts and ends with few loads in
    flight). Each tile's K order and epilogue are `_w4a16_kernel`'s: the same bits."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    n_tiles = tl.cdiv(N, BN)
    k_tiles = K // BK
    items = tl.load(num_blocks_ptr) * n_tiles
    steps = tl.cdiv(tl.maximum(items - pid, 0), progs) * k_tiles
    tok = tl.arange(0, BM)
    c = tl.arange(0, BK // 4)
    x_k = 16 * (c // 4) + (c % 4)  # K offset of operand column c, for j = 0
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    w_off = tl.arange(0, BN)[:, None] * stride_wn + tl.arange(0, BK // 8)[None, :]  # a tile's words from its first
    item = pid - progs
    ki = k_tiles - 1
    expert = tl.zeros([], tl.int64)
    pair = tl.full([BM], -1, tl.int32)
    n0 = 0
    for _ in range(0, steps):
        ki = tl.where(ki == k_tiles - 1, 0, ki + 1)
        if ki == 0:  # the next item: its expert, its tokens, its first weight row
            item += progs
            blk = item // n_tiles
            expert = tl.load(block_expert_ptr + blk).to(tl.int64)
            pair = tl.load(pair_ptr + blk * BM + tok)  # -1 pads the block
            n0 = (item % n_tiles) * BN
        rmask = pair >= 0
        n64 = (n0 + tl.arange(0, BN)).to(tl.int64)
        w_base = w_ptr + (expert * stride_we + n0.to(tl.int64) * stride_wn) + w_off
        x_base = x_ptr + (tl.where(rmask, pair // TOPK, 0).to(tl.int64) * stride_xm)[None, :] + x_k[:, None]
        acc = _tile_dot(
            acc, w_base, s_ptr + expert * stride_se, stride_sn, n64, n64 < N, x_base, rmask[None, :], ki * BK, FMT, G,
            BN, BK, USE_ASM
        )  # fmt: skip
        if ki == k_tiles - 1:
            y = y_ptr + tl.where(rmask, pair, 0).to(tl.int64)[None, :] * stride_ym + n64[:, None]
            xs = _x_scales(xs_ptr, tl.where(rmask, pair // TOPK, 0), rmask, HAS_XS, BM)
            _store_tile(acc, y, (n64 < N)[:, None] & rmask[None, :], gs_ptr + expert, xs, FMT, HAS_XS)
            acc = tl.zeros([BN, BM], dtype=tl.float32)


@triton.jit
def _x_scales(xs_ptr, x_row, rmask, HAS_XS: tl.constexpr, BM: tl.constexpr):
    """[BM] per-token activation S_dec of the tile's x rows (ones without per-token scales)."""
    if HAS_XS:
        return tl.load(xs_ptr + x_row, mask=rmask, other=1.0)
    return tl.full([BM], 1.0, tl.float32)


@triton.jit
def _store_tile(acc, y, ymask, gs_ptr, xs, FMT: tl.constexpr, HAS_XS: tl.constexpr):
    """The Compute contract's epilogue on acc [BN, BM]: x's scale first, then w's, one rounding each."""
    if FMT == 0:
        if HAS_XS:
            acc = (acc * (xs * 128.0)[None, :]) * tl.load(gs_ptr)
        else:
            acc = acc * (tl.load(gs_ptr) * 128.0)
    elif HAS_XS:
        acc = acc * xs[None, :]
    tl.store(y, acc.to(y.dtype.element_ty), mask=ymask)


# Config per weight shape (BN, BK, num_warps, num_stages, SPLIT[, maxnreg[, programs per SM]]), chosen on the
# H200 by bench/bench_kernels.py --tune and bench/tune_qmatmul.py; a fixed table (never per M)
# keeps results batch-invariant and identical from one process to the next. num_warps <= BN / 16:
# each warp owns 16 or 32 weight rows (BN = 64 on two warps: two MMA row tiles per warp share
# each x fragment, half the x bytes through shared memory per weight).
# MoE launches already have one tile row per routed expert, so they default to no split; a
# seventh entry > 0 launches them persistent (`_moe_persistent_kernel`, that many programs per SM,
# no split). bench/tune_moe.py sweeps them.
# Values: `BENCH_ARGS="--tune --tune-quant" bash bench/run_device.sh` on the H200, 2026-11-29;
# 8192x8192 from `bench/tune_qmatmul.py` and `BENCH_ARGS=--tune`, same day; MoE from
# `bench/tune_moe.py` on the H100, 2026-12-05 (down: persistent, 8 programs per SM).
DEFAULT_CONFIG = (32, 256, 2, 2, 4)
CONFIGS: dict[tuple[int, int], tuple[int, ...]] = {
    (8192, 8192): (64, 128, 2, 2, 8, 128),
    (4096, 4096): (32, 256, 2, 2, 8),
    (1536, 2048): (32, 256, 2, 2, 8),
    (2048, 768): (32, 256, 2, 2, 4),
}
MOE_DEFAULT_CONFIG = (32, 256, 2, 3, 1)
MOE_CONFIGS: dict[tuple[int, int], tuple[int, ...]] = {
    (1536, 2048): (32, 256, 2, 3, 1),
    (2048, 768): (32, 256, 2, 3, 1, 0, 8),
}


def pick_config(n: int, k: int, fmt: int, group: int, moe: bool = False):
    """(BN, BK, num_warps, num_stages, SPLIT[, maxnreg[, programs per SM]]) for a weight shape (never per M)."""
    table, default = (MOE_CONFIGS, MOE_DEFAULT_CONFIG) if moe else (CONFIGS, DEFAULT_CONFIG)
    bn, bk, warps, stages, split, *rest = table.get((n, k), default)
    while bk > _min_bk(fmt) and k % bk:
        bk //= 2
    return (bn, bk, warps, stages, max(1, min(split, k // bk)), *rest)


def _min_bk(fmt: int) -> int:
    """The narrowest K tile: 64, but 128 for nvfp4. With 64-wide K tiles on 2 warps the nvfp4
    kernel gives wrong results under Triton 3.6 on the H200 (relative error ~1, plain and PTX
    dequant alike, old and new weight layout; int4 and 4 warps are fine; cause not found), so
    nvfp4 weights whose K is not a multiple of 128 take the reference path instead."""
    return 128 if fmt == FMT_NVFP4 else 64


def _check_config(config, fmt: int) -> None:
    if config[1] < _min_bk(fmt):
        raise ValueError(
            f"w4a16 config {config}: K tile {config[1]} is below {_min_bk(fmt)}, the narrowest this format allows"
        )
    if len(config) > 6 and config[6] and config[4] != 1:
        raise ValueError(f"w4a16 config {config}: a persistent MoE launch does not split K (SPLIT must be 1)")


def _launch_options(config) -> dict:
    """num_warps and num_stages of a config, and a register cap per thread where it has a sixth
    entry: Triton specializes M == 1, and that variant can take more registers than the one
    for other M (int4 (64, 128, 2, 2, 8): 150 against 128), which drops a program per SM and
    pushes a one-wave grid into two."""
    opts = {"num_warps": config[2], "num_stages": config[3]}
    if len(config) > 5 and config[5]:
        opts["maxnreg"] = config[5]
    return opts


_WORKSPACE: dict = {}


def _workspace(device, tiles: int, split: int, bn: int):
    """fp32 partial tiles and zeroed arrival counters for split-K, grown on demand, per device."""
    ws, locks = _WORKSPACE.get(device, (None, None))
    need = tiles * split * bn * BLOCK_M
    if ws is None or ws.numel() < need or locks.numel() < tiles:
        ws = torch.empty(max(need, 1), dtype=torch.float32, device=device)
        locks = torch.zeros(max(tiles, 1), dtype=torch.int32, device=device)
        _WORKSPACE[device] = (ws, locks)
    return ws, locks


def _scale_view(scales: torch.Tensor) -> torch.Tensor:
    """nvfp4 block scales travel as float8_e4m3fn; the kernel reads their bytes."""
    return scales.view(torch.uint8) if scales.dtype == torch.float8_e4m3fn else scales


def _xs(x_scale, dummy):
    """The per-row activation scales as the kernel reads them (fp32, contiguous), or a dummy pointer."""
    if x_scale is None:
        return dummy
    return x_scale.reshape(-1).to(torch.float32).contiguous()


def check_k(k: int, fmt: int, group: int) -> bool:
    """Shapes the kernel covers: K a multiple of 64 (nvfp4: 128); int4 groups a multiple of 16."""
    return k % _min_bk(fmt) == 0 and (fmt == FMT_NVFP4 or group % 16 == 0)


def w4a16_matmul(
    x, words, scales, global_scale, fmt: int, group: int, *, config=None, use_asm=True, out=None, x_scale=None
):
    """y [M, N] = x [M, K] @ W.T per the Compute contract; words int32 [N, K/8] (kernel layout, see
    `bitmath.repack`). x_scale: fp32 [M] per-row activation scales (nvfp4 S_dec_x), or None."""
    m, k = x.shape
    n = words.shape[0]
    config = config or pick_config(n, k, fmt, group)
    _check_config(config, fmt)
    bn, bk, warps, stages, split = config[:5]
    scales = _scale_view(scales)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    gs = global_scale if global_scale is not None else y  # unused for int4
    grid = (triton.cdiv(n, bn), triton.cdiv(m, BLOCK_M), split)
    ws, locks = _workspace(x.device, grid[0] * grid[1], split, bn)
    _w4a16_kernel[grid](
        x,
        words,
        scales,
        gs,
        y,
        m,
        n,
        k,
        x.stride(0),
        y.stride(0),
        words.stride(0),
        scales.stride(0),
        y,
        y,
        y,
        0,
        0,
        ws,
        locks,
        _xs(x_scale, y),
        FMT=fmt,
        G=group,
        MOE=False,
        HAS_XS=x_scale is not None,
        TOPK=1,
        BN=bn,
        BK=bk,
        BM=BLOCK_M,
        USE_ASM=use_asm,
        SPLIT=split,
        **_launch_options(config),
    )
    return y


@triton.jit
def _moe_align_kernel(
    ids_ptr,
    pairs_ptr,
    block_expert_ptr,
    num_blocks_ptr,
    P,
    E: tl.constexpr,
    EP: tl.constexpr,
    PB: tl.constexpr,
    MAXB: tl.constexpr,
    MAXBP: tl.constexpr,
    BM: tl.constexpr,
):
    """`moe_align` in one program: histogram, prefix sums, a stable sort of (expert, pair) keys,
    and the scatter into 16-row blocks. EP > E, PB >= P, MAXBP >= MAXB are powers of two."""
    p = tl.arange(0, PB)
    e = tl.load(ids_ptr + p, mask=p < P, other=E).to(tl.int32)  # padding sorts last, bin E
    eb = tl.arange(0, EP)
    counts = tl.where(eb < E, tl.histogram(e, EP), 0)
    blocks_per = (counts + BM - 1) // BM
    block_end = tl.cumsum(blocks_per, 0)
    block_start = block_end - blocks_per
    first = tl.cumsum(counts, 0) - counts
    key = tl.sort(e * PB + p)  # stable by construction: ties broken by pair index
    se = key // PB
    i = tl.arange(0, PB)
    slot = tl.gather(block_start, se, 0) * BM + (i - tl.gather(first, se, 0))
    every = tl.arange(0, MAXBP * BM)
    tl.store(pairs_ptr + every, tl.full([MAXBP * BM], -1, tl.int32), mask=every < MAXB * BM)
    tl.debug_barrier()
    tl.store(pairs_ptr + slot, key % PB, mask=i < P)
    b = tl.arange(0, MAXBP)
    be = tl.sum((block_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
    tl.store(block_expert_ptr + b, tl.minimum(be, E - 1), mask=b < MAXB)
    tl.store(num_blocks_ptr, tl.sum(blocks_per, 0))


def moe_align_fast(topk_ids: torch.Tensor, num_experts: int):
    """Same result as `moe_align`, from one small Triton program (decode sizes), else torch."""
    p = topk_ids.numel()
    max_blocks = min(p, num_experts) + p // BLOCK_M
    pb = triton.next_power_of_2(max(p, 16))
    maxbp = triton.next_power_of_2(max(max_blocks, 16))
    ep = triton.next_power_of_2(num_experts + 1)
    if pb > 2048 or maxbp * ep > 65536:
        return moe_align(topk_ids, num_experts)
    dev = topk_ids.device
    pairs = torch.empty(max_blocks * BLOCK_M, dtype=torch.int32, device=dev)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    _moe_align_kernel[(1,)](
        topk_ids.reshape(-1).contiguous(),
        pairs,
        block_expert,
        num_blocks,
        p,
        E=num_experts,
        EP=ep,
        PB=pb,
        MAXB=max_blocks,
        MAXBP=maxbp,
        BM=BLOCK_M,
        num_warps=8,
    )
    return pairs, block_expert, num_blocks, max_blocks


def moe_w4a16_matmul(
    x,
    codes,
    scales,
    global_scale,
    topk_ids,
    fmt: int,
    group: int,
    *,
    config=None,
    use_asm=True,
    align=None,
    x_scale=None,
):
    """y [T, topk, N]: token t times the weights of each of its routed experts.

    words int32 [E, N, K/8] (kernel layout), scales [E, N, K/16 or K/G], global_scale fp32 [E] (nvfp4);
    x_scale: fp32 [T] per-row activation scales of x (nvfp4 S_dec_x), or None."""
    t, k = x.shape
    e, n, _ = codes.shape
    topk = topk_ids.shape[1]
    pairs, block_expert, num_blocks, max_blocks = align or moe_align_fast(topk_ids, e)
    config = config or pick_config(n, k, fmt, group, moe=True)
    _check_config(config, fmt)
    bn, bk, warps, stages, split = config[:5]
    scales = _scale_view(scales)
    y = torch.empty(t * topk, n, dtype=x.dtype, device=x.device)
    gs = global_scale if global_scale is not None else y
    if len(config) > 6 and config[6]:
        return _moe_persistent(
            x,
            codes,
            scales,
            gs,
            y,
            topk,
            (pairs, block_expert, num_blocks, max_blocks),
            fmt,
            group,
            config,
            use_asm,
            x_scale,
        ).view(t, topk, n)
    grid = (triton.cdiv(n, bn), max_blocks, split)
    ws, locks = _workspace(x.device, grid[0] * grid[1], split, bn)
    _w4a16_kernel[grid](
        x,
        codes,
        scales,
        gs,
        y,
        t * topk,
        n,
        k,
        x.stride(0),
        y.stride(0),
        codes.stride(1),
        scales.stride(1),
        pairs,
        block_expert,
        num_blocks,
        codes.stride(0),
        scales.stride(0),
        ws,
        locks,
        _xs(x_scale, y),
        FMT=fmt,
        G=group,
        MOE=True,
        HAS_XS=x_scale is not None,
        TOPK=topk,
        BN=bn,
        BK=bk,
        BM=BLOCK_M,
        USE_ASM=use_asm,
        SPLIT=split,
        **_launch_options(config),
    )
    return y.view(t, topk, n)


def _moe_persistent(x, codes, scales, gs, y, topk, align, fmt, group, config, use_asm, x_scale):
    """`_moe_persistent_kernel` on config[6] programs per SM (never more than the launch's items)."""
    pairs, block_expert, num_blocks, max_blocks = align
    n, k = codes.shape[1], x.shape[1]
    bn, bk = config[:2]
    programs = min(config[6] * _sm_count(x.device), triton.cdiv(n, bn) * max_blocks)
    _moe_persistent_kernel[(programs,)](
        x,
        codes,
        scales,
        gs,
        y,
        n,
        k,
        x.stride(0),
        y.stride(0),
        codes.stride(1),
        scales.stride(1),
        pairs,
        block_expert,
        num_blocks,
        codes.stride(0),
        scales.stride(0),
        _xs(x_scale, y),
        FMT=fmt,
        G=group,
        HAS_XS=x_scale is not None,
        TOPK=topk,
        BN=bn,
        BK=bk,
        BM=BLOCK_M,
        USE_ASM=use_asm,
        **_launch_options(config),
    )
    return y
