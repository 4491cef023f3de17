"""broker.codec: round trips, input validation, and hostile bytes on the decode side."""

from __future__ import annotations

import pickle

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.codec import (
    SCHEMA_VERSION,
    CodecError,
    CodecLimits,
    PromptGroup,
    Trajectory,
    decode_prompt_group,
    decode_trajectory,
    encode_prompt_group,
    encode_trajectory,
    sample_id_for,
)


def make_traj(n_completion: int = 1000, n_prompt: int = 200, **overrides) -> Trajectory:
    rng = np.random.default_rng(0)
    kw = dict(
        sample_id=sample_id_for("g-1", 3),
        prompt_id="p-1",
        group_id="g-1",
        sample_index=3,
        group_size=8,
        prompt_tokens=rng.integers(0, 150_000, n_prompt),
        completion_tokens=rng.integers(0, 150_000, n_completion),
        behavior_logprobs=-rng.random(n_completion, dtype=np.float32) * 5,
        reward=1.0,
        policy_version=7,
        contract_fingerprint="f" * 64,
        worker_id="rollout-0",
        created_at=1.7e9,
        info={"finish_reason": "stop", "gen_ms": 12.5, "retries": 0, "truncated": False, "note": None},
    )
    kw.update(overrides)
    return Trajectory(**kw)


def make_prompt(**overrides) -> PromptGroup:
    kw = dict(prompt_id="p-1", group_id="g-1", prompt_tokens=[1, 2, 3], n_samples=8, task={"answer": "42"})
    kw.update(overrides)
    return PromptGroup(**kw)


def assert_same(a: Trajectory, b: Trajectory) -> None:
    for name in (
        "sample_id",
        "prompt_id",
        "group_id",
        "sample_index",
        "group_size",
        "reward",
        "policy_version",
        "contract_fingerprint",
        "worker_id",
        "created_at",
        "info",
    ):
        assert getattr(a, name) == getattr(b, name), name
    for name in ("prompt_tokens", "completion_tokens", "behavior_logprobs", "token_versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


def repack(data: bytes, **changes) -> bytes:
    msg = msgpack.unpackb(data, raw=False)
    for k, v in changes.items():
        if v is _DELETE:
            del msg[k]
        else:
            msg[k] = v
    return msgpack.packb(msg, use_bin_type=True)


_DELETE = object()


# ------------------------------------------------------------------ round trips


def test_trajectory_round_trip_is_exact_and_zero_copy():
    t = make_traj()
    data = encode_trajectory(t)
    u = decode_trajectory(data)
    assert_same(t, u)
    assert u.prompt_tokens.dtype == np.dtype("<i4") and u.behavior_logprobs.dtype == np.dtype("<f4")
    # views into the received bytes: read-only, no copy
    assert not u.completion_tokens.flags.writeable
    assert len(data) < 1000 * 12 + 200 * 4 + 1024  # 4 bytes per token each: ids, log-probs, versions


def test_prompt_group_round_trip():
    g = make_prompt(task={"answer": "42", "kind": "arith", "difficulty": 3})
    u = decode_prompt_group(encode_prompt_group(g))
    assert (u.prompt_id, u.group_id, u.n_samples, u.task) == (g.prompt_id, g.group_id, 8, g.task)
    assert u.prompt_tokens.tolist() == [1, 2, 3]


def test_accepts_torch_and_int64_and_converts_to_wire_dtypes():
    t = make_traj(
        n_completion=4,
        prompt_tokens=torch.tensor([5, 6, 7]),  # int64
        completion_tokens=torch.tensor([1, 2, 3, 4]),
        behavior_logprobs=torch.tensor([-0.5, -1.0, -2.0, -0.25], dtype=torch.float64),
    )
    assert t.prompt_tokens.dtype == np.dtype("<i4") and t.behavior_logprobs.dtype == np.dtype("<f4")
    u = decode_trajectory(encode_trajectory(t))
    assert u.completion_tokens.tolist() == [1, 2, 3, 4]
    assert u.behavior_logprobs.tolist() == [-0.5, -1.0, -2.0, -0.25]


def test_empty_completion_is_allowed():
    t = make_traj(n_completion=0)
    assert decode_trajectory(encode_trajectory(t)).completion_tokens.shape == (0,)


ids = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)
scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=50)
)


