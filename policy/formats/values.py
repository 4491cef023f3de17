"""Stored values that no quantizer output holds, found in a tensor's bytes as they are.

Each rule reads a part's bits (vectorized numpy over the raw bytes, no dequantization). The
quantizers (DESIGN.md, "The quantizer contract") never produce these values, so a worker refuses
bytes holding them at fetch:

    bf16       values         finite: exponent bits not all ones
    nvfp4      block_scales   E4M3 0x00..0x7E: sf = e4m3(min(bamax * k, 448)) is >= 0, never NaN (0x7F/0xFF)
               global_scale   fp32 in [S_dec(amax -> 0), S_dec(FLT_MAX)] = [2^-128, ~FLT_MAX/2688]
    mxfp8      codes          E4M3 not NaN (0x7F/0xFF): values are clamped to +-448 first
               scales         E8M0 byte <= 254 (255 is NaN)
    fp8_block  codes          E4M3 not NaN;   scale_inv   fp32 in [scale_inv(amax -> 0), scale_inv(FLT_MAX)]
    int4       packed         no nibble 0 (it decodes to -8; codes are in [-7, 7])
               scales         bf16 in [s(0) = bf16(1e-5), s(FLT_MAX)]

A scale's range is what the format's own quantize() gives for the smallest and the largest finite
amax, so NaN, Inf, zero, negative and out-of-range scales are refused. nvfp4 codes have no rule.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import numpy as np
import torch

from . import fp8_block, int4, nvfp4
from ._common import FLT_MAX

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


def outside(lo: int, hi: int, dtype: type) -> Callable[[np.ndarray], np.ndarray]:
    """The rule "bits not in [lo, hi]" for positive floats given by their bit patterns (positive
    floats order as their bits do; negatives, Inf and NaN lie above any positive finite `hi`)."""
    span = dtype(hi - lo)
    return lambda bits: (bits - dtype(lo)) > span  # unsigned: below lo wraps around above span


@functools.cache
def scale_ranges() -> dict[str, tuple[int, int]]:
    """(lowest, highest) bit pattern of each scale part, from quantize() at amax 2^-149 (the smallest
    positive fp32; 0 for int4, whose floor applies below 7e-5) and amax FLT_MAX."""

    def bits(t: torch.Tensor) -> int:
        wide = t.dtype == torch.float32
        return int(t.reshape(-1)[0].view(torch.int32 if wide else torch.int16)) & (0xFFFFFFFF if wide else 0xFFFF)

    def at(amax: float, k: int) -> torch.Tensor:
        x = torch.zeros(1, k)
        x[0, 0] = amax
        return x

    tiny = float(np.float32(2.0**-149))
    return {
        "nvfp4.global_scale": tuple(bits(nvfp4.quantize(at(a, 16)).global_scale) for a in (tiny, FLT_MAX)),
        "fp8_block.scale_inv": tuple(
            bits(fp8_block.quantize(at(a, 128), block=(1, 128)).scale_inv) for a in (tiny, FLT_MAX)
        ),
        "int4.scales": tuple(bits(int4.quantize(at(a, 32), group_size=32).scales) for a in (0.0, FLT_MAX)),
    }


def out_of_range(part: str, dtype: type) -> Callable[[np.ndarray], np.ndarray]:
    """The rule for a scale part: bits outside what its format's quantize() produces (the range is
    computed at the first use)."""
    rule = functools.cache(lambda: outside(*scale_ranges()[part], dtype))
    return lambda bits: rule()(bits)


def int4_minus8(u32: np.ndarray) -> np.ndarray:
    """A packed int32 word with a zero nibble (stored value 0 = code -8): the has-zero-nibble bit
    trick, exact per word ((w - 0x11111111) & ~w keeps a nibble's top bit only below a zero nibble)."""
    return ((u32 - np.uint32(0x11111111)) & ~u32 & np.uint32(0x88888888)) != 0


Rule = tuple[type, Callable[[np.ndarray], np.ndarray], str]  # (element dtype, the test, what it finds)
RULES: dict[str, dict[str, Rule]] = {
    "bf16": {"values": (np.uint16, nonfinite_bf16, "non-finite bf16 value(s)")},
    "nvfp4": {
        "block_scales": (np.uint8, not_e4m3_scale, "E4M3 block scale(s) NaN or negative"),
        "global_scale": (np.uint32, out_of_range("nvfp4.global_scale", np.uint32), "fp32 global scale(s) out of range"),
    },
    "mxfp8": {
        "codes": (np.uint8, e4m3_nan, "E4M3 NaN code(s)"),
        "scales": (np.uint8, e8m0_nan, "E8M0 NaN scale(s) (0xFF)"),
    },
    "fp8_block": {
        "codes": (np.uint8, e4m3_nan, "E4M3 NaN code(s)"),
        "scale_inv": (np.uint32, out_of_range("fp8_block.scale_inv", np.uint32), "fp32 scale(s) out of range"),
    },
    "int4": {
        "packed": (np.uint32, int4_minus8, "int32 word(s) holding the int4 code -8"),
        "scales": (np.uint16, out_of_range("int4.scales", np.uint16), "bf16 scale(s) out of range"),
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
