"""Triton quantization kernels that reproduce `policy.formats` byte for byte on CUDA.

One kernel per format (nvfp4, mxfp8, int4, fp8_block) plus a tensor-wide amax reduction for nvfp4's
tensor scope, and the weight operands of nvfp4 and int4 (`nvfp4_operand`, `int4_operand`: the bf16
values the QAT forward multiplies, one pass instead of the reference's chain of torch ops). The
order of operations is DESIGN.md's contract, literally (one proven shortcut: int4 on 16-bit inputs,
`_int4_codes`); what makes the bytes equal to the CPU reference is the lowering:
- inputs are read as raw bits; absolute values, block maxima and sign tests run on integer bits, so
  no flush-to-zero can change them;
- every fp32 multiply, fma and divide that feeds a stored byte is inline PTX `mul.rn.f32` /
  `fma.rn.f32` / `div.rn.f32` / `rcp.rn.f32` without `.ftz` (never `tl.math.div_rn`: libdevice
  flushes subnormals);
- fp32 -> E4M3 is `cvt.rn.satfinite.e4m3x2.f32` (sm_89+), after the reference's clamps; fp32 ->
  bf16 is `cvt.rn.bf16.f32`; rint is `cvt.rni.f32.f32`; E2M1 rounding is one fp32 add with a magic
  constant (`policy.kernels.bitmath.e2m1_code`).
Every kernel flags a status word when a block max is not finite (ValueError without a second pass).
nvfp4 and int4 also take a group of same-shape tensors, each its own allocation (an MoE projection's
expert masters), through a table of their addresses: one launch over all, no stacked copy first.
Simplified: one program handles ROWS rows by CHUNK blocks; no persistent grid, no TMA."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from policy.fields import is_int

from .bitmath import CODE_BIAS, INT4_SNAP

SNAP = tl.constexpr(INT4_SNAP)

# Constants as exact fp32 values (each is the fp32 the reference's fp32(...) rounds to).
FLT_MAX = tl.constexpr(3.4028234663852886e38)
ONE_SIXTH = tl.constexpr(0.1666666716337204)  # fp32(1/6)
ONE_OVER_448 = tl.constexpr(0.0022321429569274187)  # fp32(1/448)
ONE_OVER_7 = tl.constexpr(0.1428571492433548)  # fp32(1/7)
INT4_SCALE_FLOOR = tl.constexpr(9.999999747378752e-06)  # fp32(1e-5)
# CODE_BIAS in each of the eight nibbles of a code word, as a wrapped int32.
WORD_BIAS = tl.constexpr((CODE_BIAS * 0x11111111 + 2**31) % 2**32 - 2**31)
NONFINITE_BITS = 0x7F800000  # |bits| >= this: inf or NaN
NONFINITE = tl.constexpr(NONFINITE_BITS)

_IN_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


# --------------------------------------------------------------------------- fp32 primitives


@triton.jit
def _mul_rn(a, b):
    """IEEE fp32 a * b, round to nearest even, subnormals kept, never fused."""
    return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _div_rn(a, b):
    """IEEE fp32 a / b, correctly rounded, subnormals kept."""
    return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _rint(a):
    """Round to the nearest integer, ties to even (fp32 -> fp32)."""
    return tl.inline_asm_elementwise("cvt.rni.f32.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _as_f32(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _load_bits(x_ptr, offs, mask, IN_KIND: tl.constexpr):
    """fp32 bit patterns (int32) of the input elements at `offs`; masked lanes read +0."""
    if IN_KIND == 0:  # bf16 passed as int16: the fp32 pattern is the 16 bits shifted up
        v = tl.load(x_ptr + offs, mask=mask, other=0)
        bits = v.to(tl.int32) << 16
    elif IN_KIND == 1:  # fp16: every fp16 value is a normal fp32, the convert is exact
        v = tl.load(x_ptr + offs, mask=mask, other=0.0)
        bits = v.to(tl.float32).to(tl.int32, bitcast=True)
    else:  # fp32 passed as int32
        bits = tl.load(x_ptr + offs, mask=mask, other=0)
    return bits


@triton.jit
def _e4m3(v, SW: tl.constexpr):
    """fp32 (already clamped to [-448, 448]) -> E4M3 byte (uint8), round to nearest even.

    SW=False: Triton's conversion (hardware cvt on sm_89+). SW=True: the same rounding done on
    the bits (subnormal range by a magic add with ulp 2^-9, normal range by the usual
    add-half-ulp-and-truncate); kept as a cross-check and a fallback.
    """
    if SW:
        bits = v.to(tl.int32, bitcast=True)
        a = bits & 0x7FFFFFFF
        sign = (bits >> 24) & 0x80
        sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        norm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
        code = tl.where(a < 0x3C800000, sub, norm) | sign
        return code.to(tl.uint8)
    else:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _e4m3_value(byte):
    """E4M3 byte -> fp32 value (exact)."""
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_code_biased(a, x_bits):
    """E2M1 code + CODE_BIAS of a = min(|x| * enc, 6), sign from x's bits; see
    policy.kernels.bitmath.e2m1_code. The bias is a constant the caller removes once per packed
    word, which saves one add per element."""
    e = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) >> 23  # 127, 128 or 129
    m_bits = (e << 23) + (22 << 23)
    raw = (a + m_bits.to(tl.float32, bitcast=True)).to(tl.int32, bitcast=True) + e * (2 - (1 << 23))
    negative = x_bits.to(tl.uint32, bitcast=True) > 0x80000000
    return tl.where(negative, raw + 8, raw)


# --------------------------------------------------------------------------- nvfp4


@triton.jit
def _tensor_base(x_ptr, table_ptr, g, TABLE: tl.constexpr, ELEM_BYTES: tl.constexpr):
    """Pointer to tensor g of a group: x_ptr + table[g] bytes (TABLE: each tensor its own allocation,
    16-byte aligned), else x_ptr (one tensor, g = 0)."""
    if TABLE:
        return x_ptr + tl.multiple_of(tl.load(table_ptr + g) // ELEM_BYTES, 16 // ELEM_BYTES)
    return x_ptr


@triton.jit
def _rows_at(x_ptr, table_ptr, r64, first_row, group_rows, TABLE: tl.constexpr):
    """(pointer, row index from it) of rows r64 of the input (int32 words). TABLE: rows of the tensor
    holding first_row (rows first_row ... stay in it), from that tensor's own pointer."""
    if TABLE:
        g = first_row // group_rows
        return _tensor_base(x_ptr, table_ptr, g, TABLE, 4), r64 - g * group_rows
    return x_ptr, r64