@st.composite
def trajectories(draw):
    n = draw(st.integers(0, 300))
    group_size = draw(st.integers(1, 64))
    version = draw(st.integers(0, 2**32 - 1))
    versions = sorted(draw(st.lists(st.integers(0, version), min_size=n, max_size=n)))[:-1] + [version] * (n > 0)
    return Trajectory(
        sample_id=draw(ids),
        prompt_id=draw(ids),
        group_id=draw(ids),
        sample_index=draw(st.integers(0, group_size - 1)),
        group_size=group_size,
        prompt_tokens=np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50)), dtype=np.int64),
        completion_tokens=np.array(draw(st.lists(st.integers(0, 2**31 - 1), min_size=n, max_size=n)), dtype=np.int64),
        behavior_logprobs=np.array(
            draw(st.lists(st.floats(-1e6, 0, width=32), min_size=n, max_size=n)), dtype=np.float32
        ),
        reward=draw(st.floats(allow_nan=False, allow_infinity=False)),
        policy_version=version,
        token_versions=np.array(versions, dtype=np.int64),
        contract_fingerprint=draw(ids),
        worker_id=draw(ids),
        created_at=draw(st.floats(0, 4e9)),
        info=draw(st.dictionaries(st.text(min_size=1, max_size=20), scalars, max_size=8)),
    )


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trajectories())
def test_hypothesis_trajectory_round_trip(t):
    assert_same(t, decode_trajectory(encode_trajectory(t)))


@settings(max_examples=100, deadline=None)
@given(
    ids,
    ids,
    st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=100),
    st.integers(1, 4096),
    st.dictionaries(st.text(min_size=1, max_size=20), scalars, max_size=8),
)
def test_hypothesis_prompt_round_trip(prompt_id, group_id, tokens, n, task):
    g = PromptGroup(prompt_id=prompt_id, group_id=group_id, prompt_tokens=tokens, n_samples=n, task=task)
    u = decode_prompt_group(encode_prompt_group(g))
    assert (u.prompt_id, u.group_id, u.prompt_tokens.tolist(), u.n_samples, u.task) == (
        prompt_id,
        group_id,
        tokens,
        n,
        task,
    )


# ------------------------------------------------------------------ construction errors


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(completion_tokens=np.array([1.5, 2.0]), behavior_logprobs=[-1.0, -1.0]), "completion_tokens"),
        (dict(prompt_tokens=[-1, 2]), "prompt_tokens"),
        (dict(prompt_tokens=[2**31]), "prompt_tokens"),
        (dict(prompt_tokens=[]), "prompt_tokens"),
        (dict(prompt_tokens=[[1, 2]]), "prompt_tokens"),
        (dict(behavior_logprobs=np.zeros(999, np.float32)), "behavior_logprobs"),
        (dict(behavior_logprobs=np.full(1000, np.nan, np.float32)), "behavior_logprobs"),
        (dict(behavior_logprobs=np.zeros(1000, np.int32)), "behavior_logprobs"),
        (dict(sample_index=8), "sample_index"),
        (dict(group_size=0), "group_size"),
        (dict(reward=float("inf")), "reward"),
        (dict(reward="1.0"), "reward"),
        (dict(policy_version=True), "policy_version"),
        (dict(policy_version=-1), "policy_version"),
        (dict(sample_id=""), "sample_id"),
        (dict(worker_id=3), "worker_id"),
        (dict(info={"x": [1, 2]}), "info['x']"),
        (dict(info={1: 2}), "info"),
    ],
)
def test_construction_rejects_bad_values_naming_the_field(overrides, field):
    with pytest.raises(CodecError) as e:
        make_traj(**overrides)
    assert e.value.field == field
    assert isinstance(e.value, ValueError)


def test_prompt_group_validation():
    with pytest.raises(CodecError, match="n_samples"):
        make_prompt(n_samples=0)
    with pytest.raises(CodecError, match="task"):
        make_prompt(task={"answer": object()})


def test_encode_enforces_limits():
    small = CodecLimits(max_tokens=100)
    with pytest.raises(CodecError) as e:
        encode_trajectory(make_traj(n_completion=101, n_prompt=5), small)
    assert e.value.field == "completion_tokens"
    with pytest.raises(CodecError) as e:
        encode_trajectory(make_traj(), CodecLimits(max_message_bytes=4096))
    assert e.value.field == "message"
    with pytest.raises(CodecError) as e:
        encode_trajectory(make_traj(sample_id="x" * 300))
    assert e.value.field == "sample_id"
    with pytest.raises(CodecError):
        encode_trajectory(make_prompt())  # wrong type
    with pytest.raises(ValueError, match="max_tokens=0"):
        CodecLimits(max_tokens=0)


