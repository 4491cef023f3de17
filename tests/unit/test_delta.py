"""broker/delta.py: the XOR + zstd encoding of a tensor against its parent, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import zstandard

from broker import delta as dl
from broker.policy_server import PolicyServerConfig
from trainer.config import TrainerConfig


def b(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint8)


def test_xor_by_hand():
    assert dl.xor(b(0x0F, 0xF0, 0xAA), b(0xFF, 0xF0, 0x55)).tolist() == [0xF0, 0x00, 0xFF]
    with pytest.raises(dl.DeltaError, match="XOR of 2 and 3 bytes"):
        dl.xor(b(1, 2), b(1, 2, 3))


def test_unchanged_tensors_cost_no_bytes():
    parent = b(1, 2, 3, 4)
    assert dl.encode(parent.copy(), parent) is None


def test_the_payload_is_the_zstd_of_the_xor():
    parent, new = b(1, 2, 3, 4), b(1, 2, 7, 4)  # 3 ^ 7 = 4
    payload = dl.encode(new, parent)
    assert zstandard.ZstdDecompressor().decompress(payload) == bytes([0, 0, 4, 0])
    assert zstandard.frame_content_size(payload) == 4
    out = np.empty(4, dtype=np.uint8)
    dl.decode("t", payload, parent, out)
    assert out.tolist() == [1, 2, 7, 4]


def test_decode_in_place_over_the_parent():
    rng = np.random.default_rng(0)
    parent = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    new = parent.copy()
    new[::97] ^= 0x21  # scattered changes, as a small optimizer step gives
    payload = dl.encode(new, parent)
    assert len(payload) < new.nbytes // 10
    dl.decode("t", payload, parent, parent)  # out is the parent's own memory
    assert np.array_equal(parent, new)


def test_a_frame_from_pieces_is_the_frame_of_their_concatenation():
    parent, new = b(*range(10)), b(*range(10))
    new[7] = 0xFF
    cuts = [(0, 4), (4, 8), (8, 10)]  # chunks as the server holds them: the last shorter
    frame, changed = dl.encode_pieces([new[x:y] for x, y in cuts], [parent[x:y] for x, y in cuts])
    assert changed and zstandard.ZstdDecompressor().decompress(frame) == bytes(dl.xor(new, parent))
    out = np.empty(10, dtype=np.uint8)
    dl.decode("t", frame, parent, out)
    assert out.tolist() == new.tolist()
    assert dl.encode_pieces([parent[:4]], [parent[:4].copy()])[1] is False
    with pytest.raises(dl.DeltaError, match="XOR of 4 and 3 bytes in pieces"):
        dl.encode_pieces([new[:4]], [parent[:3]])


def test_a_corrupt_or_mis_sized_payload_is_refused_or_decodes_to_other_bytes():
    parent, new = b(*range(64)), b(*range(64))
    new[10] = 200
    payload = dl.encode(new, parent)
    out = np.empty(64, dtype=np.uint8)
    with pytest.raises(dl.DeltaError, match="tensor t: the parent has 64 bytes, the version 63"):
        dl.decode("t", payload, parent, np.empty(63, dtype=np.uint8))
    with pytest.raises(dl.DeltaError, match="tensor t: the delta frame holds 64 bytes, the tensor has 32"):
        dl.decode("t", payload, parent[:32], out[:32])
    with pytest.raises(dl.DeltaError, match="undecodable"):
        dl.decode("t", payload + b"x", parent, out)  # trailing bytes
    with pytest.raises(dl.DeltaError, match="undecodable"):
        dl.decode("t", b"not zstd", parent, out)
    # zstd frames carry no checksum here: a flipped payload byte may decode, to other bytes, which
    # the client's check against the manifest refuses (tests/integration/test_policy_deltas.py)
    flipped = bytearray(payload)
    flipped[-3] ^= 0x01
    try:
        dl.decode("t", bytes(flipped), parent, out)
    except dl.DeltaError:
        pass
    else:
        assert not np.array_equal(out, new)


def test_a_wrong_parent_rebuilds_other_bytes():
    parent, other, new = b(1, 2, 3, 4), b(1, 2, 3, 5), b(9, 2, 3, 4)
    out = np.empty(4, dtype=np.uint8)
    dl.decode("t", dl.encode(new, parent), other, out)
    assert out.tolist() == [9, 2, 3, 5]  # new ^ parent ^ other: not `new` (the manifest's sha256 tells)


def test_xor_compatible_names_the_first_tensor_that_is_not():
    assert dl.xor_compatible({"a": 4, "b": 8}, {"a": 4, "b": 8, "c": 1}) == ""
    assert dl.xor_compatible({"a": 4, "b": 8}, {"a": 4}) == "the parent has no tensor b"
    assert dl.xor_compatible({"a": 4}, {"a": 6}) == "tensor a has 4 bytes, 6 in the parent"
    held = dl.HeldPolicy(1, b"", {"a": np.zeros(4, np.uint8)})
    assert held.covers({"a": 4}) and not held.covers({"a": 5}) and not held.covers({"z": 4})


def test_worth_it_only_below_the_full_bytes():
    assert dl.worth_it(0, 10) and dl.worth_it(9, 10)
    assert not dl.worth_it(10, 10)
    assert dl.max_payload_bytes(1 << 20) > len(zstandard.ZstdCompressor().compress(np.random.bytes(1 << 20)))


def test_config_knobs_are_validated():
    with pytest.raises(ValueError, match="delta_full_every=0 must be an int >= 1"):
        PolicyServerConfig(delta_full_every=0)
    with pytest.raises(ValueError, match="deltas=1 must be a bool"):
        PolicyServerConfig(deltas=1)
    with pytest.raises(ValueError, match=r"delta_full_every=0 \(an int >= 1; 1 = every version full\)"):
        TrainerConfig(delta_full_every=0)
    with pytest.raises(ValueError, match="policy_deltas='yes'"):
        TrainerConfig(policy_deltas="yes")
    assert TrainerConfig().policy_deltas and TrainerConfig().delta_full_every == 16
