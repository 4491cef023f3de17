"""The manifest of a published policy (DESIGN.md, "Policy-version contract"): build, serialize, verify.

A published policy is immutable: (version, manifest, packed tensors). The manifest is the protobuf
message `tandem.v1.Manifest` (protos/tandem/v1/manifest.proto), serialized deterministically. It
holds the version, parent version and creation time; the contract and its fingerprint
(policy.contract); per tensor: name, format, format params, logical shape ([M, K]; 1-D parameters
as [1, D]), each part's dtype/shape/byte range, the fp32 global scale when there is one, the TP
style (policy.tp_layout), xxh3_64 per chunk and a sha256 over the chunks' sha256s (policy.chunks).
A manifest of schema 1 (sha256 over a tensor's raw bytes) is refused with one line naming the schema.

The manifest's own digest (`manifest_digest`: over every field but the creation time, so over every
tensor's checksums) is what the signed `policy:latest` names: a worker compares it first
(`manifest_from_bytes(digest=...)`, DigestMismatch), so content is authenticated whoever serves it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from policy import formats
from policy.chunks import chunk_bounds, chunk_checksums, chunk_count, hash_runs, part_pieces, tensor_sha256
from policy.contract import Contract, contract_fingerprint, recipe_sha256
from policy.fields import is_int
from policy.formats.params import QuantizedParam
from policy.hashing import canonical_json, sha256_hex
from policy.tp import TP_SCALE_MODES, TPPlan
from policy.tp_layout import DTYPES, tp_plan_of
from tandem.v1 import manifest_pb2 as pb

# 2: a tensor's sha256 is `tensor_sha256` (over its chunks' sha256s); 1 was a sha256 over its bytes.
SCHEMA_VERSION = 2
MANIFEST_DIGEST_DOMAIN = b"tandem-manifest-digest-v1\0"
CHUNK_BYTES = 1 << 20  # at most 1 MiB of tensor bytes per chunk (and per gRPC message)
MAX_MANIFEST_BYTES = 64 << 20
MAX_NAME_CHARS = 512

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class DigestMismatch(ValueError):
    """A manifest whose `manifest_digest` is not the one the signed pointer names: whoever served it
    is not to be trusted for that version (the pointer is authentic, the source is not)."""


# -- building ----------------------------------------------------------------------------------


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


def _pack_run(buf: np.ndarray, views: Sequence[np.ndarray], bounds, run: tuple[int, int]):
    """Copy chunks [j0, j1) of one tensor from its parts into `buf` and hash them (a worker thread:
    numpy's copy, xxhash and hashlib release the GIL)."""
    a, b = bounds[run[0]][0], bounds[run[1] - 1][1]
    for part, src, dst, n in part_pieces([len(v) for v in views], a, b):
        np.copyto(buf[dst : dst + n], views[part][src : src + n])
    return chunk_checksums(buf, bounds[run[0] : run[1]])


def check_build(*, version, parent_version, contract, tensors, chunk_bytes) -> None:
    """ValueError naming every bad argument of a build (build_manifest, broker.frames.stage)."""
    bad = []
    if not is_int(version, lo=1):
        bad.append(f"version={version!r} must be an int >= 1")
    bad_parent = parent_version is not None and (
        not is_int(parent_version, lo=0) or (isinstance(version, int) and parent_version >= version)
    )
    if bad_parent:
        bad.append(f"parent_version={parent_version!r} must be None or an int in [0, version={version!r})")
    if not is_int(chunk_bytes, 1, CHUNK_BYTES):
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
    params_json_of: dict[str, str] = {}  # repr(kwargs) -> canonical JSON: a model has a handful of distinct ones
    for name in sorted(tensors):
        param = tensors[name]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise ValueError(f"build_manifest: tensor name {name!r} must be a string of 1..{MAX_NAME_CHARS} chars")
        if not isinstance(param, QuantizedParam):
            raise ValueError(f"build_manifest: {name}: expected a QuantizedParam, got {type(param).__name__}")
        formats.get(param.format)
        key = repr(param.kwargs)
        params_json = params_json_of.get(key) or params_json_of.setdefault(key, canonical_json(param.kwargs))
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
    """Pack quantized tensors and describe them: one copy of the bytes, xxh3 and sha256 computed here.

    Device tensors are copied to pinned host memory asynchronously (one synchronization for all),
    then `threads` worker threads (default: one per CPU core, at most 32) copy runs of each tensor's
    chunks (about HASH_TASK_BYTES each) from its parts into one new buffer and hash them; a tensor's
    sha256 is then `tensor_sha256` of its chunk digests. The copy is what makes a published version
    immutable (a bf16 part can be the live parameter itself); each blob is a read-only memoryview.
    (The trainer publishes through broker.frames instead: straight into reusable, pre-framed host
    buffers.)"""
    check_build(
        version=version, parent_version=parent_version, contract=contract, tensors=tensors, chunk_bytes=chunk_bytes
    )
    entries, parts = describe_tensors(contract, tensors)
    host_parts = [[_to_host(t) for t in ts] for ts in parts]
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the pinned host copies above were asynchronous
    views = [[np.frombuffer(_part_bytes(t), dtype=np.uint8) for t in ts] for ts in host_parts]
    bufs = [np.empty(e.nbytes, dtype=np.uint8) for e in entries]  # untouched: each run's copy faults its own pages
    bounds = [chunk_bounds(e.nbytes, chunk_bytes) for e in entries]
    tasks = [(i, run) for i in range(len(entries)) for run in hash_runs(bounds[i])]
    workers = threads or min(32, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pack") as pool:
        done = list(pool.map(lambda t: _pack_run(bufs[t[0]], views[t[0]], bounds[t[0]], t[1]), tasks))
    shas: list[list[bytes]] = [[] for _ in entries]
    for (i, _), (xxh3s, chunk_shas) in zip(tasks, done):
        entries[i].chunk_xxh3.extend(xxh3s)
        shas[i] += chunk_shas
    blobs = {}
    for entry, buf, chunk_shas in zip(entries, bufs, shas):
        entry.sha256 = tensor_sha256(entry.nbytes, chunk_shas)
        buf.flags.writeable = False
        blobs[entry.name] = memoryview(buf)
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


def manifest_from_bytes(data: bytes, *, digest: str = "") -> pb.Manifest:
    """Parse (never unpickle) and verify a serialized manifest; with `digest` (hex, from a signed
    pointer) its `manifest_digest` is compared first (DigestMismatch), before anything else is read."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(f"manifest is {len(data)} bytes, over MAX_MANIFEST_BYTES={MAX_MANIFEST_BYTES}")
    m = pb.Manifest()
    try:
        m.ParseFromString(data)
    except Exception as e:  # google.protobuf.message.DecodeError
        raise ValueError(f"not a tandem.v1.Manifest: {e}") from None
    if digest:
        check_digest(m, digest)
    verify_manifest(m)
    return m


def manifest_digest(m: pb.Manifest) -> bytes:
    """The manifest's own digest: sha256 over a domain string and its deterministic serialization with
    `created_unix_ns` zeroed, so it covers every field but the creation time (the contract, every
    tensor's layout, global scale, chunk xxh3s and sha256): equal iff the published content is equal.
    The signed pointer carries it (hex); the policy server dedups publishes by it."""
    c = pb.Manifest()
    c.CopyFrom(m)
    c.created_unix_ns = 0
    return hashlib.sha256(MANIFEST_DIGEST_DOMAIN + manifest_to_bytes(c)).digest()


def check_digest(m: pb.Manifest, expected_hex: str) -> None:
    """DigestMismatch (naming both, short) unless `manifest_digest(m)` is `expected_hex`."""
    got = manifest_digest(m).hex()
    if got != expected_hex:
        raise DigestMismatch(
            f"manifest of version {m.version} has digest {got[:16]}, the signed pointer says {expected_hex[:16]}"
        )


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
        # Nothing else is checked: another schema's checksums mean something else (schema 1 hashed each
        # tensor's bytes as one stream), so its every tensor would fail, and that is not the problem.
        raise ValueError(
            f"invalid manifest (version {m.version}): schema_version={m.schema_version}, this code reads "
            f"schema {SCHEMA_VERSION} only (schema 2: a tensor's sha256 is over its chunks' sha256s); "
            f"run the same Tandem release on the trainer and the rollouts"
        )
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