# ------------------------------------------------------------------ hostile input


GOOD = encode_trajectory(make_traj(n_completion=10, n_prompt=5))


@pytest.mark.parametrize(
    "data, field",
    [
        (GOOD[:-3], "message"),  # truncated
        (GOOD + b"\x00", "message"),  # trailing bytes
        (b"", "message"),
        (b"\xc1", "message"),  # reserved msgpack byte
        (msgpack.packb([1, 2, 3]), "message"),  # not a map
        (msgpack.packb({"schema": 1, "kind": "trajectory", 1: 2}), "message"),  # non-str key
        (msgpack.packb(msgpack.ExtType(5, b"x" * 10)), "message"),  # ext types are refused
        (pickle.dumps({"schema": 1}), "message"),  # never unpickled
        (repack(GOOD, schema=SCHEMA_VERSION + 1), "schema"),
        (repack(GOOD, schema=True), "schema"),
        (repack(GOOD, schema=_DELETE), "schema"),
        (repack(GOOD, kind="prompt_group"), "kind"),
        (repack(GOOD, extra_field=1), "extra_field"),
        (repack(GOOD, reward=_DELETE), "reward"),
        (repack(GOOD, reward="high"), "reward"),
        (repack(GOOD, completion_tokens=["<f4", 10, b"\x00" * 40]), "completion_tokens"),  # wrong dtype
        (repack(GOOD, completion_tokens=[">i4", 10, b"\x00" * 40]), "completion_tokens"),  # big-endian
        (repack(GOOD, completion_tokens=["<i4", 10, b"\x00" * 39]), "completion_tokens"),  # byte count
        (repack(GOOD, completion_tokens=["<i4", 11, b"\x00" * 40]), "completion_tokens"),  # length lies
        (repack(GOOD, completion_tokens=["<i4", -1, b""]), "completion_tokens"),
        (repack(GOOD, completion_tokens=["<i4", 10, "not bytes"]), "completion_tokens"),
        (repack(GOOD, completion_tokens=b"\x00" * 40), "completion_tokens"),
        (repack(GOOD, behavior_logprobs=["<f4", 10, np.full(10, np.inf, "<f4").tobytes()]), "behavior_logprobs"),
        (repack(GOOD, behavior_logprobs=["<f4", 9, b"\x00" * 36]), "behavior_logprobs"),  # length != tokens
        (repack(GOOD, info={"nested": {"a": 1}}), "info['nested']"),
        (repack(GOOD, sample_index=10), "sample_index"),
    ],
)
def test_decode_rejects_malformed_input_naming_the_field(data, field):
    with pytest.raises(CodecError) as e:
        decode_trajectory(data)
    assert e.value.field == field, str(e.value)


def test_decode_rejects_non_bytes():
    with pytest.raises(CodecError, match="want bytes"):
        decode_trajectory(None)


def test_decode_limits_apply_before_and_during_unpacking():
    big = encode_trajectory(make_traj(n_completion=2000))
    with pytest.raises(CodecError, match="bytes > limit"):
        decode_trajectory(big, CodecLimits(max_message_bytes=len(big) - 1))
    with pytest.raises(CodecError) as e:  # msgpack's own max_bin_len trips first
        decode_trajectory(big, CodecLimits(max_tokens=1000, max_message_bytes=3000))
    assert e.value.field == "message"
    with pytest.raises(CodecError) as e:  # a bin may be as large as the message (routed_experts): the length check
        decode_trajectory(big, CodecLimits(max_tokens=1000))
    assert e.value.field == "completion_tokens"
    with pytest.raises(CodecError) as e:  # declared length over the limit, small payload
        decode_trajectory(repack(GOOD, completion_tokens=["<i4", 5000, b""]), CodecLimits(max_tokens=4096))
    assert e.value.field == "completion_tokens"
    many = {f"k{i}": i for i in range(100)}
    with pytest.raises(CodecError):
        decode_trajectory(repack(GOOD, info=many))  # map larger than max_dict_items
    long_str = repack(GOOD, sample_id="x" * 300)
    with pytest.raises(CodecError) as e:
        decode_trajectory(long_str)
    assert e.value.field == "sample_id"
    deep = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(CodecError):
        decode_trajectory(deep)


