"""The policy-version contract: the manifest of a published policy (DESIGN.md).

A published policy is immutable: (version, manifest, packed tensors). The manifest is the
protobuf message `tandem.v1.Manifest` (protos/tandem/v1/manifest.proto), serialized
deterministically. It holds:

- version, parent version, creation time;
- the `Contract`: model config (canonical JSON + sha256), recipe (name + full rules + sha256),
  quantizer spec version, activation sites (format, scope, TP scale mode) and the TP plan;
- per tensor: name, format, format params, logical shape, each part's dtype/shape/byte range,
  the fp32 global scale when there is one, the TP style, xxh3_64 per chunk and sha256 overall.

Every hash here is `policy.hashing.sha256_json` of a canonical JSON form: `model_config_sha256` is
`ModelConfig.fingerprint()` and `recipe_sha256` is `Recipe.fingerprint()` (what `tandem plan` prints).
`contract_fingerprint` is a sha256 over a canonical JSON form of the Contract (not over protobuf
bytes, so it cannot change with the protobuf library): everything trainer and rollout must agree
on, and nothing that changes per version (version, time, checksums). The TP degree is in it only
when an activation site uses `shard` scale mode (`partition_tp_size`); with `global` mode trainer
and rollout may differ in TP degree and still agree on the fingerprint.

A tensor's bytes are its parts (`q.parts()`, in the order the format lists them) concatenated,
each part as its raw little-endian element bytes. They are cut into chunks of `chunk_bytes`
(the last one shorter; an empty tensor has one empty chunk), the unit of transport and of xxh3.

Simplifications: the manifest is one message (a 48-layer, 128-expert model is ~4 MB, under
MAX_MANIFEST_BYTES); a tensor's `shape` is its quantized [M, K] shape, so 1-D parameters such
as norms are published as [1, D] by whoever quantizes them.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from policy import formats, kernels
from policy.hashing import canonical_json, sha256_hex
from policy.tp import TP_SCALE_MODES, ShardCut, TPPlan, check_tp, from_parts_kwargs, part_index
from tandem.v1 import manifest_pb2 as pb

SCHEMA_VERSION = 1
CHUNK_BYTES = 1 << 20  # at most 1 MiB of tensor bytes per chunk (and per gRPC message)
MAX_MANIFEST_BYTES = 64 << 20
MAX_NAME_CHARS = 512

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
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class FingerprintMismatch(ValueError):
    """A policy's contract fingerprint differs from the one this side was configured for."""

    def __init__(self, *, expected: str, got: str, version: int | None = None):
        self.expected, self.got, self.version = expected, got, version
        what = f"policy version {version}" if version is not None else "policy"
        super().__init__(
            f"{what} has contract fingerprint {got} but this side expects {expected}: trainer and "
            f"rollout disagree on model config, recipe, quantizer spec, activation scale scopes or TP plan"
        )


class ChecksumMismatch(ValueError):
    """Bytes do not match the xxh3 / sha256 the manifest (or a chunk) declares."""


# -- the contract ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ActivationSite:
    """How one activation site is quantized per token, and how its scale behaves under TP."""

    name: str
    format: str
    scope: str = "row"
    tp_scale_mode: str = "global"

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.name, str) or not self.name.endswith(".input"):
            bad.append(f"name={self.name!r} must be a weight name with '.weight' replaced by '.input'")
        if self.format not in formats.FORMATS:
            bad.append(f"format={self.format!r} is not one of {formats.FORMATS}")
        if not isinstance(self.scope, str):
            bad.append(f"scope={self.scope!r} must be a string")
        if self.tp_scale_mode not in TP_SCALE_MODES:
            bad.append(f"tp_scale_mode={self.tp_scale_mode!r} is not one of {TP_SCALE_MODES}")
        if bad:
            raise ValueError("invalid ActivationSite: " + "; ".join(bad))