@triton.jit
def _amax_bits_kernel(
    x_ptr, table_ptr, status_ptr, numel, IN_KIND: tl.constexpr, BLOCK: tl.constexpr, TABLE: tl.constexpr
):
    """status[g] = max(status[g], max |bits| of tensor g): the amax of each tensor of a group of
    `numel` elements each (g = program_id(1); one tensor: the tensor amax). Non-finite shows as
    >= 0x7F800000.

    A grid of a few programs per SM strides over the tensor, so only a few hundred atomics hit
    the one status word (same-address atomics serialize in L2)."""
    g = tl.program_id(1)
    xp = _tensor_base(x_ptr, table_ptr, g, TABLE, 4 if IN_KIND == 2 else 2)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, numel, step):
        offs = first + start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, _load_bits(xp, offs, offs < numel, IN_KIND) & 0x7FFFFFFF)
    tl.atomic_max(status_ptr + g, tl.max(acc, axis=0))


@triton.jit
def _flag_nonfinite(status_ptr, max_bits):
    """Mark the status word only when something non-finite was read: a store that normally never
    happens (from each thread that saw one, so no reduction across the program is needed),
    instead of an atomic per program on one address."""
    tl.store(status_ptr + max_bits * 0, NONFINITE, mask=max_bits >= NONFINITE)


@triton.jit
def _load_pairs(x_ptr, first, mask, N: tl.constexpr, IN_KIND: tl.constexpr):
    """fp32 bit patterns (int32) of elements 2p and 2p + 1 for the N pairs p = first ... first + N - 1
    of each [R, C, 1] entry of `first` -> (even, odd), each [R, C, N]; masked: +0.

    x_ptr is the input's int32 view: a bf16 or fp16 pair is one word, an fp32 pair two. Either way
    a thread reads consecutive words, so its loads are 16-byte vectors (bf16: 8 elements kept
    packed until they are used)."""
    if IN_KIND == 2:  # fp32: 2N consecutive words, split into even and odd elements
        w = tl.load(x_ptr + (2 * first + tl.arange(0, 2 * N)[None, None, :]), mask=mask, other=0)
        even, odd = tl.split(tl.reshape(w, [w.shape[0], w.shape[1], N, 2]))
    else:
        w = tl.load(x_ptr + (first + tl.arange(0, N)[None, None, :]), mask=mask, other=0)
        if IN_KIND == 0:  # bf16 -> fp32 is a 16-bit shift
            even = w << 16
            odd = w & -65536
        else:  # fp16: every fp16 value is a normal fp32, the convert is exact
            even = (w & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
            odd = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32).to(tl.int32, bitcast=True)
    return even, odd