def test_decode_prompt_group_rejects_a_trajectory():
    with pytest.raises(CodecError) as e:
        decode_prompt_group(GOOD)
    assert e.value.field == "kind"


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_raise_only_codec_error(data):
    for decode in (decode_trajectory, decode_prompt_group):
        try:
            decode(data)
        except CodecError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(GOOD) - 1), st.integers(0, 255))
def test_single_byte_corruptions_raise_only_codec_error_or_decode(pos, value):
    data = bytearray(GOOD)
    data[pos] = value
    try:
        t = decode_trajectory(bytes(data))
    except CodecError:
        return
    # a corruption inside an array payload or a scalar can still be a valid message
    assert t.completion_tokens.shape[0] == t.behavior_logprobs.shape[0]


# ------------------------------------------------------------------ token versions (schema 2)


def test_token_versions_round_trip_and_oldest_version():
    t = make_traj(n_completion=5, policy_version=9, token_versions=[7, 7, 8, 9, 9])
    u = decode_trajectory(encode_trajectory(t))
    assert u.token_versions.dtype == np.dtype("<u4") and u.token_versions.tolist() == [7, 7, 8, 9, 9]
    assert (u.policy_version, u.oldest_version) == (9, 7)
    # None: every token at policy_version (drain-on-swap); an empty completion's oldest is policy_version.
    assert make_traj(n_completion=3).token_versions.tolist() == [7, 7, 7]
    empty = make_traj(n_completion=0)
    assert empty.token_versions.size == 0 and empty.oldest_version == 7


def test_a_schema_1_trajectory_decodes_with_every_token_at_its_policy_version():
    data = repack(
        encode_trajectory(make_traj(n_completion=4)), schema=1, token_versions=_DELETE, routed_experts=_DELETE
    )
    u = decode_trajectory(data)
    assert u.token_versions.tolist() == [7, 7, 7, 7] and u.oldest_version == 7
    with pytest.raises(CodecError) as e:  # schema 1 never had the field
        decode_trajectory(repack(encode_trajectory(make_traj(n_completion=4)), schema=1, routed_experts=_DELETE))
    assert e.value.field == "token_versions"
    assert SCHEMA_VERSION == 4


@pytest.mark.parametrize(
    "versions, message",
    [
        ([7, 6, 7], "must be non-decreasing"),
        ([5, 6, 6], "last token's version 6 != policy_version 7"),
        ([7, 7], "want shape (3,)"),
        ([-1, 7, 7], "versions in [-1, 7]"),
        ([7.0, 7.0, 7.0], "want integer versions"),
    ],
)
def test_bad_token_versions_are_refused_with_one_line(versions, message):
    with pytest.raises(CodecError) as e:
        make_traj(n_completion=3, token_versions=np.array(versions))
    assert e.value.field == "token_versions" and message in str(e.value)
    # The same on the wire: the decoder refuses what a well-behaved encoder would not write.
    good = encode_trajectory(make_traj(n_completion=3))
    raw = np.array(versions).astype("<u4").tobytes() if message != "want integer versions" else b"\0" * 12
    with pytest.raises(CodecError) as e:
        decode_trajectory(repack(good, token_versions=["<u4", len(versions), raw]))
    assert e.value.field == "token_versions"


def test_token_versions_on_the_wire_have_one_dtype_and_their_byte_count():
    good = encode_trajectory(make_traj(n_completion=3))
    for value in (["<i4", 3, b"\0" * 12], ["<u4", 3, b"\0" * 8]):
        with pytest.raises(CodecError) as e:
            decode_trajectory(repack(good, token_versions=value))
        assert e.value.field == "token_versions"


def test_the_trajectory_signature_covers_token_versions():
    """broker.signing tags the encoded bytes: another token_versions is another payload."""
    from broker.signing import TRAJECTORY, Signer

    signer = Signer(b"k" * 32)
    a = encode_trajectory(make_traj(n_completion=3, policy_version=7, token_versions=[6, 7, 7]))
    b = encode_trajectory(make_traj(n_completion=3, policy_version=7, token_versions=[7, 7, 7]))
    assert signer.verify(TRAJECTORY, a, signer.sign(TRAJECTORY, a))
    assert not signer.verify(TRAJECTORY, b, signer.sign(TRAJECTORY, a))


# ------------------------------------------------------------------ routed experts (schema 3)