@dataclass(frozen=True, kw_only=True)
class Contract:
    """Everything trainer and rollout must agree on. Both sides build one from their own config;
    the rollout refuses a policy whose fingerprint differs from its own contract's.

    `model_config`: a mapping or an object with `to_dict()` (policy.model.ModelConfig).
    `recipe_rules`: the full rules (`Recipe.to_dict()`). `trainer_tp_size` matters only when an
    activation site uses `shard` scale mode: then it becomes the TP degree both sides must use.
    """

    model_config: Any
    recipe_name: str
    recipe_rules: Any
    activation_sites: Sequence[ActivationSite] = ()
    tp_plan: TPPlan = field(default_factory=TPPlan)
    trainer_tp_size: int = 1
    quantizer_spec_version: str = formats.SPEC_VERSION

    def __post_init__(self) -> None:
        bad = []
        for attr in ("model_config", "recipe_rules"):
            try:
                canonical_json(getattr(self, attr))
            except ValueError as e:
                bad.append(f"{attr}: {e}")
        if not isinstance(self.recipe_name, str) or not self.recipe_name:
            bad.append(f"recipe_name={self.recipe_name!r} must be a non-empty string")
        if not isinstance(self.quantizer_spec_version, str) or not self.quantizer_spec_version:
            bad.append(f"quantizer_spec_version={self.quantizer_spec_version!r} must be a non-empty string")
        sites = tuple(sorted(self.activation_sites, key=lambda s: s.name))
        if any(not isinstance(s, ActivationSite) for s in sites):
            bad.append("activation_sites must be ActivationSite objects")
        names = [s.name for s in sites]
        dup = sorted({n for n in names if names.count(n) > 1}) if len(set(names)) != len(names) else []
        if dup:
            bad.append(f"activation sites named twice: {dup[:5]}")
        if not isinstance(self.tp_plan, TPPlan):
            bad.append(f"tp_plan must be a TPPlan, got {type(self.tp_plan).__name__}")
        try:
            check_tp(0, self.trainer_tp_size)
        except ValueError as e:
            bad.append(f"trainer_tp_size: {e}")
        if bad:
            raise ValueError("invalid Contract: " + "; ".join(bad))
        object.__setattr__(self, "activation_sites", sites)

    @property
    def partition_tp_size(self) -> int:
        """The TP degree both sides must use (0: any). Pinned by a `shard`-mode site whose format has
        a per-token scale spanning blocks (nvfp4); other formats' scales are block-local, so their
        bytes do not depend on the partition."""
        pinned = any(s.tp_scale_mode == "shard" and s.format == "nvfp4" for s in self.activation_sites)
        return self.trainer_tp_size if pinned else 0

    def to_proto(self) -> pb.Contract:
        model_json = canonical_json(self.model_config)
        rules_json = canonical_json(self.recipe_rules)
        return pb.Contract(
            model_config_json=model_json,
            model_config_sha256=sha256_hex(model_json),
            recipe_name=self.recipe_name,
            recipe_rules_json=rules_json,
            recipe_sha256=recipe_sha256(rules_json),
            quantizer_spec_version=self.quantizer_spec_version,
            activation_sites=[
                pb.ActivationSite(name=s.name, format=s.format, scope=s.scope, tp_scale_mode=s.tp_scale_mode)
                for s in self.activation_sites
            ],
            tp_plan=pb.TpPlan(
                rules=[pb.TpRule(pattern=p, style=s) for p, s in self.tp_plan.rules],
                partition_tp_size=self.partition_tp_size,
            ),
        )

    def fingerprint(self) -> str:
        return contract_fingerprint(self.to_proto())


def contract_from_recipe(
    *, model_config, recipe, tp_scale_mode: str = "global", trainer_tp_size: int = 1, tp_plan: TPPlan | None = None
) -> Contract:
    """The contract of a model config under a policy.recipe.Recipe: its quantized activation sites
    get `tp_scale_mode`; the rules are `recipe.to_dict()` without the free-text description."""
    rules = dict(recipe.to_dict())
    rules.pop("description", None)
    sites = [
        ActivationSite(name=e.name, format=e.format, scope=e.scope, tp_scale_mode=tp_scale_mode)
        for e in recipe.plan(model_config).activations
        if e.format != "bf16"
    ]
    return Contract(
        model_config=model_config,
        recipe_name=recipe.name,
        recipe_rules=rules,
        activation_sites=sites,
        tp_plan=tp_plan or TPPlan(),
        trainer_tp_size=trainer_tp_size,
    )


def recipe_sha256(rules_json: str) -> str:
    """`Recipe.fingerprint()`: the hash of the rules' canonical JSON (the contract fingerprint
    covers the recipe name on its own)."""
    return sha256_hex(rules_json)