@triton.jit
def _mul_abs_rn(x_bits, b):
    """|x| * b for x given as fp32 bits: IEEE, round to nearest even, subnormals kept (the abs
    is an operand modifier of the multiply, no separate instruction)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 t; abs.f32 t, $1; mul.rn.f32 $0, t, $2; }",
        "=f,f,f",
        [_as_f32(x_bits), b],
        dtype=tl.float32,
        is_pure=True,
        pack=1,
    )


@triton.jit
def _nvfp4_codes(x_bits, enc):
    """E2M1 code + CODE_BIAS of x given as fp32 bits: e2m1(min(|x| * enc, 6)), sign of x < 0."""
    return _e2m1_code_biased(tl.minimum(_mul_abs_rn(x_bits, enc), 6.0), x_bits)


@triton.jit
def _nvfp4_kernel(
    x_ptr,
    table_ptr,
    codes_ptr,
    sf_ptr,
    gs_ptr,
    amax_ptr,
    status_ptr,
    M,
    K,
    x_row_words,
    code_row_words,
    group_rows,
    IN_KIND: tl.constexpr,
    ROW_SCOPE: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    SINGLE: tl.constexpr,
    E4M3_SW: tl.constexpr,
    TABLE: tl.constexpr,
):
    """ROWS rows per program; CHUNK 16-element blocks per step along K. SINGLE: the program's
    blocks are one chunk, loaded before anything else (so the loads overlap the scale math).

    One thread owns whole 16-blocks: the block is read as two [.., 4] tensors of element
    pairs (elements 0-7 and 8-15) with the same layout, so the block max, the E4M3 scale and
    its reciprocal are computed once per block in one thread, with no shuffles.
    Row scope: one program owns whole rows (the row amax needs all of it first). Tensor scope:
    the amax is already known, so the grid also splits K (program_id(1) = chunk), and it walks
    the tensor from the end: the amax pass read the end last, so the first programs find it
    in L2. A group of tensors (M = their rows, `group_rows` each): row r belongs to tensor
    r // group_rows, whose amax is amax_ptr[r // group_rows] and whose global scale goes to
    gs_ptr[r // group_rows] in tensor scope (one tensor: group_rows = M). TABLE: the tensors are
    read where they are (`_tensor_base`), so a program's rows never straddle two of them
    (ROWS divides group_rows); outputs are one flat [M, ...] tensor either way."""
    pid = tl.program_id(0)
    pid_c = tl.program_id(1)
    if not ROW_SCOPE:
        pid = tl.num_programs(0) - 1 - pid
        pid_c = tl.num_programs(1) - 1 - pid_c
    c_first = 0 if ROW_SCOPE else pid_c * CHUNK
    r = pid * ROWS + tl.arange(0, ROWS)
    rmask = r < M
    r64 = r.to(tl.int64)
    nblocks = K // 16
    b = tl.arange(0, CHUNK)
    xp, xr = _rows_at(x_ptr, table_ptr, r64, pid * ROWS, group_rows, TABLE)
    # Row strides in words are arguments (x: K/2 pairs, codes: K/8 words) so that the launcher's
    # divisible-by-16 specialization shows the pair loads are 16-byte aligned and vectorizes them.
    row_pairs = xr[:, None, None] * x_row_words  # the row's first pair in xp

    if SINGLE:
        blk0 = c_first + b
        m3 = rmask[:, None, None] & (blk0 < nblocks)[None, :, None]
        lo_e0, lo_o0 = _load_pairs(xp, row_pairs + blk0[None, :, None] * 8, m3, 4, IN_KIND)
        hi_e0, hi_o0 = _load_pairs(xp, row_pairs + blk0[None, :, None] * 8 + 4, m3, 4, IN_KIND)
        bmax0 = _block_absmax(lo_e0, lo_o0, hi_e0, hi_o0)  # [ROWS, CHUNK]

    if ROW_SCOPE:
        if SINGLE:
            amax_bits = tl.max(bmax0, axis=1)
        else:
            amax_bits = tl.zeros([ROWS], dtype=tl.int32)
            for c in range(0, nblocks, CHUNK):
                blk = c + b
                m3 = rmask[:, None, None] & (blk < nblocks)[None, :, None]
                a0, a1 = _load_pairs(xp, row_pairs + blk[None, :, None] * 8, m3, 4, IN_KIND)
                a2, a3 = _load_pairs(xp, row_pairs + blk[None, :, None] * 8 + 4, m3, 4, IN_KIND)
                amax_bits = tl.maximum(amax_bits, tl.max(_block_absmax(a0, a1, a2, a3), axis=1))
        _flag_nonfinite(status_ptr, amax_bits)
    else:
        amax_bits = tl.load(amax_ptr + r // group_rows, mask=rmask, other=0)  # the row's tensor amax

    amax = _as_f32(amax_bits)
    s_enc = tl.minimum(_div_rn(tl.full([ROWS], 2688.0, tl.float32), amax), FLT_MAX)
    s_enc = tl.where(amax_bits == 0, 1.0, s_enc)
    s_dec = _div_rn(tl.full([ROWS], 1.0, tl.float32), s_enc)
    kk = _mul_rn(s_enc, tl.full([ROWS], ONE_SIXTH, tl.float32))
    if ROW_SCOPE:
        tl.store(gs_ptr + r, s_dec, mask=rmask)
        c_start = 0
        c_end = nblocks
    else:
        tl.store(gs_ptr + r // group_rows, s_dec, mask=rmask & (r % group_rows == 0) & (pid_c == 0))
        c_start = c_first
        c_end = c_start + CHUNK

    shift = (8 * tl.arange(0, 4))[None, None, :]
    for c in range(c_start, c_end, CHUNK):
        blk = c + b
        bmask = rmask[:, None] & (blk < nblocks)[None, :]
        if SINGLE:
            lo_e, lo_o, hi_e, hi_o, bmax = lo_e0, lo_o0, hi_e0, hi_o0, bmax0
        else:
            m3 = bmask[:, :, None]
            lo_e, lo_o = _load_pairs(xp, row_pairs + blk[None, :, None] * 8, m3, 4, IN_KIND)
            hi_e, hi_o = _load_pairs(xp, row_pairs + blk[None, :, None] * 8 + 4, m3, 4, IN_KIND)
            bmax = _block_absmax(lo_e, lo_o, hi_e, hi_o)
        t = tl.minimum(_mul_rn(_as_f32(bmax), tl.broadcast_to(kk[:, None], [ROWS, CHUNK])), 448.0)
        sf8 = _e4m3(t, E4M3_SW)
        block_scale = _mul_rn(_e4m3_value(sf8), tl.broadcast_to(s_dec[:, None], [ROWS, CHUNK]))
        enc = tl.minimum(_div_rn(tl.full([ROWS, CHUNK], 1.0, tl.float32), block_scale), FLT_MAX)[:, :, None]
        # Byte j of a code word = elements 2j (low nibble) and 2j + 1 (high nibble); the biases
        # of its eight codes come off in one subtraction (int32 arithmetic wraps).
        w0 = tl.sum((_nvfp4_codes(lo_e, enc) + (_nvfp4_codes(lo_o, enc) << 4)) << shift, axis=2) - WORD_BIAS
        w1 = tl.sum((_nvfp4_codes(hi_e, enc) + (_nvfp4_codes(hi_o, enc) << 4)) << shift, axis=2) - WORD_BIAS
        words = tl.join(w0, w1)  # [ROWS, CHUNK, 2]: the block's 8 code bytes, one 8-byte store
        h = tl.arange(0, 2)
        woffs = r64[:, None, None] * code_row_words + (blk[None, :, None] * 2 + h[None, None, :])
        tl.store(codes_ptr + woffs, words, mask=bmask[:, :, None])
        tl.store(sf_ptr + r64[:, None] * nblocks + blk[None, :], sf8, mask=bmask)


@triton.jit
def _block_absmax(a, b, c, d):
    """max |bits| over the last axis of four [.., 4] tensors of fp32 bit patterns."""
    m = tl.maximum(tl.maximum(a & 0x7FFFFFFF, b & 0x7FFFFFFF), tl.maximum(c & 0x7FFFFFFF, d & 0x7FFFFFFF))
    return tl.max(m, axis=2)


# --------------------------------------------------------------------------- mxfp8


@triton.jit
def _mxfp8_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    status_ptr,
    M,
    K,
    IN_KIND: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    E4M3_SW: tl.constexpr,
):
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * ROWS + tl.arange(0, ROWS)
    r64 = r.to(tl.int64)
    nblocks = K // 32
    blk = pid_c * CHUNK + tl.arange(0, CHUNK)
    e32 = tl.arange(0, 32)
    bmask = (r < M)[:, None] & (blk < nblocks)[None, :]
    offs = r64[:, None, None] * K + (blk[None, :, None] * 32 + e32[None, None, :])
    bits = _load_bits(x_ptr, offs, bmask[:, :, None], IN_KIND)
    bmax = tl.max(bits & 0x7FFFFFFF, axis=2)
    _flag_nonfinite(status_ptr, bmax)

    d = _mul_rn(_as_f32(bmax), tl.full([ROWS, CHUNK], ONE_OVER_448, tl.float32))
    d_bits = d.to(tl.int32, bitcast=True)
    ex = (d_bits >> 23) & 0xFF
    mant = d_bits & 0x7FFFFF
    up = (mant != 0) & (ex != 254) & ((ex != 0) | (mant > 0x400000))
    ex = ex + up.to(tl.int32)
    n = 127 - ex
    inv_bits = tl.where(n >= -126, (n + 127) << 23, 1 << 22)  # 2^n, 2^-127 is subnormal
    v = _mul_rn(_as_f32(bits), tl.broadcast_to(_as_f32(inv_bits)[:, :, None], [ROWS, CHUNK, 32]))
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(codes_ptr + offs, _e4m3(v, E4M3_SW), mask=bmask[:, :, None])
    tl.store(scales_ptr + r64[:, None] * nblocks + blk[None, :], ex.to(tl.uint8), mask=bmask)


# --------------------------------------------------------------------------- int4


@triton.jit
def _rcp_rn(a):
    """IEEE fp32 1 / a, correctly rounded, subnormals kept."""
    return tl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [a], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _fma_rn(a, b, c):
    """IEEE fp32 a * b + c with one rounding (to nearest even), subnormals kept."""
    return tl.inline_asm_elementwise(
        "fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [a, b, c], dtype=tl.float32, is_pure=True, pack=1
    )


@triton.jit
def _int4_codes(x_bits, s, r, IN_KIND: tl.constexpr):
    """rint(x / s) as int32, x given as fp32 bits, s the group's bf16 scale as fp32, r = rcp_rn(s);
    16-bit inputs give it plus INT4_SNAP (a multiple of 256: the int8 code bytes are the same).

    fp32 input: the contract's division, literally. 16-bit input: rint(fma(x, r, 1536)), one
    fused multiply-add instead of a division per element; policy.kernels.bitmath.int4_codes_16bit
    says why it is the same integer, and a unit test checks it exhaustively.
    The contract's clamp to [-7, 7] never binds: |x| <= gmax and s >= gmax / 7 rounded down by
    at most 2^-9 (bf16), so |x / s| <= 7.02 and rint is at most 7 in magnitude."""
    if IN_KIND == 2:
        q = _div_rn(_as_f32(x_bits), s)
    else:
        q = _fma_rn(_as_f32(x_bits), r, tl.full(r.shape, SNAP, tl.float32))
    return _rint(q).to(tl.int32)


@triton.jit
def _int4_kernel(
    x_ptr,
    table_ptr,
    codes_ptr,
    scales_ptr,
    status_ptr,
    M,
    K,
    x_row_words,
    group_rows,
    IN_KIND: tl.constexpr,
    G: tl.constexpr,
    ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    TABLE: tl.constexpr,
):
    """CHUNK groups of ROWS rows per program; a group is read as G/2 element pairs (16-bit
    inputs: one word each) and its codes are written as G/2 int16 words (two int8 codes).
    TABLE: the rows of a group of tensors read where they are, as `_nvfp4_kernel`."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = pid_r * ROWS + tl.arange(0, ROWS)
    r64 = r.to(tl.int64)
    ngroups = K // G
    grp = pid_c * CHUNK + tl.arange(0, CHUNK)
    gmask = (r < M)[:, None] & (grp < ngroups)[None, :]
    xp, xr = _rows_at(x_ptr, table_ptr, r64, pid_r * ROWS, group_rows, TABLE)
    first = (xr[:, None] * x_row_words + grp[None, :] * (G // 2))[:, :, None]
    even, odd = _load_pairs(xp, first, gmask[:, :, None], G // 2, IN_KIND)
    gmax = tl.max(tl.maximum(even & 0x7FFFFFFF, odd & 0x7FFFFFFF), axis=2)
    _flag_nonfinite(status_ptr, gmax)

    s = tl.maximum(_mul_rn(_as_f32(gmax), tl.full([ROWS, CHUNK], ONE_OVER_7, tl.float32)), INT4_SCALE_FLOOR)
    s16 = s.to(tl.bfloat16)
    sf = s16.to(tl.float32)
    sf3 = sf[:, :, None]
    r3 = _rcp_rn(sf)[:, :, None]
    q = (_int4_codes(even, sf3, r3, IN_KIND) & 0xFF) | (_int4_codes(odd, sf3, r3, IN_KIND) << 8)
    # codes_ptr is the int16 view of the int8 codes: word p = elements 2p (low byte), 2p + 1.
    pairs = (r64[:, None] * x_row_words + grp[None, :] * (G // 2))[:, :, None] + tl.arange(0, G // 2)[None, None, :]
    tl.store(codes_ptr + pairs, q.to(tl.int16), mask=gmask[:, :, None])
    tl.store(scales_ptr + r64[:, None] * ngroups + grp[None, :], s16, mask=gmask)


# --------------------------------------------------------------------------- fp8_block


@triton.jit
def _fp8_block_kernel(
    x_ptr,
    codes_ptr,
    sinv_ptr,
    status_ptr,
    M,
    K,
    IN_KIND: tl.constexpr,
    GR: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    E4M3_SW: tl.constexpr,
):
    """GR blocks of (BM x BK), stacked along rows, per program: S = min(448 / amax, FLT_MAX),
    code = e4m3(clamp(x * S)), scale_inv = 1 / S. (1 x 128 tiles: GR rows per program.)"""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    g = pid_r * GR + tl.arange(0, GR)  # row-block index
    r = g[:, None] * BM + tl.arange(0, BM)[None, :]  # [GR, BM]
    r64 = r.to(tl.int64)
    k = pid_c * BK + tl.arange(0, BK)
    mask = (r < M)[:, :, None] & (k < K)[None, None, :]
    offs = r64[:, :, None] * K + k[None, None, :]
    bits = _load_bits(x_ptr, offs, mask, IN_KIND)
    amax_bits = tl.max(tl.max(bits & 0x7FFFFFFF, axis=2), axis=1)  # [GR]
    _flag_nonfinite(status_ptr, amax_bits)
    s = tl.minimum(_div_rn(tl.full([GR], 448.0, tl.float32), _as_f32(amax_bits)), FLT_MAX)
    s = tl.where(amax_bits == 0, 1.0, s)
    v = _mul_rn(_as_f32(bits), tl.broadcast_to(s[:, None, None], [GR, BM, BK]))
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(codes_ptr + offs, _e4m3(v, E4M3_SW), mask=mask)
    sinv = _div_rn(tl.full([GR], 1.0, tl.float32), s)
    nrb = (M + BM - 1) // BM
    tl.store(sinv_ptr + g.to(tl.int64) * (K // BK) + pid_c, sinv, mask=g < nrb)


# --------------------------------------------------------------------------- operands
# The Compute contract's weight operands (`policy.formats.<fmt>.operand`'s values) in one pass:
# codes and scales in, bf16 out. Every product is exact in fp32 (nvfp4: e2m1 x sf has at most 6
# significant bits; int4: q x s at most 11), so the one rounding is the store's cast to bf16 (exact
# for nvfp4), as in the reference: equal bytes whatever the order of operations.


@triton.jit
def e2m1_f32(c):
    """fp32 value of E2M1 codes 0..15 (int32): the e1 e0 m bits as fp16 exponent/mantissa bits
    11..9 and the sign as bit 15 give value * 2^-14 (exact), as `nvfp4.e2m1_value`. (Also the
    decode matmul's plain-op cross-check, rollout.kernels.matmul_triton.)"""
    h = ((c & 7) << 9) | ((c & 8) << 12)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def _nvfp4_operand_kernel(codes_ptr, sf_ptr, out_ptr, n_bytes, BLOCK: tl.constexpr):
    """BLOCK code bytes per program (byte p = elements 2p, 2p + 1 of the flat tensor, both in
    16-block p // 8: K / 2 bytes per row is a multiple of 8, so the flat index works across rows)."""
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = p < n_bytes
    c = tl.load(codes_ptr + p, mask=mask, other=0).to(tl.int32)
    sf = tl.load(sf_ptr + p // 8, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v = tl.join(e2m1_f32(c & 0xF) * sf, e2m1_f32(c >> 4) * sf).to(tl.bfloat16)  # [BLOCK, 2]
    e = 2 * p[:, None] + tl.arange(0, 2)[None, :]
    tl.store(out_ptr + e, v, mask=mask[:, None])


@triton.jit
def _int4_operand_kernel(codes_ptr, scales_ptr, out_ptr, numel, G: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK elements per program; element e's scale is group e // G (K is a multiple of G)."""
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < numel
    q = tl.load(codes_ptr + e, mask=mask, other=0).to(tl.float32)
    s = tl.load(scales_ptr + e // G, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + e, (q * s).to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=mask)


# --------------------------------------------------------------------------- launchers


def _bits_view(x: torch.Tensor) -> torch.Tensor:
    """The input as the pointer type the kernels read (bf16 -> int16, fp32 -> int32)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16)
    if x.dtype == torch.float32:
        return x.view(torch.int32)
    return x


def _status(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _group(x):
    """(x0, table, M, K, group_rows) of a quantizer's input x: an [M, K] tensor (x0 = x, table None,
    group_rows = M), or a list of same-shape [M / len, K] contiguous tensors, each 16-byte aligned
    (the caller checks), read where they are: x0 = the first, table = int64 byte offsets of each
    from it, on the device."""
    if isinstance(x, torch.Tensor):
        return x, None, x.shape[0], x.shape[1], x.shape[0]
    x0 = x[0]
    table = _offsets_table(tuple(t.data_ptr() - x0.data_ptr() for t in x), x0.device)
    return x0, table, len(x) * x0.shape[0], x0.shape[1], x0.shape[0]


@functools.lru_cache(maxsize=256)
def _offsets_table(offsets: tuple[int, ...], device) -> torch.Tensor:
    """The offsets on the device, made once per set of addresses (a parameter group's stay put
    from step to step), so a refill copies nothing from the host (and can run in a CUDA graph)."""
    return torch.tensor(offsets, dtype=torch.int64, device=device)


def _rows_dividing(rows: int, group_rows: int) -> int:
    """The largest power of two <= rows that divides group_rows (a program stays in one tensor)."""
    return min(rows, group_rows & -group_rows)


def nvfp4_quantize(x, scope: str, e4m3_sw: bool = False, config=None):
    """-> (codes uint8 [M, K/2], block_scales fp8 [M, K/16], global_scale fp32, status int32 [1]).

    x: an [M, K] tensor, or a list of same-shape tensors (`_group`) quantized in one launch as the
    rows of their stack, each its own tensor in tensor scope (its own amax and global scale:
    global_scale is [len(x)])."""
    x, table, m, k, group_rows = _group(x)
    groups = m // group_rows
    nblocks = k // 16
    codes = torch.empty(m, k // 2, dtype=torch.uint8, device=x.device)
    sf = torch.empty(m, nblocks, dtype=torch.float8_e4m3fn, device=x.device)
    gs = torch.empty(m if scope == "row" else groups, dtype=torch.float32, device=x.device)
    status = _status(x.device)
    amax = status if groups == 1 or scope == "row" else torch.zeros(groups, dtype=torch.int32, device=x.device)
    kind = _IN_KIND[x.dtype]
    tab = x if table is None else table  # a placeholder pointer where there is no table
    if scope == "tensor":
        block = 4096
        per_group = group_rows * k
        grid = min(triton.cdiv(per_group, block), max(1, 4 * _sm_count(x.device) // groups))
        _amax_bits_kernel[(grid, groups)](
            _bits_view(x), tab, amax, per_group, IN_KIND=kind, BLOCK=block, TABLE=table is not None, num_warps=8
        )
    chunk, rows, single, warps = config or _nvfp4_config(m, nblocks, scope)
    if table is not None:
        rows = _rows_dividing(rows, group_rows)
    grid = (triton.cdiv(m, rows), 1 if scope == "row" else triton.cdiv(nblocks, chunk))
    _nvfp4_kernel[grid](  # x as int32 words: element pairs for 16-bit inputs, elements for fp32
        x.view(torch.int32),
        tab,
        codes.view(torch.int32),
        sf.view(torch.uint8),
        gs,
        amax,
        status,
        m,
        k,
        k // 2,
        k // 8,
        group_rows,
        IN_KIND=kind,
        ROW_SCOPE=scope == "row",
        ROWS=rows,
        CHUNK=chunk,
        SINGLE=single,
        E4M3_SW=e4m3_sw,
        TABLE=table is not None,
        num_warps=warps,
    )
    if amax is not status:  # non-finite input shows in some tensor's amax
        status = torch.maximum(status, amax.amax().view(1))
    return codes, sf, gs, status


def _nvfp4_config(m: int, nblocks: int, scope: str):
    """(CHUNK, ROWS, SINGLE, num_warps). One thread per 16-block, so a program should hold at
    least as many blocks as it has threads."""
    if scope == "tensor":  # always SINGLE: the grid splits K into chunks
        chunk = min(_pow2_at_least(nblocks), 256)
        return chunk, max(1, 256 // chunk), True, 4
    # Rows up to K = 8192: the whole row in registers (one HBM read), several rows per program
    # when they are short. Longer rows: two passes over K in chunks, the second read from L2.
    if nblocks <= 128:
        chunk = _pow2_at_least(nblocks)
        return chunk, max(1, 128 // chunk), True, 4
    if nblocks <= 512:
        return _pow2_at_least(nblocks), 1, True, 4
    return 256, 1, False, 8


@functools.cache
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def mxfp8_quantize(x: torch.Tensor, e4m3_sw: bool = False, config=None):
    """config: (elements per program, num_warps)."""
    m, k = x.shape
    nblocks = k // 32
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(m, nblocks, dtype=torch.uint8, device=x.device)
    status = _status(x.device)
    per_prog, warps = config or (2048, 4)
    chunk = min(_pow2_at_least(nblocks), per_prog // 32)
    rows = max(1, per_prog // 32 // chunk)
    grid = (triton.cdiv(m, rows), triton.cdiv(nblocks, chunk))
    _mxfp8_kernel[grid](
        _bits_view(x),
        codes.view(torch.uint8),
        scales,
        status,
        m,
        k,
        IN_KIND=_IN_KIND[x.dtype],
        ROWS=rows,
        CHUNK=chunk,
        E4M3_SW=e4m3_sw,
        num_warps=warps,
    )
    return codes, scales, status


def int4_quantize(x, group_size: int, config=None):
    """config: (elements per program, num_warps). x: an [M, K] tensor or a list of same-shape
    tensors quantized as their concatenation along rows, without making it (`_group`)."""
    x, table, m, k, group_rows = _group(x)
    ngroups = k // group_size
    codes = torch.empty(m, k, dtype=torch.int8, device=x.device)
    scales = torch.empty(m, ngroups, dtype=torch.bfloat16, device=x.device)
    status = _status(x.device)
    elems, warps = config or (8192, 8)  # bench/bench_kernels.py --tune-quant, H200
    per_prog = max(1, elems // group_size)
    chunk = min(_pow2_at_least(ngroups), per_prog)
    rows = max(1, per_prog // chunk)
    if table is not None:
        rows = _rows_dividing(rows, group_rows)
    grid = (triton.cdiv(m, rows), triton.cdiv(ngroups, chunk))
    _int4_kernel[grid](
        x.view(torch.int32),
        x if table is None else table,
        codes.view(torch.int16),
        scales,
        status,
        m,
        k,
        k // 2,
        group_rows,
        IN_KIND=_IN_KIND[x.dtype],
        G=group_size,
        ROWS=rows,
        CHUNK=chunk,
        TABLE=table is not None,
        num_warps=warps,
    )
    return codes, scales, status


def fp8_block_quantize(x: torch.Tensor, block: tuple[int, int], e4m3_sw: bool = False):
    m, k = x.shape
    bm, bk = block
    codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    sinv = torch.empty(triton.cdiv(m, bm), k // bk, dtype=torch.float32, device=x.device)
    status = _status(x.device)
    nrb = triton.cdiv(m, bm)
    gr = max(1, min(_pow2_at_least(nrb), 4096 // (bm * bk)))  # about 4K elements per program
    warps = 8 if gr * bm * bk >= 8192 else 4
    _fp8_block_kernel[(triton.cdiv(nrb, gr), k // bk)](
        _bits_view(x),
        codes.view(torch.uint8),
        sinv,
        status,
        m,
        k,
        IN_KIND=_IN_KIND[x.dtype],
        GR=gr,
        BM=bm,
        BK=bk,
        E4M3_SW=e4m3_sw,
        num_warps=warps,
    )
    return codes, sinv, status


def nvfp4_operand(codes: torch.Tensor, block_scales: torch.Tensor) -> torch.Tensor:
    """bf16 [M, K] = e2m1 x sf from codes uint8 [M, K/2] and block scales E4M3 [M, K/16]."""
    m, k = codes.shape[0], 2 * codes.shape[1]
    out = torch.empty(m, k, dtype=torch.bfloat16, device=codes.device)
    n = codes.numel()
    if n:
        block = 2048
        _nvfp4_operand_kernel[(triton.cdiv(n, block),)](
            codes.contiguous(), block_scales.contiguous().view(torch.uint8), out, n, BLOCK=block, num_warps=4
        )
    return out


def int4_operand(codes: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """bf16 [M, K] = bf16(q x s) from codes int8 [M, K] and scales bf16 [M, K/group_size]."""
    out = torch.empty(codes.shape, dtype=torch.bfloat16, device=codes.device)
    n = codes.numel()
    if n:
        block = 4096
        _int4_operand_kernel[(triton.cdiv(n, block),)](
            codes.contiguous(), scales.contiguous(), out, n, G=group_size, BLOCK=block, num_warps=4
        )
    return out


def kernel_supports(fmt: str, x: torch.Tensor, kw: dict) -> bool:
    """Whether a Triton kernel covers this call (otherwise the dispatcher uses the reference)."""
    if x.dim() != 2 or x.dtype not in _IN_KIND or x.shape[0] == 0:
        return False
    if fmt == "int4":
        g = kw.get("group_size", 32)
        return is_int(g, 16, 512) and g & (g - 1) == 0
    if fmt == "fp8_block":
        block = kw.get("block", (128, 128))
        if not isinstance(block, (tuple, list)) or len(block) != 2:
            return False  # the reference raises the ValueError that names it
        bm, bk = block
        pow2 = all(is_int(v, lo=1) and v & (v - 1) == 0 for v in (bm, bk))
        return pow2 and bm * bk <= 16384 and bk >= 16
    return fmt in ("nvfp4", "mxfp8")