def _routes(n: int, layers: int = 3, k: int = 2, dtype=np.uint8) -> np.ndarray:
    return (np.arange(n * layers * k).reshape(n, layers, k) % 200).astype(dtype)


def test_routed_experts_round_trip_uint8_and_uint16():
    for dtype, wire in ((np.uint8, "|u1"), (np.int64, "<u2")):
        r = _routes(4, dtype=dtype) + (0 if dtype == np.uint8 else 300)
        u = decode_trajectory(encode_trajectory(make_traj(n_completion=4, routed_experts=r)))
        assert u.routed_experts.dtype == np.dtype(wire) and u.routed_experts.shape == (4, 3, 2)
        assert u.routed_experts.tolist() == r.tolist()
    assert decode_trajectory(encode_trajectory(make_traj(n_completion=4))).routed_experts is None


def test_schema_2_trajectories_decode_without_routed_experts():
    data = repack(encode_trajectory(make_traj(n_completion=4)), schema=2, routed_experts=_DELETE)
    assert decode_trajectory(data).routed_experts is None
    with pytest.raises(CodecError) as e:  # schema 2 never had the field
        decode_trajectory(repack(encode_trajectory(make_traj(n_completion=4)), schema=2))
    assert e.value.field == "routed_experts"


@pytest.mark.parametrize(
    "routes, message",
    [
        (np.zeros((3, 2, 2), np.uint8), "want shape (4, layers, k)"),  # one row per completion token
        (np.zeros((4, 2), np.uint8), "want shape (4, layers, k)"),
        (np.zeros((4, 0, 2), np.uint8), "want 1..1024 layers"),
        (np.zeros((4, 2, 65), np.uint8), "1..64 ids"),
        (np.zeros((4, 2, 2), np.float32), "want integer expert ids"),
        (np.full((4, 2, 2), 70000), "expert ids must be in [0, 65535]"),
    ],
)
def test_bad_routed_experts_are_refused_with_one_line(routes, message):
    with pytest.raises(CodecError) as e:
        make_traj(n_completion=4, routed_experts=routes)
    assert e.value.field == "routed_experts" and message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "value, message",
    [
        (["|u1", [4, 3, 2], b"\0" * 23], "23 bytes for shape [4, 3, 2]"),
        (["<u4", [4, 3, 2], b"\0" * 96], "dtype '<u4'"),
        (["|u1", [4, 3], b"\0" * 12], "want [n, layers, k]"),
        (["|u1", [4, -3, 2], b"\0" * 24], "want [n, layers, k]"),
        (["|u1", [5, 3, 2], b"\0" * 30], "want shape (4, layers, k)"),
        (["|u1", [4, 3, 2]], "want nil or"),
    ],
)
def test_routed_experts_on_the_wire_are_checked(value, message):
    good = encode_trajectory(make_traj(n_completion=4, routed_experts=_routes(4)))
    with pytest.raises(CodecError) as e:
        decode_trajectory(repack(good, routed_experts=value))
    assert e.value.field == "routed_experts" and message in str(e.value)


def test_the_trajectory_signature_covers_routed_experts():
    from broker.signing import TRAJECTORY, Signer

    signer = Signer(b"k" * 32)
    r = _routes(3)
    a = encode_trajectory(make_traj(n_completion=3, routed_experts=r))
    r2 = r.copy()
    r2[1, 2, 0] ^= 1
    b = encode_trajectory(make_traj(n_completion=3, routed_experts=r2))
    assert signer.verify(TRAJECTORY, a, signer.sign(TRAJECTORY, a))
    assert not signer.verify(TRAJECTORY, b, signer.sign(TRAJECTORY, a))


# ------------------------------------------------------------------ min_version (schema 4)


def test_prompt_groups_carry_min_version_and_schema_3_ones_decode_without_it():
    assert decode_prompt_group(encode_prompt_group(make_prompt(min_version=7))).min_version == 7
    old = repack(encode_prompt_group(make_prompt(min_version=7)), schema=3, min_version=_DELETE)
    assert decode_prompt_group(old).min_version == 0  # any version may start it
    with pytest.raises(CodecError) as e:  # schema 3 never had the field
        decode_prompt_group(repack(encode_prompt_group(make_prompt()), schema=3))
    assert e.value.field == "min_version"
    for bad in (-1, 2**32, "3", True):
        with pytest.raises(CodecError) as e:
            decode_prompt_group(repack(encode_prompt_group(make_prompt()), min_version=bad))
        assert e.value.field == "min_version"