def contract_fingerprint(contract: pb.Contract) -> str:
    """sha256 hex over a canonical JSON of the contract's parts (see the module docstring)."""
    doc = {
        "schema": SCHEMA_VERSION,
        "model_config_sha256": sha256_hex(contract.model_config_json),
        "recipe_name": contract.recipe_name,
        "recipe_sha256": recipe_sha256(contract.recipe_rules_json),
        "quantizer_spec_version": contract.quantizer_spec_version,
        "activation_sites": [[s.name, s.format, s.scope, s.tp_scale_mode] for s in contract.activation_sites],
        "tp_plan": {
            "rules": [[r.pattern, r.style] for r in contract.tp_plan.rules],
            "partition_tp_size": contract.tp_plan.partition_tp_size,
        },
    }
    return sha256_hex(canonical_json(doc))


def tp_plan_of(manifest: pb.Manifest) -> TPPlan:
    return TPPlan(rules=tuple((r.pattern, r.style) for r in manifest.contract.tp_plan.rules))


# -- building ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class QuantizedParam:
    """One quantized parameter: its format, the quantize() kwargs, and the quantized object."""

    format: str
    kwargs: Mapping[str, Any]
    value: Any  # a policy.formats object: .parts(), .shape


def quantize_param(x: torch.Tensor, fmt: str, **kwargs) -> QuantizedParam:
    """Quantize a weight with format `fmt` (kwargs as for quantize(), e.g. scope="tensor"); a 1-D
    parameter (a norm weight) is quantized and published as [1, D]. Through policy.kernels: the
    GPU kernels on CUDA tensors, the reference elsewhere, the same bytes either way."""
    x = x.detach()
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    return QuantizedParam(fmt, dict(kwargs), kernels.quantize(fmt, x2, **from_parts_kwargs(fmt, kwargs)))


def quantize_params(weights: Mapping[str, torch.Tensor], plan) -> dict[str, QuantizedParam]:
    """Quantize every weight as a policy.recipe Plan says: what a trainer publishes."""
    return {name: quantize_param(w, plan[name].format, **plan[name].kwargs) for name, w in weights.items()}


@dataclass(frozen=True)
class PackedPolicy:
    """A manifest and each tensor's bytes (immutable: `bytes` or a read-only memoryview, by tensor name)."""

    manifest: pb.Manifest
    blobs: Mapping[str, bytes | memoryview]


