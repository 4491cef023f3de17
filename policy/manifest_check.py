"""Is a manifest one this rollout can load? Checked completely before anything is allocated.

A consistent manifest (`verify_manifest`) can still be unloadable or hostile, so `check_manifest`
compares every entry with what this rollout's own contract implies:

    names          == the plan's parameter names (none missing, none extra)
    format, params == the plan entry's format and quantize kwargs
    shape          == the parameter's [M, K] (1-D parameters as [1, D])
    parts          == (name, dtype, shape) of what the format's quantizer produces for that shape
    total_bytes    == the sum those imply, and <= max_total_bytes

The expected parts come from quantizing a zero tensor of each distinct (format, kwargs, shape) once
per worker (`expected_tensors`). A manifest that fails is refused with `ManifestRefused`, naming every
problem (up to 10); `check_values` refuses verified bytes holding values no quantizer produces
(policy.formats.values) with `ValuesRefused`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from policy import manifest as mf
from policy.formats.params import quantize_param
from policy.formats.values import invalid_values
from policy.hashing import canonical_json
from policy.recipe import Plan
from policy.tp_layout import TensorLayout
from tandem.v1 import manifest_pb2 as pb


class ManifestRefused(ValueError):
    """A manifest that this worker's contract cannot load (a permanent property of that version)."""


class ValuesRefused(ManifestRefused):
    """Verified bytes holding values no quantizer produces: as permanent as the version's content."""


@dataclass(frozen=True)
class ExpectedTensor:
    format: str
    params: dict  # the quantize kwargs, as canonical JSON decodes them
    shape: tuple[int, int]
    parts: tuple[tuple[str, str, tuple[int, ...]], ...]  # (name, dtype, shape) in order
    nbytes: int


def expected_tensors(plan: Plan) -> dict[str, ExpectedTensor]:
    """Tensor name -> what a manifest for `plan` must declare for it."""
    out: dict[str, ExpectedTensor] = {}
    seen: dict[tuple, ExpectedTensor] = {}
    for e in plan.params:
        shape = (1, e.shape[0]) if len(e.shape) == 1 else tuple(e.shape)
        params_json = canonical_json(e.kwargs)
        key = (e.format, params_json, shape)
        if key not in seen:
            q = quantize_param(torch.zeros(shape), e.format, **e.kwargs).value
            parts = tuple((n, mf._DTYPE_NAMES[t.dtype], tuple(t.shape)) for n, t in q.parts().items())
            nbytes = sum(t.numel() * t.element_size() for t in q.parts().values())
            seen[key] = ExpectedTensor(e.format, json.loads(params_json), tuple(q.shape), parts, nbytes)
        out[e.name] = seen[key]
    return out


def check_manifest(m: pb.Manifest, expected: dict[str, ExpectedTensor], *, max_total_bytes: int) -> None:
    """Raise ManifestRefused unless `m` is internally consistent and matches `expected` exactly."""
    try:
        mf.verify_manifest(m)
    except ValueError as e:
        raise ManifestRefused(str(e)) from None
    bad: list[str] = []
    names = {t.name for t in m.tensors}
    missing, extra = sorted(set(expected) - names), sorted(names - set(expected))
    if missing:
        bad.append(f"{len(missing)} tensor(s) missing, e.g. {missing[:3]}")
    if extra:
        bad.append(f"{len(extra)} tensor(s) not in this worker's plan, e.g. {[n[:80] for n in extra[:3]]}")
    for t in m.tensors:
        want = expected.get(t.name)
        if want is None:
            continue
        try:
            params = json.loads(t.format_params_json)
        except ValueError:
            params = None
        got_parts = tuple((p.name, p.dtype, tuple(p.shape)) for p in t.parts)
        for what, got, exp in (
            ("format", t.format, want.format),
            ("format params", params, want.params),
            ("shape", tuple(t.shape), want.shape),
            ("parts", got_parts, want.parts),
        ):
            if got != exp:
                bad.append(f"tensor {t.name}: {what} {str(got)[:200]}, this worker's contract says {exp}")
        if len(bad) > 10:
            break
    want_total = sum(e.nbytes for e in expected.values())
    if not bad and m.total_bytes != want_total:
        bad.append(f"total_bytes={m.total_bytes}, the contract implies {want_total}")
    if m.total_bytes > max_total_bytes:
        bad.append(f"total_bytes={m.total_bytes} > max_total_bytes={max_total_bytes}")
    if bad:
        raise ManifestRefused(f"policy version {m.version} refused: " + "; ".join(bad[:10]))


def check_values(version: int, fmt: str, layout: TensorLayout, data) -> None:
    """ValuesRefused, naming the tensor and each bad part, unless `data` (the bytes of a tensor or TP
    shard, laid out as `layout`) keeps the value rules of format `fmt` (policy.formats.values)."""
    raw = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8)
    bad = invalid_values(fmt, {p.name: raw[p.offset : p.offset + p.nbytes] for p in layout.parts})
    if bad:
        raise ValuesRefused(f"policy version {version} refused: tensor {layout.name}: " + "; ".join(bad))
