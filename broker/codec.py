"""Wire codec for the two Redis messages: `PromptGroup` (prompts stream) and `Trajectory`.

Format: one msgpack map per message with `schema` (`SCHEMA_VERSION`), `kind` ("prompt_group" or
"trajectory") and the dataclass's fields under their own names. Numeric arrays travel as
`[dtype, length, raw little-endian bytes]` (`routed_experts`: `[dtype, [n, layers, k], bytes]`), one
fixed dtype each (token ids int32, log-probs float32, token versions uint32, expert ids uint8 for
<= 256 experts else uint16), checked for dtype and byte count before a zero-copy `np.frombuffer`;
decoded arrays are read-only views. Nothing is ever unpickled.
Limits: a message over `max_message_bytes` is refused before unpacking; msgpack's limits bound every
string, binary, array and map; ext types, unknown keys and unknown schemas are refused. Schema 4 is
written; schema 1 (no `token_versions`: every token at `policy_version`), 2 (no `routed_experts`) and
3 (prompt groups without `min_version`: any) are read. Every decode failure raises `CodecError` (a
ValueError) naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from policy.fields import is_int

SCHEMA_VERSION = 4  # what encode writes; decode accepts _SCHEMAS
_UINT32_MAX = 2**32 - 1
_INT32_MAX = 2**31 - 1
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_MAX_GROUP_SIZE = 4096
_MAX_DICT_KEY_CHARS = 64
_MAX_MOE_LAYERS, _MAX_TOP_K = 1024, 64  # bounds of routed_experts' layer and k axes
_ROUTE_DTYPES = ("|u1", "<u2")


class CodecError(ValueError):
    """A message (or a message under construction) is invalid; `.field` names the culprit."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


@dataclass(frozen=True, kw_only=True)
class CodecLimits:
    max_message_bytes: int = 4 << 20
    max_tokens: int = 1 << 18  # per token array (prompt or completion)
    max_id_chars: int = 256  # ids, fingerprints, worker ids
    max_dict_items: int = 64  # Trajectory.info, PromptGroup.task
    max_dict_str_chars: int = 16384  # one string value in info/task (e.g. a reference answer)

    def __post_init__(self) -> None:
        bad = [
            f"{name}={getattr(self, name)!r}"
            for name in ("max_message_bytes", "max_tokens", "max_id_chars", "max_dict_items", "max_dict_str_chars")
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0
        ]
        if bad:
            raise ValueError("CodecLimits: want positive ints: " + ", ".join(bad))


DEFAULT_LIMITS = CodecLimits()


def sample_id_for(group_id: str, index: int) -> str:
    """The run-unique, deterministic sample id: a regenerated group gets the same ids,
    so the trainer's idempotency keys count a re-delivered prompt's samples once."""
    return f"{group_id}/{index}"


# ---------------------------------------------------------------- value checks


