"""Policy content checks, by hand: the manifest's own digest (what the signed pointer names), the
pointer's signature over it, and the stored values no quantizer produces (policy.formats.values)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from broker.registry import parse_pointer, pointer_signed
from broker.signing import POLICY_POINTER, Signer
from policy import formats
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats._common import FLT_MAX
from policy.formats.params import quantize_params
from policy.formats.values import invalid_values, scale_ranges
from policy.manifest_check import ValuesRefused, check_values
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from policy.tp_layout import tensor_layout, tp_plan_of
from tandem.v1 import manifest_pb2 as pb


@pytest.fixture(scope="module")
def packed() -> mf.PackedPolicy:
    cfg = ModelConfig.preset("tiny", n_layers=2, n_experts=2, top_k=1)
    recipe = Recipe.load("nvfp4_moe")
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    tensors = quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), recipe.plan(cfg))
    return mf.build_manifest(version=3, parent_version=None, contract=contract, tensors=tensors)


def copy(m: pb.Manifest) -> pb.Manifest:
    c = pb.Manifest()
    c.CopyFrom(m)
    return c


# -- the manifest's digest ----------------------------------------------------------------------


def test_the_digest_covers_every_checksum_and_scale_but_not_the_creation_time(packed):
    m = packed.manifest
    d = mf.manifest_digest(m)
    assert len(d) == 32
    later = copy(m)
    later.created_unix_ns += 10**9  # the same content published again later: the same digest
    assert mf.manifest_digest(later) == d
    t = next(i for i, e in enumerate(m.tensors) if e.format == "nvfp4")

    def changed(edit) -> bytes:
        c = copy(m)
        edit(c)
        return mf.manifest_digest(c)

    def flip_xxh3(c):
        c.tensors[t].chunk_xxh3[0] ^= 1

    def flip_sha(c):
        c.tensors[t].sha256 = bytes([c.tensors[t].sha256[0] ^ 1]) + c.tensors[t].sha256[1:]

    def bump_scale(c):
        c.tensors[t].global_scale *= 2

    def bump_version(c):
        c.version += 1

    digests = {changed(f) for f in (flip_xxh3, flip_sha, bump_scale, bump_version)}
    assert len(digests) == 4 and d not in digests


def test_manifest_from_bytes_checks_the_digest_before_anything_else(packed):
    m = packed.manifest
    raw = mf.manifest_to_bytes(m)
    good = mf.manifest_digest(m).hex()
    assert mf.manifest_from_bytes(raw, digest=good).version == 3
    other = copy(m)
    other.tensors[0].sha256 = b"\0" * 32  # another content, internally consistent
    with pytest.raises(mf.DigestMismatch, match="version 3 has digest .* the signed pointer says"):
        mf.manifest_from_bytes(mf.manifest_to_bytes(other), digest=good)
    broken = copy(m)
    broken.total_bytes += 1  # inconsistent as well: still a digest mismatch (its source is not trusted)
    with pytest.raises(mf.DigestMismatch):
        mf.manifest_from_bytes(mf.manifest_to_bytes(broken), digest=good)
    with pytest.raises(ValueError, match="total_bytes"):
        mf.manifest_from_bytes(mf.manifest_to_bytes(broken))  # no digest: verify_manifest's own error


# -- the pointer --------------------------------------------------------------------------------

SIGNER = Signer(b"k" * 32)


def pointer_hash(digest: str, *, sign_digest: str | None = None) -> dict[bytes, bytes]:
    """A policy:latest hash signed as registry.py documents: HMAC over its seven fields joined by \\n."""
    fields = ["7", "10.0.0.1:50051", "f" * 64, "1.5", digest, "0", "[]"]
    signed = fields[:4] + [digest if sign_digest is None else sign_digest] + fields[5:]
    sig = SIGNER.sign(POLICY_POINTER, "\n".join(signed).encode()).hex()
    names = (b"version", b"address", b"contract_fingerprint", b"published_at", b"content_digest", b"fanout", b"relays")
    return {**{k: v.encode() for k, v in zip(names, fields)}, b"sig": sig.encode()}


def test_the_pointer_signature_covers_the_content_digest_and_requires_one():
    d = "ab" * 32
    h = pointer_hash(d)
    assert pointer_signed(h, SIGNER) and parse_pointer(h).content_digest == d
    assert not pointer_signed(pointer_hash("cd" * 32, sign_digest=d), SIGNER)  # digest swapped after signing
    assert not pointer_signed(pointer_hash(""), SIGNER)  # signed, but names no content
    no_field = {k: v for k, v in pointer_hash("").items() if k != b"content_digest"}
    assert not pointer_signed(no_field, SIGNER)
    assert parse_pointer(no_field).content_digest == ""  # unsigned runs (tests, benches) still parse it
    assert parse_pointer({**h, b"content_digest": b"XY" * 32}) is None  # not lowercase hex: malformed


# -- stored values ------------------------------------------------------------------------------


def u8(*values: int, dtype=np.uint8) -> np.ndarray:
    return np.array(values, dtype=dtype).view(np.uint8)


def test_bf16_one_nan_or_inf_is_found_with_its_index():
    # 0x3F80 = 1.0, 0x7F7F = the largest finite, 0x8000 = -0, 0x0001 = the smallest subnormal
    assert invalid_values("bf16", {"values": u8(0x3F80, 0x7F7F, 0x8000, 0x0001, dtype=np.uint16)}) == []
    (line,) = invalid_values("bf16", {"values": u8(0x3F80, 0x3F80, 0x7FC0, 0x3F80, dtype=np.uint16)})
    assert line == "values: 1 non-finite bf16 value(s) of 4, the first at element 2 (0x7fc0)"
    for bits in (0x7F80, 0xFF80, 0xFFC1):  # +Inf, -Inf, a negative NaN
        assert invalid_values("bf16", {"values": u8(0, bits, dtype=np.uint16)})


def test_e4m3_nan_codes_and_negative_block_scales():
    ok = {"block_scales": u8(0x00, 0x01, 0x7E), "global_scale": u8(0x3F800000, dtype=np.uint32)}
    assert invalid_values("nvfp4", ok) == []  # 0x7E = 448, the largest block scale
    for code in (0x7F, 0xFF, 0x80, 0xB8):  # NaN, NaN, -0, -1.0: a quantizer's sf is >= 0
        (line,) = invalid_values("nvfp4", {**ok, "block_scales": u8(0x38, code)})
        assert line.startswith("block_scales: 1 E4M3 block scale(s) NaN or negative of 2, the first at element 1")
    for code in (0x7F, 0xFF):
        assert invalid_values("mxfp8", {"codes": u8(0xFE, code), "scales": u8(127)})  # 0xFE = -448 is fine
        assert invalid_values("fp8_block", {"codes": u8(code), "scale_inv": u8(0x3F800000, dtype=np.uint32)})
    assert invalid_values("mxfp8", {"codes": u8(0xFE, 0x7E), "scales": u8(0, 254)}) == []
    assert invalid_values("mxfp8", {"codes": u8(0), "scales": u8(254, 255)})[0].startswith("scales: 1 E8M0 NaN")


def test_scales_must_be_in_the_range_their_quantizer_produces():
    # nvfp4 S_dec = fp32(1 / S_enc): at amax -> 0, S_enc = FLT_MAX and S_dec = 2^-128 (0x00200000, a
    # subnormal); at amax = FLT_MAX, S_dec = FLT_MAX / 2688 (so 6 * 448 * S_dec stays finite).
    lo, hi = scale_ranges()["nvfp4.global_scale"]
    assert lo == 0x00200000 and np.uint32(hi).view(np.float32) == pytest.approx(FLT_MAX / 2688, rel=1e-6)
    assert invalid_values("nvfp4", {"global_scale": u8(lo, 0x3F800000, hi, dtype=np.uint32)}) == []  # 1.0 (amax 0)
    for bits in (lo - 1, hi + 1, 0x00000000, 0x80000000, 0xBF800000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000):
        (line,) = invalid_values("nvfp4", {"global_scale": u8(0x3F800000, bits, dtype=np.uint32)})
        assert line == f"global_scale: 1 fp32 global scale(s) out of range of 2, the first at element 1 ({bits:#x})"
    lo, hi = scale_ranges()["fp8_block.scale_inv"]  # fp32(1 / S), S = min(448 / amax, FLT_MAX)
    assert lo == 0x00200000 and np.uint32(hi).view(np.float32) == pytest.approx(FLT_MAX / 448, rel=1e-6)
    for bits in (lo - 1, hi + 1, 0x00000000, 0x7F800000):
        assert invalid_values("fp8_block", {"scale_inv": u8(bits, dtype=np.uint32)})
    # int4 s = bf16(max(amax / 7, 1e-5)): bf16(1e-5) = 1.3107 * 2^-17 -> exponent 0x6E, mantissa 40: 0x3728
    lo, hi = scale_ranges()["int4.scales"]
    assert lo == 0x3728 and float(torch.tensor(hi, dtype=torch.int16).view(torch.bfloat16)) == pytest.approx(
        FLT_MAX / 7, rel=2**-7
    )


def test_int4_code_minus8_and_bad_scales():
    # Nibble 8 is code 0, nibble 0 would be -8: 0x88888888 = eight zeros, 0x8888888F has a +7 in it.
    ok = {"packed": u8(0x88888888, 0xFFFF1111, dtype=np.uint32), "scales": u8(0x3728, 0x3F80, dtype=np.uint16)}
    assert invalid_values("int4", ok) == []
    (line,) = invalid_values("int4", {**ok, "packed": u8(0x88888888, 0x88880888, dtype=np.uint32)})
    assert line == "packed: 1 int32 word(s) holding the int4 code -8 of 2, the first at element 1 (0x88880888)"
    for word in (0x0, 0x08888888, 0x88888880, 0x88088888):  # a zero nibble anywhere in the word
        assert invalid_values("int4", {**ok, "packed": u8(word, dtype=np.uint32)}), hex(word)
    for bits in (0x0000, 0x3727, 0xBF80, 0x7F7F, 0x7F80, 0x7FC0):  # 0, under bf16(1e-5), -1, max, +Inf, NaN
        assert invalid_values("int4", {**ok, "scales": u8(0x3F80, bits, dtype=np.uint16)}), hex(bits)


def test_what_the_quantizers_produce_passes():
    x = torch.randn(64, 256) * 3
    x[1] = 0  # an all-zero row: its scales are the zero/one edge cases
    for fmt, kw in (("bf16", {}), ("nvfp4", {}), ("nvfp4", {"scope": "row"}), ("mxfp8", {}), ("int4", {})):
        q = formats.get(fmt).quantize(x, **kw)
        parts = {n: t.contiguous().view(torch.uint8).reshape(-1).numpy() for n, t in q.parts().items()}
        assert invalid_values(fmt, parts) == [], fmt
    q = formats.get("fp8_block").quantize(torch.randn(256, 256))
    parts = {n: t.contiguous().view(torch.uint8).reshape(-1).numpy() for n, t in q.parts().items()}
    assert invalid_values("fp8_block", parts) == []


def test_check_values_names_the_version_tensor_and_part(packed):
    m = packed.manifest
    plan = tp_plan_of(m)
    entry = next(e for e in m.tensors if e.format == "nvfp4")
    layout = tensor_layout(entry, plan)
    data = np.array(np.frombuffer(packed.blobs[entry.name], dtype=np.uint8))
    check_values(3, entry.format, layout, data)
    gs = next(p for p in layout.parts if p.name == "global_scale")
    data[gs.offset : gs.offset + 4] = np.array([np.inf], dtype=np.float32).view(np.uint8)
    with pytest.raises(ValuesRefused, match=f"policy version 3 refused: tensor {entry.name}: global_scale: 1 fp32"):
        check_values(3, entry.format, layout, data)


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block", "mxfp8", "nvfp4_moe", "int4_qat"])
def test_every_built_in_recipe_publishes_values_that_pass(recipe):
    """No false refusal: what a trainer publishes (random and all-zero weights) passes check_values."""
    cfg = ModelConfig.preset("tiny", n_layers=2, n_experts=2, top_k=1)
    r = Recipe.load(recipe)
    contract = contract_from_recipe(model_config=cfg, recipe=r)
    weights = dict(Transformer(cfg, seed=0).named_parameters())
    for w in (weights, {k: v.detach() * 0 for k, v in weights.items()}):
        p = mf.build_manifest(
            version=1, parent_version=None, contract=contract, tensors=quantize_params(w, r.plan(cfg))
        )
        plan = tp_plan_of(p.manifest)
        for e in p.manifest.tensors:
            check_values(1, e.format, tensor_layout(e, plan), np.frombuffer(p.blobs[e.name], dtype=np.uint8))
