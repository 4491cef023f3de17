"""Stored values that no quantizer output holds, found in a tensor's bytes as they are.

Each rule reads a part's bits (vectorized numpy over the raw bytes, no dequantization). The
quantizers (DESIGN.md, "The quantizer contract") never produce these values, so bytes holding
them are damage or an attack, and a worker refuses them at fetch:

    bf16       values         finite: exponent bits not all ones
    nvfp4      block_scales   E4M3 0x00..0x7E: sf = e4m3(min(bamax * k, 448)) is >= 0, never NaN (0x7F/0xFF)
               global_scale   fp32 finite and > 0: S_dec = 1 / S_enc with S_enc in (0, FLT_MAX]
    mxfp8      codes          E4M3 not NaN (0x7F/0xFF): values are clamped to +-448 first
               scales         E8M0 byte <= 254 (255 is NaN)
    fp8_block  codes          E4M3 not NaN;   scale_inv   fp32 finite and > 0
    int4       packed         no nibble 0 (it decodes to -8; codes are in [-7, 7])
               scales         bf16 finite and > 0 (s >= 1e-5)

nvfp4 codes have no rule: every E2M1 nibble is a value.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

SCAN = 1 << 18  # elements per scanned block: the temporaries of one rule stay in cache


def nonfinite_bf16(u16: np.ndarray) -> np.ndarray:
    return (u16 & 0x7F80) == 0x7F80


def e4m3_nan(u8: np.ndarray) -> np.ndarray:
    return (u8 & 0x7F) == 0x7F


def not_e4m3_scale(u8: np.ndarray) -> np.ndarray:
    """NaN (0x7F, 0xFF) or negative (sign bit set, -0 included): 0x7F and up."""
    return u8 >= 0x7F


def e8m0_nan(u8: np.ndarray) -> np.ndarray:
    return u8 == 0xFF


def not_positive_f32(u32: np.ndarray) -> np.ndarray:
    """Not in 0x00000001..0x7F7FFFFF (the positive finite fp32 bit patterns): 0, negative, Inf, NaN."""
    return (u32 - np.uint32(1)) >= np.uint32(0x7F7FFFFF)


def not_positive_bf16(u16: np.ndarray) -> np.ndarray:
    """Not in 0x0001..0x7F7F (the positive finite bf16 bit patterns)."""
    return (u16 - np.uint16(1)) >= np.uint16(0x7F7F)


def int4_minus8(u32: np.ndarray) -> np.ndarray:
    """A packed int32 word with a zero nibble (stored value 0 = code -8): the has-zero-nibble bit
    trick, exact per word ((w - 0x11111111) & ~w keeps a nibble's top bit only below a zero nibble)."""
    return ((u32 - np.uint32(0x11111111)) & ~u32 & np.uint32(0x88888888)) != 0


Rule = tuple[type, Callable[[np.ndarray], np.ndarray], str]  # (element dtype, the test, what it finds)
RULES: dict[str, dict[str, Rule]] = {
    "bf16": {"values": (np.uint16, nonfinite_bf16, "non-finite bf16 value(s)")},
    "nvfp4": {
        "block_scales": (np.uint8, not_e4m3_scale, "E4M3 block scale(s) NaN or negative"),
        "global_scale": (np.uint32, not_positive_f32, "fp32 global scale(s) not finite and > 0"),
    },
    "mxfp8": {
        "codes": (np.uint8, e4m3_nan, "E4M3 NaN code(s)"),
        "scales": (np.uint8, e8m0_nan, "E8M0 NaN scale(s) (0xFF)"),
    },
    "fp8_block": {
        "codes": (np.uint8, e4m3_nan, "E4M3 NaN code(s)"),
        "scale_inv": (np.uint32, not_positive_f32, "fp32 scale(s) not finite and > 0"),
    },
    "int4": {
        "packed": (np.uint32, int4_minus8, "int32 word(s) holding the int4 code -8"),
        "scales": (np.uint16, not_positive_bf16, "bf16 scale(s) not finite and > 0"),
    },
}


def invalid_values(fmt: str, parts: Mapping[str, np.ndarray]) -> list[str]:
    """One line per part of `parts` (part name -> its raw bytes, a uint8 array) that breaks its
    format's rule: what was found, how many, and the first (element index and bits)."""
    out = []
    for name, (dtype, rule, what) in RULES.get(fmt, {}).items():
        raw = parts.get(name)
        if raw is None or raw.size % np.dtype(dtype).itemsize:
            continue  # a layout the manifest checks refuse before this
        a = raw.view(dtype)
        first = first_hit(a, rule)
        if first >= 0:
            n = int(np.count_nonzero(rule(a)))
            out.append(f"{name}: {n} {what} of {a.size}, the first at element {first} ({int(a[first]):#x})")
    return out


def first_hit(a: np.ndarray, rule: Callable[[np.ndarray], np.ndarray]) -> int:
    """The index of the first element of `a` for which `rule` holds, or -1 (scanned SCAN at a time)."""
    for start in range(0, a.size, SCAN):
        hit = rule(a[start : start + SCAN])
        if hit.any():
            return start + int(hit.argmax())
    return -1
