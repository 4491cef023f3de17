"""TP shards of published tensors: the bytes a rank receives, cutting them, viewing them as a format object.

Published tensors are full logical tensors in canonical layout ([out_features, in_features]). A rank
of any TP degree receives only its slice: `tensor_layout` is its shape, parts and byte size under
the manifest's TP plan (policy.tp), `shard_tensor_bytes` cuts a full tensor's bytes down to it, and
`rebuild` views received bytes as the policy.formats object without copying them. `DTYPES` are the
part dtypes a manifest may carry (the dtypes policy/formats produces): nothing else is decoded.
`check_tp_compatible` refuses a TP degree the contract pins (`shard` activation scales).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import torch

from policy import formats
from policy.tp import ShardCut, TPPlan, from_parts_kwargs, part_index
from tandem.v1 import manifest_pb2 as pb

# Part dtypes a manifest may carry (the dtypes policy/formats produces). Nothing else is decoded.
DTYPES: dict[str, torch.dtype] = {
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int32": torch.int32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class PartLayout:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorLayout:
    """Byte layout of the (shard of a) tensor a rank receives."""

    name: str
    shape: tuple[int, int]
    parts: tuple[PartLayout, ...]
    nbytes: int
    cut: ShardCut
    sharded: bool  # False: the bytes are the full tensor's (tp_size 1 or a replicated tensor)


def tp_plan_of(manifest: pb.Manifest) -> TPPlan:
    return TPPlan(rules=tuple((r.pattern, r.style) for r in manifest.contract.tp_plan.rules))


def check_tp_compatible(manifest: pb.Manifest, tp_size: int) -> None:
    """Refuse a TP degree the contract does not allow (`shard` activation scales pin the partition)."""
    pinned = manifest.contract.tp_plan.partition_tp_size
    if pinned and pinned != tp_size:
        shard_sites = [s.name for s in manifest.contract.activation_sites if s.tp_scale_mode == "shard"]
        raise ValueError(
            f"policy version {manifest.version}: activation sites use tp_scale_mode 'shard' "
            f"({len(shard_sites)} sites, e.g. {shard_sites[:1]}), so the contract pins the trainer's "
            f"partition tp_size={pinned}; this rollout has tp_size={tp_size}"
        )


def format_params(entry: pb.TensorEntry) -> dict:
    return json.loads(entry.format_params_json)


def tensor_layout(entry: pb.TensorEntry, plan: TPPlan, tp_rank: int = 0, tp_size: int = 1) -> TensorLayout:
    """What rank `tp_rank` of `tp_size` receives for this entry (validated against the TP plan)."""
    cut = plan.cut(
        entry.name,
        fmt=entry.format,
        kwargs=format_params(entry),
        shape=tuple(entry.shape),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    sharded = cut.shape != tuple(entry.shape)
    parts, offset = [], 0
    for p in entry.parts:
        shape = tuple(p.shape)
        if sharded:
            # Apply the index to a zero-stride stand-in of the part: shapes only, nothing allocated.
            ghost = np.broadcast_to(np.zeros((), np.uint8), shape)
            idx = part_index(shape, tuple(entry.shape), cut, name=f"{entry.name}:{p.name}")
            pieces = [ghost[i].shape for i in idx]
            shape = (sum(s[0] for s in pieces), *pieces[0][1:])
        nbytes = math.prod(shape) * DTYPES[p.dtype].itemsize
        parts.append(PartLayout(p.name, p.dtype, shape, offset, nbytes))
        offset += nbytes
    return TensorLayout(entry.name, cut.shape, tuple(parts), offset, cut, sharded)


def shard_tensor_bytes(entry: pb.TensorEntry, data, layout: TensorLayout) -> bytes:
    """Cut a full tensor's bytes (parts concatenated) down to `layout` (from tensor_layout)."""
    if not layout.sharded:
        return bytes(data)
    out = []
    for p in entry.parts:
        item = DTYPES[p.dtype].itemsize
        raw = np.frombuffer(data, dtype=np.uint8, count=p.nbytes, offset=p.offset)
        # View each element as `item` bytes along a trailing axis: slicing in elements, copying bytes.
        arr = raw.reshape(*p.shape, item)
        for idx in part_index(tuple(p.shape), tuple(entry.shape), layout.cut, name=f"{entry.name}:{p.name}"):
            out.append(np.ascontiguousarray(arr[idx]).reshape(-1))
    result = np.concatenate(out).tobytes() if out else b""
    if len(result) != layout.nbytes:
        raise AssertionError(f"{entry.name}: shard has {len(result)} bytes, layout says {layout.nbytes}")
    return result


def rebuild(entry: pb.TensorEntry, layout: TensorLayout, data):
    """The quantized object (policy.formats from_parts) over `data` (a writable buffer: bytearray or
    uint8 numpy array), without copying it."""
    if len(data) != layout.nbytes:
        raise ValueError(f"tensor {entry.name}: {len(data)} bytes, layout says {layout.nbytes}")
    if isinstance(data, np.ndarray):
        buf = torch.from_numpy(data.view(np.uint8).reshape(-1))
    else:
        buf = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
    parts = {}
    for p in layout.parts:
        raw = buf[p.offset : p.offset + p.nbytes]
        if p.offset % DTYPES[p.dtype].itemsize:  # view(dtype) needs an aligned start
            raw = raw.clone()
        parts[p.name] = raw.view(DTYPES[p.dtype]).reshape(p.shape)
    return formats.get(entry.format).from_parts(
        parts, layout.shape, **from_parts_kwargs(entry.format, format_params(entry))
    )
