"""The integer and float tricks the Triton kernels use, written once more in plain torch.

The GPU kernels cannot run on the CPU (their inline PTX needs a GPU, and Triton is an
optional extra), but the arithmetic they rely on can. Each function below is a line-by-line
torch transcription of what a kernel does, so CPU tests can check the algorithm against
`policy.formats` on every input class (ties, subnormals, saturation) and the GPU tests only
have to catch compiler and hardware surprises.

Simplified on purpose: these functions favour readability over speed; nothing calls them on
a hot path.
"""

from __future__ import annotations

import torch

# fp32 bit patterns used by the E2M1 rounding.
MAGIC_SHIFT = 22 << 23  # adds 22 to an fp32 exponent field
CODE_BIAS = MAGIC_SHIFT + 254  # bits(a + M) + E * (2 - 2^23) - CODE_BIAS is the E2M1 code


def e2m1_code(a: torch.Tensor, x_bits: torch.Tensor) -> torch.Tensor:
    """E2M1 code (int32 0..15) of `a` = min(|x| * enc, 6) (fp32, >= 0), sign taken from x's bits.

    Rounding to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} with ties to even is one fp32 add:
    the grid step is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6], so adding M = 2^22, 2^23 or 2^24
    (chosen from E, the exponent of max(a, 1.0)) leaves exactly the step as the ulp, and IEEE
    round-to-nearest-even does the rounding. The low bits of a + M then count steps, and
    code = steps + 2 * (E - 127) (the codes of the grid points 0, 2 and 4 are 0, 4 and 6).
    The kernel computes that as bits(a + M) + E * (2 - 2^23), which is code + CODE_BIAS, and
    takes the constant off once per packed word of eight codes.

    The sign: a negative input (x < 0, so not -0.0) sets bit 3, even when it rounds to zero;
    tested on the integer bits so a flush-to-zero of a subnormal x cannot drop it.
    """
    e = torch.maximum(a, torch.tensor(1.0)).view(torch.int32) >> 23  # 127, 128 or 129
    m_bits = (e << 23) + MAGIC_SHIFT
    r = a + m_bits.view(torch.float32)  # one correctly rounded fp32 add
    raw = r.view(torch.int32) + e * (2 - (1 << 23))
    code = raw - CODE_BIAS
    negative = x_bits.view(torch.int32).to(torch.int64) & 0xFFFFFFFF > 0x80000000
    return code | (negative.to(torch.int32) << 3)


INT4_SNAP = 1536.0  # 1.5 * 2^10: fp32 values near it have an ulp of 2^-13; a multiple of 256