def _str(name: str, value: Any, max_chars: int, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise CodecError(name, f"want str, got {type(value).__name__}")
    if not allow_empty and not value:
        raise CodecError(name, "empty")
    if len(value) > max_chars:
        raise CodecError(name, f"{len(value)} characters > limit {max_chars}")
    return value


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise CodecError(name, f"want int, got {type(value).__name__}")
    value = int(value)
    if not lo <= value <= hi:
        raise CodecError(name, f"{value} outside [{lo}, {hi}]")
    return value


def _float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise CodecError(name, f"want a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise CodecError(name, f"{value} is not finite")
    return value


def _array(name: str, value: Any) -> np.ndarray:
    try:
        return np.asarray(value)
    except Exception as e:  # e.g. a CUDA or grad-requiring torch tensor
        raise CodecError(name, f"not convertible to an array ({e})") from None


def _tokens(name: str, value: Any, *, allow_empty: bool) -> np.ndarray:
    arr = _array(name, value)
    if arr.ndim != 1:
        raise CodecError(name, f"want a 1-D array, got shape {arr.shape}")
    if not allow_empty and arr.size == 0:
        raise CodecError(name, "empty")
    if arr.dtype != np.dtype("<i4"):
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype("<i4")  # np.asarray([]) is float64
        if arr.dtype.kind not in "iu":
            raise CodecError(name, f"want integer token ids, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX):
        raise CodecError(name, f"token ids must be in [0, {_INT32_MAX}]")
    return np.ascontiguousarray(arr, dtype="<i4")


def _logprobs(name: str, value: Any, n: int) -> np.ndarray:
    arr = _array(name, value)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise CodecError(name, f"want shape ({n},) (one per completion token), got {arr.shape}")
    if arr.size == 0 and arr.dtype.kind != "f":
        arr = arr.astype("<f4")
    if arr.dtype.kind != "f":
        raise CodecError(name, f"want floating point, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype="<f4")
    if not np.isfinite(arr).all():
        raise CodecError(name, "contains non-finite values")
    return arr


def _token_versions(value: Any, n: int, policy_version: int) -> np.ndarray:
    """Rules: one version per completion token, uint32, non-decreasing (a sample only moves to newer
    versions), the last one = policy_version (the newest); None = every token at policy_version."""
    name = "token_versions"
    if value is None:
        if n == 0:
            return np.zeros(0, dtype="<u4")
        if policy_version > _UINT32_MAX:
            raise CodecError(name, f"policy_version {policy_version} > {_UINT32_MAX} (a token version is uint32)")
        return np.full(n, policy_version, dtype="<u4")
    arr = _array(name, value)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise CodecError(name, f"want shape ({n},) (one per completion token), got {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<u4")
    if arr.dtype.kind not in "iu":
        raise CodecError(name, f"want integer versions, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > _UINT32_MAX:
        raise CodecError(name, f"versions in [{lo}, {hi}], want [0, {_UINT32_MAX}]")
    arr = np.ascontiguousarray(arr, dtype="<u4")
    if n > 1 and bool((arr[1:] < arr[:-1]).any()):
        raise CodecError(name, "must be non-decreasing (a sample moves only to newer versions)")
    if int(arr[-1]) != policy_version:
        raise CodecError(name, f"last token's version {int(arr[-1])} != policy_version {policy_version} (the newest)")
    return arr


def _routed_experts(value: Any, n: int) -> np.ndarray | None:
    """Rules: None (not recorded), or [n, layers, k] unsigned ids, one row per completion token,
    1 <= layers <= 1024, 1 <= k <= 64; uint8 kept, other integer arrays stored as uint16."""
    name = "routed_experts"
    if value is None:
        return None
    arr = _array(name, value)
    if arr.ndim != 3 or arr.shape[0] != n:
        raise CodecError(name, f"want shape ({n}, layers, k) (one row per completion token), got {arr.shape}")
    if not (1 <= arr.shape[1] <= _MAX_MOE_LAYERS and 1 <= arr.shape[2] <= _MAX_TOP_K):
        raise CodecError(name, f"shape {arr.shape}: want 1..{_MAX_MOE_LAYERS} layers and 1..{_MAX_TOP_K} ids")
    if arr.dtype.kind not in "iu":
        raise CodecError(name, f"want integer expert ids, got dtype {arr.dtype}")
    if arr.dtype == np.uint8:
        return np.ascontiguousarray(arr)
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 0xFFFF):
        raise CodecError(name, "expert ids must be in [0, 65535]")
    return np.ascontiguousarray(arr, dtype="<u2")


def _small_dict(name: str, value: Any, limits: CodecLimits) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise CodecError(name, f"want dict, got {type(value).__name__}")
    if len(value) > limits.max_dict_items:
        raise CodecError(name, f"{len(value)} items > limit {limits.max_dict_items}")
    out: dict[str, Any] = {}
    for k, v in value.items():
        if not isinstance(k, str) or not 0 < len(k) <= _MAX_DICT_KEY_CHARS:
            raise CodecError(name, f"key {k!r}: want a str of 1..{_MAX_DICT_KEY_CHARS} characters")
        where = f"{name}[{k!r}]"
        if v is None or isinstance(v, (bool, float)):
            out[k] = v
        elif isinstance(v, (int, np.integer)):
            out[k] = _int(where, v, _INT64_MIN, _INT64_MAX)
        elif isinstance(v, np.floating):
            out[k] = float(v)
        elif isinstance(v, str):
            out[k] = _str(where, v, limits.max_dict_str_chars, allow_empty=True)
        else:
            raise CodecError(where, f"want None/bool/int/float/str, got {type(v).__name__}")
    return out


# ---------------------------------------------------------------- messages

# Construction checks types and meaning; sizes are checked against the caller's limits by
# encode/decode (a receiver may be configured with larger limits than the default).
_UNBOUNDED = CodecLimits(max_id_chars=1 << 30, max_dict_items=1 << 30, max_dict_str_chars=1 << 30)


@dataclass(frozen=True, kw_only=True, eq=False)
class PromptGroup:
    """One prompt to be sampled `n_samples` times (one GRPO group).

    prompt_id: the dataset item (the same prompt may be scheduled again in a later epoch);
    group_id: run-unique id of this scheduling of it, and the prefix of its sample ids.
    task: what the reward function needs (e.g. {"kind": "arith", "answer": "42"}).
    min_version: the oldest policy version a rollout may start the group under (0: any). The trainer
    sets it when it feeds the group (trainer.feeding.min_start_version).
    """

    prompt_id: str
    group_id: str
    prompt_tokens: np.ndarray
    n_samples: int
    task: dict[str, Any] = field(default_factory=dict)
    created_at: float = 0.0
    min_version: int = 0

    def __post_init__(self) -> None:
        _str("prompt_id", self.prompt_id, _UNBOUNDED.max_id_chars)
        _str("group_id", self.group_id, _UNBOUNDED.max_id_chars)
        object.__setattr__(self, "prompt_tokens", _tokens("prompt_tokens", self.prompt_tokens, allow_empty=False))
        object.__setattr__(self, "n_samples", _int("n_samples", self.n_samples, 1, _MAX_GROUP_SIZE))
        object.__setattr__(self, "task", _small_dict("task", self.task, _UNBOUNDED))
        object.__setattr__(self, "created_at", _float("created_at", self.created_at))
        object.__setattr__(self, "min_version", _int("min_version", self.min_version, 0, _UINT32_MAX))


@dataclass(frozen=True, kw_only=True, eq=False)
class Trajectory:
    """One sampled completion with everything the trainer needs.

    sample_id is the idempotency key (see `sample_id_for`). behavior_logprobs[i] is the
    rollout policy's log-probability of completion_tokens[i]; float32 on the wire.
    token_versions[i] is the policy version that sampled completion_tokens[i] (uint32,
    non-decreasing; None at construction = all at policy_version). policy_version is the newest
    (the last token's), `oldest_version` the first token's; contract_fingerprint says which
    contract produced them. routed_experts[i, l, j] (routing replay, else None) is the j-th expert
    id the rollout's router picked at MoE layer l in the forward whose logits sampled
    completion_tokens[i] (uint8 or uint16, [n, layers, k]). info is a small flat dict for diagnostics (finish reason, timings, ...).
    """

    sample_id: str
    prompt_id: str
    group_id: str
    sample_index: int
    group_size: int
    prompt_tokens: np.ndarray
    completion_tokens: np.ndarray
    behavior_logprobs: np.ndarray
    reward: float
    policy_version: int
    contract_fingerprint: str
    worker_id: str
    created_at: float
    info: dict[str, Any] = field(default_factory=dict)
    token_versions: np.ndarray | None = None
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        for name in ("sample_id", "prompt_id", "group_id", "contract_fingerprint", "worker_id"):
            _str(name, getattr(self, name), _UNBOUNDED.max_id_chars)
        group_size = _int("group_size", self.group_size, 1, _MAX_GROUP_SIZE)
        object.__setattr__(self, "group_size", group_size)
        object.__setattr__(self, "sample_index", _int("sample_index", self.sample_index, 0, group_size - 1))
        object.__setattr__(self, "prompt_tokens", _tokens("prompt_tokens", self.prompt_tokens, allow_empty=False))
        completion = _tokens("completion_tokens", self.completion_tokens, allow_empty=True)
        object.__setattr__(self, "completion_tokens", completion)
        object.__setattr__(
            self, "behavior_logprobs", _logprobs("behavior_logprobs", self.behavior_logprobs, completion.shape[0])
        )
        object.__setattr__(self, "reward", _float("reward", self.reward))
        object.__setattr__(self, "policy_version", _int("policy_version", self.policy_version, 0, _INT64_MAX))
        versions = _token_versions(self.token_versions, completion.shape[0], self.policy_version)
        object.__setattr__(self, "token_versions", versions)
        object.__setattr__(self, "routed_experts", _routed_experts(self.routed_experts, completion.shape[0]))
        object.__setattr__(self, "created_at", _float("created_at", self.created_at))
        object.__setattr__(self, "info", _small_dict("info", self.info, _UNBOUNDED))

    @property
    def oldest_version(self) -> int:
        """The version of the first (oldest) token; policy_version for an empty completion."""
        return int(self.token_versions[0]) if self.token_versions.size else self.policy_version


_TRAJECTORY_FIELDS_V1 = (
    "sample_id",
    "prompt_id",
    "group_id",
    "sample_index",
    "group_size",
    "prompt_tokens",
    "completion_tokens",
    "behavior_logprobs",
    "reward",
    "policy_version",
    "contract_fingerprint",
    "worker_id",
    "created_at",
    "info",
)
_TRAJECTORY_FIELDS_V2 = (*_TRAJECTORY_FIELDS_V1, "token_versions")
_TRAJECTORY_FIELDS = (*_TRAJECTORY_FIELDS_V2, "routed_experts")
_PROMPT_FIELDS_V1 = ("prompt_id", "group_id", "prompt_tokens", "n_samples", "task", "created_at")
_PROMPT_FIELDS = (*_PROMPT_FIELDS_V1, "min_version")
# kind -> schema -> its fields (encode writes SCHEMA_VERSION's).
_SCHEMAS = {
    "trajectory": {1: _TRAJECTORY_FIELDS_V1, 2: _TRAJECTORY_FIELDS_V2, 3: _TRAJECTORY_FIELDS, 4: _TRAJECTORY_FIELDS},
    "prompt_group": {1: _PROMPT_FIELDS_V1, 2: _PROMPT_FIELDS_V1, 3: _PROMPT_FIELDS_V1, 4: _PROMPT_FIELDS},
}
_ARRAYS = {"prompt_tokens": "<i4", "completion_tokens": "<i4", "behavior_logprobs": "<f4", "token_versions": "<u4"}
_DICTS = ("info", "task")


# ---------------------------------------------------------------- encode


def _pack_array(name: str, arr: np.ndarray, limits: CodecLimits) -> list:
    if arr.shape[0] > limits.max_tokens:
        raise CodecError(name, f"length {arr.shape[0]} > limit {limits.max_tokens}")
    return [_ARRAYS[name], int(arr.shape[0]), arr.data]  # memoryview: no copy before packing


def _pack_routes(arr: np.ndarray | None, limits: CodecLimits) -> list | None:
    if arr is None:
        return None
    if arr.shape[0] > limits.max_tokens:
        raise CodecError("routed_experts", f"length {arr.shape[0]} > limit {limits.max_tokens}")
    return [arr.dtype.str, [int(d) for d in arr.shape], arr.data]


def _unpack_routes(value: Any, limits: CodecLimits) -> np.ndarray | None:
    """[dtype, [n, layers, k], bytes] -> a read-only array (the shape's rules: `_routed_experts`)."""
    name = "routed_experts"
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 3):
        raise CodecError(name, "want nil or [dtype, [n, layers, k], bytes]")
    dtype, shape, raw = value
    if dtype not in _ROUTE_DTYPES:
        raise CodecError(name, f"dtype {dtype!r}, want one of {list(_ROUTE_DTYPES)}")
    if not (isinstance(shape, list) and len(shape) == 3 and all(is_int(d, 0, limits.max_tokens) for d in shape)):
        raise CodecError(name, f"shape {shape!r}: want [n, layers, k] of ints in [0, {limits.max_tokens}]")
    if not isinstance(raw, bytes):
        raise CodecError(name, f"want bytes payload, got {type(raw).__name__}")
    want = math.prod(shape) * np.dtype(dtype).itemsize
    if len(raw) != want:
        raise CodecError(name, f"{len(raw)} bytes for shape {shape} x {dtype} (want {want})")
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def _encode(kind: str, obj: Any, names: tuple[str, ...], limits: CodecLimits) -> bytes:
    msg: dict[str, Any] = {"schema": SCHEMA_VERSION, "kind": kind}
    for name in names:
        value = getattr(obj, name)
        if name == "routed_experts":
            value = _pack_routes(value, limits)
        elif name in _ARRAYS:
            value = _pack_array(name, value, limits)
        elif name in _DICTS:
            value = _small_dict(name, value, limits)
        elif isinstance(value, str):
            _str(name, value, limits.max_id_chars)
        msg[name] = value
    data = msgpack.packb(msg, use_bin_type=True)
    if len(data) > limits.max_message_bytes:
        raise CodecError("message", f"{len(data)} bytes > limit {limits.max_message_bytes}")
    return data


def encode_trajectory(t: Trajectory, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    if not isinstance(t, Trajectory):
        raise CodecError("message", f"want Trajectory, got {type(t).__name__}")
    return _encode("trajectory", t, _TRAJECTORY_FIELDS, limits)


def encode_prompt_group(g: PromptGroup, limits: CodecLimits = DEFAULT_LIMITS) -> bytes:
    if not isinstance(g, PromptGroup):
        raise CodecError("message", f"want PromptGroup, got {type(g).__name__}")
    return _encode("prompt_group", g, _PROMPT_FIELDS, limits)


# ---------------------------------------------------------------- decode


def _unpack(data: Any, kind: str, limits: CodecLimits) -> dict[str, Any]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CodecError("message", f"want bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise CodecError("message", f"{len(data)} bytes > limit {limits.max_message_bytes}")
    max_str_bytes = 4 * max(limits.max_id_chars, limits.max_dict_str_chars, _MAX_DICT_KEY_CHARS)
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=max_str_bytes,
            max_bin_len=max(4 * limits.max_tokens, limits.max_message_bytes),
            max_array_len=3,  # only the [dtype, length, bytes] triples
            max_map_len=max(limits.max_dict_items, max(len(n) for n in _SCHEMAS[kind].values()) + 2),
            max_ext_len=0,
        )
    except ValueError as e:  # every msgpack decode error is a ValueError
        raise CodecError("message", f"not a valid msgpack message within limits ({type(e).__name__}: {e})") from None
    if not isinstance(msg, dict):
        raise CodecError("message", f"want a map, got {type(msg).__name__}")
    schema, schemas = msg.get("schema"), _SCHEMAS[kind]
    if isinstance(schema, bool) or not isinstance(schema, int) or schema not in schemas:
        raise CodecError("schema", f"got {schema!r}, this reader accepts {sorted(schemas)}")
    if msg.get("kind") != kind:
        raise CodecError("kind", f"got {msg.get('kind')!r}, want {kind!r}")
    names = schemas[schema]
    expected = set(names) | {"schema", "kind"}
    unknown = sorted(str(k) for k in msg.keys() - expected)
    if unknown:
        raise CodecError(unknown[0], f"unknown field(s) {unknown} for schema {schema}")
    missing = [n for n in names if n not in msg]
    if missing:
        raise CodecError(missing[0], "missing")
    out = {}
    for name in names:
        value = msg[name]
        if name == "routed_experts":
            value = _unpack_routes(value, limits)
        elif name in _ARRAYS:
            value = _unpack_array(name, value, limits)
        elif name in _DICTS:
            value = _small_dict(name, value, limits)
        elif isinstance(value, str):
            value = _str(name, value, limits.max_id_chars)
        out[name] = value
    return out


def _unpack_array(name: str, value: Any, limits: CodecLimits) -> np.ndarray:
    want = _ARRAYS[name]
    if not (isinstance(value, list) and len(value) == 3):
        raise CodecError(name, "want [dtype, length, bytes]")
    dtype, n, raw = value
    if dtype != want:
        raise CodecError(name, f"dtype {dtype!r}, want {want!r}")
    if not is_int(n, 0, limits.max_tokens):
        raise CodecError(name, f"length {n!r} outside [0, {limits.max_tokens}]")
    if not isinstance(raw, bytes):
        raise CodecError(name, f"want bytes payload, got {type(raw).__name__}")
    if len(raw) != n * 4:
        raise CodecError(name, f"{len(raw)} bytes for {n} x {want} (want {n * 4})")
    return np.frombuffer(raw, dtype=want)


def decode_trajectory(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> Trajectory:
    return Trajectory(**_unpack(data, "trajectory", limits))


def decode_prompt_group(data: bytes, limits: CodecLimits = DEFAULT_LIMITS) -> PromptGroup:
    return PromptGroup(**_unpack(data, "prompt_group", limits))