def _part_bytes(t: torch.Tensor) -> memoryview:
    """Raw element bytes of a CPU tensor (little-endian on every platform we run on), no copy if contiguous."""
    return memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, started asynchronously into pinned memory (the caller synchronizes
    once for all of them); CPU tensors are returned as they are."""
    t = t.detach()
    if t.device.type == "cpu":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _pack(views: Sequence[memoryview], chunk_bytes: int) -> tuple[memoryview, list[int], bytes]:
    """One tensor's bytes: its parts copied into one new buffer, then its chunk xxh3s and sha256.

    Runs in a worker thread: numpy's copy, xxhash and hashlib release the GIL, so tensors are packed
    and hashed in parallel. The copy is what makes a published version immutable (a bf16 part can be
    the live parameter itself); the buffer is returned read-only."""
    buf = np.empty(sum(len(v) for v in views), dtype=np.uint8)
    offset = 0
    for v in views:
        np.copyto(buf[offset : offset + len(v)], np.frombuffer(v, dtype=np.uint8))
        offset += len(v)
    buf.flags.writeable = False
    blob = memoryview(buf)
    return blob, chunk_digests(blob, chunk_bytes), hashlib.sha256(blob).digest()


def chunk_digests(data, chunk_bytes: int) -> list[int]:
    mv = memoryview(data)
    n = len(mv)
    if n == 0:
        return [xxhash.xxh3_64_intdigest(b"")]
    return [xxhash.xxh3_64_intdigest(mv[i : i + chunk_bytes]) for i in range(0, n, chunk_bytes)]


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Chunks of a tensor of `nbytes` bytes (an empty tensor still has one, empty, chunk)."""
    return max(1, -(-nbytes // chunk_bytes))


def first_chunk_indices(manifest: pb.Manifest) -> dict[str, int]:
    """Tensor name -> index of its first chunk in the version's chunk sequence (transport order)."""
    out, i = {}, 0
    for t in manifest.tensors:
        out[t.name] = i
        i += chunk_count(t.nbytes, manifest.chunk_bytes)
    return out


def check_build(*, version, parent_version, contract, tensors, chunk_bytes) -> None:
    """ValueError naming every bad argument of a build (build_manifest, broker.frames.stage)."""
    bad = []
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        bad.append(f"version={version!r} must be an int >= 1")
    bad_parent = parent_version is not None and (
        isinstance(parent_version, bool)
        or not isinstance(parent_version, int)
        or parent_version < 0
        or (isinstance(version, int) and parent_version >= version)
    )
    if bad_parent:
        bad.append(f"parent_version={parent_version!r} must be None or an int in [0, version={version!r})")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or not 1 <= chunk_bytes <= CHUNK_BYTES:
        bad.append(f"chunk_bytes={chunk_bytes!r} must be an int in [1, {CHUNK_BYTES}]")
    if not isinstance(contract, Contract):
        bad.append(f"contract must be a Contract, got {type(contract).__name__}")
    if not tensors:
        bad.append("tensors is empty")
    if bad:
        raise ValueError("build_manifest: " + "; ".join(bad))


def describe_tensors(
    contract: Contract, tensors: Mapping[str, QuantizedParam]
) -> tuple[list[pb.TensorEntry], list[list[torch.Tensor]]]:
    """Each tensor's manifest entry without checksums, and its parts (as the format lists them), in
    manifest order (sorted by name). Validates names, formats, dtypes and, under a pinned TP
    partition, that every shard is cut at block boundaries."""
    plan = contract.tp_plan
    pinned = contract.partition_tp_size  # once: it scans every activation site
    entries, all_parts, scales = [], [], []
    for name in sorted(tensors):
        param = tensors[name]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"build_manifest: tensor name {name!r} must be a string of 1..{MAX_NAME_CHARS} chars")
        if not isinstance(param, QuantizedParam):
            raise ValueError(f"build_manifest: {name}: expected a QuantizedParam, got {type(param).__name__}")
        formats.get(param.format)
        params_json = canonical_json(param.kwargs)
        shape = tuple(int(s) for s in param.value.shape)
        parts, offset = [], 0
        all_parts.append([])
        for pname, t in param.value.parts().items():
            if t.dtype not in _DTYPE_NAMES:
                raise ValueError(f"build_manifest: {name}: part {pname!r} has unsupported dtype {t.dtype}")
            nbytes = t.numel() * t.element_size()
            parts.append(
                pb.TensorPart(
                    name=pname, dtype=_DTYPE_NAMES[t.dtype], shape=list(t.shape), offset=offset, nbytes=nbytes
                )
            )
            all_parts[-1].append(t)
            offset += nbytes
        entry = pb.TensorEntry(
            name=name,
            format=param.format,
            format_params_json=params_json,
            shape=list(shape),
            parts=parts,
            nbytes=offset,
            tp_style=plan.style(name),
        )
        gs = param.value.parts().get("global_scale")
        if param.format == "nvfp4" and gs is not None and gs.numel() == 1:
            scales.append((entry, gs.reshape(1)))
        if pinned > 1:
            errors = plan.shard_errors(name, fmt=param.format, kwargs=param.kwargs, shape=shape, tp_size=pinned)
            if errors:
                raise ValueError("build_manifest: " + "; ".join(errors))
        entries.append(entry)
    # The fp32 global scales, read in one transfer per device (not one host sync per tensor).
    for device in {t.device for _, t in scales}:
        picked = [(e, t) for e, t in scales if t.device == device]
        for (entry, _), value in zip(picked, torch.cat([t.float() for _, t in picked]).tolist()):
            entry.global_scale = value
    return entries, all_parts


def finish_manifest(
    *,
    version: int,
    parent_version: int | None,
    contract: Contract,
    entries: list[pb.TensorEntry],
    chunk_bytes: int,
    created_unix_ns: int | None = None,
) -> pb.Manifest:
    """The manifest over entries whose checksums are filled in (size-checked)."""
    contract_pb = contract.to_proto()
    manifest = pb.Manifest(
        schema_version=SCHEMA_VERSION,
        version=version,
        created_unix_ns=created_unix_ns or time.time_ns(),
        contract=contract_pb,
        contract_fingerprint=contract_fingerprint(contract_pb),
        chunk_bytes=chunk_bytes,
        tensors=entries,
        total_bytes=sum(e.nbytes for e in entries),
    )
    if parent_version is not None:
        manifest.parent_version = parent_version
    size = manifest.ByteSize()
    if size > MAX_MANIFEST_BYTES:
        raise ValueError(f"build_manifest: manifest is {size} bytes, over MAX_MANIFEST_BYTES={MAX_MANIFEST_BYTES}")
    return manifest


def build_manifest(
    *,
    version: int,
    parent_version: int | None,
    contract: Contract,
    tensors: Mapping[str, QuantizedParam],
    created_unix_ns: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    threads: int | None = None,
) -> PackedPolicy:
    """Pack quantized tensors and describe them: one copy of the bytes, sha256 and xxh3 computed here.

    Device tensors are copied to pinned host memory asynchronously (one synchronization for all),
    then `threads` worker threads (default: one per CPU core, at most 32) copy each tensor's parts
    into one immutable buffer and hash it. Each blob is a read-only memoryview. (The trainer
    publishes through broker.frames instead: straight into reusable, pre-framed host buffers.)"""
    check_build(
        version=version, parent_version=parent_version, contract=contract, tensors=tensors, chunk_bytes=chunk_bytes
    )
    entries, parts = describe_tensors(contract, tensors)
    host_parts = [[_to_host(t) for t in ts] for ts in parts]
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the pinned host copies above were asynchronous
    workers = threads or min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pack") as pool:
        packed = list(pool.map(lambda ts: _pack([_part_bytes(t) for t in ts], chunk_bytes), host_parts))
    blobs = {}
    for entry, (blob, xxh3s, sha) in zip(entries, packed):
        entry.chunk_xxh3.extend(xxh3s)
        entry.sha256 = sha
        blobs[entry.name] = blob
    manifest = finish_manifest(
        version=version,
        parent_version=parent_version,
        contract=contract,
        entries=entries,
        chunk_bytes=chunk_bytes,
        created_unix_ns=created_unix_ns,
    )
    return PackedPolicy(manifest, blobs)


# -- serialization -------------------------------------------------------------------------------


def manifest_to_bytes(manifest: pb.Manifest) -> bytes:
    return manifest.SerializeToString(deterministic=True)


def manifest_from_bytes(data: bytes) -> pb.Manifest:
    """Parse (never unpickle) and verify a serialized manifest."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest is {len(data)} bytes, over MAX_MANIFEST_BYTES={MAX_MANIFEST_BYTES}")
    m = pb.Manifest()
    try:
        m.ParseFromString(data)
    except Exception as e:  # google.protobuf.message.DecodeError
        raise ValueError(f"not a tandem.v1.Manifest: {e}") from None
    verify_manifest(m)
    return m


def write_manifest(path: str | Path, manifest: pb.Manifest) -> None:
    Path(path).write_bytes(manifest_to_bytes(manifest))


def read_manifest(path: str | Path) -> pb.Manifest:
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path}: {size} bytes, over MAX_MANIFEST_BYTES={MAX_MANIFEST_BYTES}")
    return manifest_from_bytes(path.read_bytes())


# -- verification --------------------------------------------------------------------------------


def verify_manifest(m: pb.Manifest) -> None:
    """Check a manifest's internal consistency; ValueError naming every problem found (up to 10)."""
    bad = []
    if m.schema_version != SCHEMA_VERSION:
        bad.append(f"schema_version={m.schema_version}, this code reads {SCHEMA_VERSION}")
    if m.version < 1:
        bad.append(f"version={m.version} must be >= 1")
    if m.HasField("parent_version") and m.parent_version >= m.version:
        bad.append(f"parent_version={m.parent_version} must be below version={m.version}")
    if not 1 <= m.chunk_bytes <= CHUNK_BYTES:
        bad.append(f"chunk_bytes={m.chunk_bytes} must be in [1, {CHUNK_BYTES}]")
    c = m.contract
    if c.model_config_sha256 != sha256_hex(c.model_config_json):
        bad.append("contract.model_config_sha256 does not match model_config_json")
    if c.recipe_sha256 != recipe_sha256(c.recipe_rules_json):
        bad.append("contract.recipe_sha256 does not match recipe_rules_json")
    fp = contract_fingerprint(c)
    if m.contract_fingerprint != fp:
        bad.append(f"contract_fingerprint {m.contract_fingerprint!r} does not match the contract ({fp})")
    for s in c.activation_sites:
        if s.tp_scale_mode not in TP_SCALE_MODES:
            bad.append(f"activation site {s.name}: tp_scale_mode {s.tp_scale_mode!r} not in {TP_SCALE_MODES}")
    try:
        plan = tp_plan_of(m)
    except ValueError as e:
        bad.append(str(e))
        plan = None
    names = [t.name for t in m.tensors]
    if names != sorted(set(names)):
        bad.append("tensor names must be unique and sorted")
    total = 0
    for t in m.tensors:
        bad += [f"tensor {t.name}: {p}" for p in _entry_problems(t, m.chunk_bytes, plan)]
        total += t.nbytes
        if len(bad) > 10:
            break
    if total != m.total_bytes and len(bad) <= 10:
        bad.append(f"total_bytes={m.total_bytes} but the tensors add up to {total}")
    if bad:
        raise ValueError(f"invalid manifest (version {m.version}): " + "; ".join(bad[:10]))


def _entry_problems(t: pb.TensorEntry, chunk_bytes: int, plan: TPPlan | None) -> list[str]:
    bad = []
    if not 0 < len(t.name) <= MAX_NAME_CHARS:
        bad.append("bad name length")
    if t.format not in formats.FORMATS:
        bad.append(f"format {t.format!r} is not one of {formats.FORMATS}")
    try:
        json.loads(t.format_params_json)
    except ValueError:
        bad.append("format_params_json is not JSON")
    if len(t.shape) != 2 or any(s < 0 for s in t.shape):
        bad.append(f"shape {list(t.shape)} must be [M, K] with M, K >= 0")
    offset = 0
    for p in t.parts:
        if p.dtype not in DTYPES:
            bad.append(f"part {p.name}: dtype {p.dtype!r} not in {sorted(DTYPES)}")
            continue
        if any(s < 0 for s in p.shape):
            bad.append(f"part {p.name}: negative shape {list(p.shape)}")
            continue
        want = math.prod(p.shape) * DTYPES[p.dtype].itemsize
        if p.nbytes != want:
            bad.append(f"part {p.name}: nbytes={p.nbytes} but {p.dtype} {list(p.shape)} needs {want}")
        if p.offset != offset:
            bad.append(f"part {p.name}: offset={p.offset}, expected {offset} (parts must tile the bytes)")
        offset = p.offset + p.nbytes
    if offset != t.nbytes:
        bad.append(f"nbytes={t.nbytes} but the parts add up to {offset}")
    n = chunk_count(t.nbytes, chunk_bytes) if chunk_bytes else 0
    if len(t.chunk_xxh3) != n:
        bad.append(f"{len(t.chunk_xxh3)} chunk checksums for {n} chunks")
    if len(t.sha256) != 32:
        bad.append("sha256 must be 32 bytes")
    if plan is not None:
        try:
            style = plan.style(t.name)
            if t.tp_style != style:
                bad.append(f"tp_style {t.tp_style!r} but the TP plan says {style!r}")
        except ValueError as e:
            bad.append(str(e))
    return bad


def check_fingerprint(manifest: pb.Manifest, expected: str) -> None:
    """Raise FingerprintMismatch (naming both) unless the manifest's fingerprint is `expected`."""
    if manifest.contract_fingerprint != expected:
        raise FingerprintMismatch(expected=expected, got=manifest.contract_fingerprint, version=manifest.version)


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


def verify_tensor_bytes(entry: pb.TensorEntry, data, chunk_bytes: int) -> None:
    """Check a full tensor's bytes against its manifest entry (size, every chunk's xxh3, sha256)."""
    if len(data) != entry.nbytes:
        raise ChecksumMismatch(f"tensor {entry.name}: {len(data)} bytes, manifest says {entry.nbytes}")
    got = chunk_digests(data, chunk_bytes)
    bad = [i for i, (a, b) in enumerate(zip(got, entry.chunk_xxh3)) if a != b]
    if bad or len(got) != len(entry.chunk_xxh3):
        raise ChecksumMismatch(f"tensor {entry.name}: xxh3 mismatch in chunk(s) {bad[:10]}")
    if hashlib.sha256(data).digest() != entry.sha256:
        raise ChecksumMismatch(f"tensor {entry.name}: sha256 mismatch")


# -- TP shards and rebuilding ------------------------------------------------------------------------


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