def int4_codes_16bit(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The int4 kernel's rint(x / s) for 16-bit x (as fp32) and bf16 scales s (as fp32): one
    fused multiply-add w = RN(x * r + 1536) with r = RN(1/s), then rint(w) - 1536.

    Why this equals the contract's rint(x / s): s * r = 1 + e with |e| < 2^-24, so the exact
    x * r is within 7.5 * 2^-24 of x / s (|x / s| <= 7.02 here, as the clamp never binds), and
    the add rounds it once to a multiple of 2^-13. A half-integer h = x / s exactly is itself
    such a multiple and is kept, so rint's ties go to even as in the reference. Any other
    x / s is at least 2^-12 away from every half-integer, because x - h * s is a nonzero
    multiple of min(ulp(x), ulp(s) / 2) (x has at most 11 significant bits, s 8): rounding to
    2^-13 cannot carry it across. 1536 is a multiple of 256, so in the int8 code bytes the
    subtraction is free. fp32 inputs (24 bits) have no such margin: the kernel divides.
    The unit test checks this over every bf16 and fp16 x against every bf16 scale significand.
    (fp64 stands in for the fma here: for these operands x * r + 1536 is exact in fp64.)"""
    r = torch.div(torch.ones_like(s), s)  # one correctly rounded fp32 division: RN(1 / s)
    w = (x.double() * r.double() + INT4_SNAP).float()
    return (torch.round(w) - INT4_SNAP).to(torch.int32)


def bf16_word_to_values(words: torch.Tensor) -> torch.Tensor:
    """int32 words holding two bf16 (low half first) -> float32 [..., 2]."""
    lo = (words & 0xFFFF).to(torch.int32) << 16
    hi = words & ~0xFFFF
    return torch.stack([lo.view(torch.float32), hi.view(torch.float32)], dim=-1)


def e4m3_byte(v: torch.Tensor) -> torch.Tensor:
    """fp32 in [-448, 448] -> E4M3 byte (uint8), round to nearest even, as the kernels' software path.

    Below 2^-6 (E4M3's subnormal range) adding 2^14 leaves an ulp of 2^-9, the E4M3 subnormal
    step, so the add rounds and the low bits are the code (8 = the smallest normal, 2^-6).
    Above, the usual round-half-to-even on the fp32 bits: add 0x7FFFF plus the kept lsb, drop 20
    mantissa bits, and rebias the exponent from 127 to 7.
    """
    bits = v.view(torch.int32)
    a = bits & 0x7FFFFFFF
    sign = (bits >> 24) & 0x80
    sub = (a.view(torch.float32) + 16384.0).view(torch.int32) - 0x46800000
    norm = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    return (torch.where(a < 0x3C800000, sub, norm) | sign).to(torch.uint8)


# --------------------------------------------------------------------------- 4-bit weight layout
# The matmul kernels read 4-bit weights as int32 words, two per 16-element block: word h of
# block b holds elements 16b + 4j + 2h (nibble j) and 16b + 4j + 2h + 1 (nibble j + 4), j = 0..3,
# so one shift and mask give a pair of K-consecutive codes in the two 16-bit lanes.


def repack(nibbles: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K] (K-order) -> kernel-layout int32 words [..., K/8] (see module doc)."""
    *lead, k = nibbles.shape
    e = nibbles.to(torch.int64).reshape(*lead, k // 16, 4, 2, 2)  # [.., block, j, h, t]: element 4j + 2h + t
    e = e.permute(*range(len(lead) + 1), -2, -1, -3)  # [.., block, h, t, j]: nibble p = 4t + j of word h
    e = e.reshape(*lead, k // 16, 2, 8)
    word = (e << (4 * torch.arange(8, device=e.device))).sum(dim=-1)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).reshape(*lead, k // 8)


def unrepack(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `repack`: int32 words [..., K/8] -> codes 0..15 uint8 [..., K]."""
    *lead, w = words.shape
    nib = (words.to(torch.int64).unsqueeze(-1) >> (4 * torch.arange(8, device=words.device))) & 0xF
    nib = nib.reshape(*lead, w // 2, 2, 2, 4)  # [.., block, h, t, j]
    nib = nib.permute(*range(len(lead) + 1), -1, -3, -2)  # [.., block, j, h, t]
    return nib.reshape(*lead, w * 8).to(torch.uint8)


def pair_lanes(words: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two codes (K order 16b + 4j + 2h + {0, 1}) that output P_j of a word carries."""
    w = words.to(torch.int64)
    return (w >> (4 * j)) & 0xF, (w >> (4 * j + 16)) & 0xF


def nvfp4_pairs(words: torch.Tensor, j: int) -> torch.Tensor:
    """torch transcription of the nvfp4 PTX for output P_j, before its bf16x2 multiply by the
    scale: int32 words of two bf16 bit patterns worth e2m1 * 2^-126 (low lane first)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    shift = 6 - 4 * j
    u = (w << shift) if shift >= 0 else (w >> -shift)
    u = u & 0x03C003C0
    s = u & 0x02000200
    r = (u + s * 63) & 0xFFFFFFFF
    return torch.where(r >= 2**31, r - 2**32, r).to(torch.int32)
