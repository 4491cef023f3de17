"""The policy-version contract: the manifest of a published policy (DESIGN.md).

A published policy is immutable: (version, manifest, packed tensors). The manifest is the
protobuf message `tandem.v1.Manifest` (protos/tandem/v1/manifest.proto), serialized
deterministically. It holds:

- version, parent version, creation time;
- the `Contract`: model config (canonical JSON + sha256), recipe (name + full rules + sha256),
  quantizer spec version, activation sites (format, scope, TP scale mode) and the TP plan;
- per tensor: name, format, format params, logical shape, each part's dtype/shape/byte range,
  the fp32 global scale when there is one, the TP style, xxh3_64 per chunk and a sha256 over the
  chunks' sha256s (below).

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

A tensor's `sha256` (schema 2, `tensor_sha256`) is a sha256 over its chunks' sha256s, with the
manifest's own `chunk_bytes`:

    H = sha256(b"tandem-tensor-sha256-v2\0" || uint64_le(nbytes) || sha256(chunk_0) || ... || sha256(chunk_{n-1}))

Why (decided for issue 17, publishing at memory speed): a sha256 over the tensor's bytes is one
sequential stream, so the largest tensor (a 622 MB embedding) took >= 0.5 s on one core however
many cores the trainer host has, and every worker verified with one hashing thread (~1.2 GB/s).
Over chunks, every chunk's sha256 is independent: trainer and workers hash chunks in a thread
pool (hashlib releases the GIL), and the result is still one collision-resistant digest of the
whole tensor: the chunk digests are a fixed-fanout hash list, the domain string separates it from
any other use of sha256, and the byte count fixes the chunking (a forged, reordered, truncated or
extended tensor changes some chunk digest, their order or the length). DESIGN.md's "sha256 over
the tensor" means this digest. A TP shard's digest (the server's, on its last chunk) is the same
definition over the shard's bytes and chunks. A manifest of schema 1 (sha256 over the raw bytes)
is refused with one line naming the schema, not by failing every tensor's checksum.

The manifest's own digest (`manifest_digest`: over every field but the creation time, so over every
tensor's checksums) is what the signed `policy:latest` names: a worker compares it first
(`manifest_from_bytes(digest=...)`, DigestMismatch), so content is authenticated whoever serves it.

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
from policy.fields import is_int
from policy.hashing import canonical_json, sha256_hex
from policy.tp import TP_SCALE_MODES, ShardCut, TPPlan, check_tp, from_parts_kwargs, part_index
from tandem.v1 import manifest_pb2 as pb

# 2: a tensor's sha256 is `tensor_sha256` (over its chunks' sha256s); 1 was a sha256 over its bytes.
SCHEMA_VERSION = 2
_FINGERPRINT_SCHEMA = 1  # the contract fingerprint's own form: unchanged by schema 2 (same contract, same hash)
TENSOR_SHA256_DOMAIN = b"tandem-tensor-sha256-v2\0"
MANIFEST_DIGEST_DOMAIN = b"tandem-manifest-digest-v1\0"
HASH_TASK_BYTES = 8 << 20  # bytes of chunks one hashing task covers (a thread pool's unit of work)
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


class DigestMismatch(ValueError):
    """A manifest whose `manifest_digest` is not the one the signed pointer names: whoever served it
    is not to be trusted for that version (the pointer is authentic, the source is not)."""


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


_fingerprints: dict[bytes, str] = {}  # sha256 of a serialized Contract -> its fingerprint


def contract_fingerprint(contract: pb.Contract) -> str:
    """sha256 hex over a canonical JSON of the contract's parts (see the module docstring).

    Memoized by the sha256 of the contract's deterministic serialization (equal bytes, equal fields):
    every version of a run carries the same contract, and its canonical JSON (one entry per activation
    site: 12,288 for Qwen3-30B-A3B) took ~60 ms per manifest built or verified."""
    key = hashlib.sha256(contract.SerializeToString(deterministic=True)).digest()
    fp = _fingerprints.get(key)
    if fp is None:
        fp = _contract_fingerprint(contract)
        if len(_fingerprints) >= 64:
            _fingerprints.clear()
        _fingerprints[key] = fp
    return fp


def _contract_fingerprint(contract: pb.Contract) -> str:
    doc = {
        "schema": _FINGERPRINT_SCHEMA,
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


def quantize_param(x: torch.Tensor, fmt: str, *, check_finite: bool = True, **kwargs) -> QuantizedParam:
    """Quantize a weight with format `fmt` (kwargs as for quantize(), e.g. scope="tensor"); a 1-D
    parameter (a norm weight) is quantized and published as [1, D]. Through policy.kernels: the
    GPU kernels on CUDA tensors, the reference elsewhere, the same bytes either way.
    check_finite=False skips the GPU path's NaN/Inf check (a host sync per tensor) where the caller
    checks the weights itself."""
    x = x.detach()
    x2 = x.reshape(1, -1) if x.dim() == 1 else x
    q = kernels.quantize(fmt, x2, check_finite=check_finite, **from_parts_kwargs(fmt, kwargs))
    return QuantizedParam(fmt, dict(kwargs), q)


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


# -- checksums ----------------------------------------------------------------------------------------


def chunk_bounds(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a tensor of `nbytes` bytes (an empty tensor: one empty chunk)."""
    return [(i, min(i + chunk_bytes, nbytes)) for i in range(0, nbytes, chunk_bytes)] or [(0, 0)]


def chunk_checksums(data, bounds: Sequence[tuple[int, int]]) -> tuple[list[int], list[bytes]]:
    """xxh3_64 and sha256 of each chunk `data[a:b]` for (a, b) in `bounds`, both over the chunk while
    it is in cache. xxhash and hashlib release the GIL, so threads hash different chunks in parallel."""
    mv = memoryview(data)
    xxh3s, shas = [], []
    for a, b in bounds:
        piece = mv[a:b]
        xxh3s.append(xxhash.xxh3_64_intdigest(piece))
        shas.append(hashlib.sha256(piece).digest())
    return xxh3s, shas


def tensor_sha256(nbytes: int, chunk_sha256s: Sequence[bytes]) -> bytes:
    """A tensor's manifest sha256 from its chunks' sha256s, in order (the definition: module docstring)
    H = sha256(TENSOR_SHA256_DOMAIN || uint64_le(nbytes) || sha256(chunk_0) || sha256(chunk_1) || ...)."""
    h = hashlib.sha256(TENSOR_SHA256_DOMAIN)
    h.update(nbytes.to_bytes(8, "little"))
    for d in chunk_sha256s:
        h.update(d)
    return h.digest()


def hash_runs(bounds: Sequence[tuple[int, int]], task_bytes: int | None = None) -> list[tuple[int, int]]:
    """Consecutive chunks grouped into runs [j0, j1) of about `task_bytes` (default HASH_TASK_BYTES):
    a thread pool's tasks."""
    task_bytes = task_bytes or HASH_TASK_BYTES
    runs, j0, size = [], 0, 0
    for j, (a, b) in enumerate(bounds):
        size += b - a
        if size >= task_bytes:
            runs.append((j0, j + 1))
            j0, size = j + 1, 0
    if j0 < len(bounds):
        runs.append((j0, len(bounds)))
    return runs


def checksums(data, chunk_bytes: int, *, pool: ThreadPoolExecutor | None = None) -> tuple[list[int], bytes]:
    """A tensor's chunk xxh3s and its sha256 (`tensor_sha256`); runs of chunks hashed in `pool` if given."""
    bounds = chunk_bounds(len(memoryview(data)), chunk_bytes)
    if pool is None:
        xxh3s, shas = chunk_checksums(data, bounds)
    else:
        done = pool.map(lambda r: chunk_checksums(data, bounds[r[0] : r[1]]), hash_runs(bounds))
        xxh3s, shas = [], []
        for x, h in done:
            xxh3s += x
            shas += h
    return xxh3s, tensor_sha256(bounds[-1][1], shas)


def part_pieces(part_sizes: Sequence[int], start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """(part index, offset in that part, offset in the tensor, length) covering the tensor's bytes
    [start, stop), the tensor being its parts concatenated."""
    out, base = [], 0
    for i, size in enumerate(part_sizes):
        a, b = max(start, base), min(stop, base + size)
        if a < b:
            out.append((i, a - base, a, b - a))
        base += size
    return out


def _pack_run(buf: np.ndarray, views: Sequence[np.ndarray], bounds, run: tuple[int, int]):
    """Copy chunks [j0, j1) of one tensor from its parts into `buf` and hash them (a worker thread:
    numpy's copy, xxhash and hashlib release the GIL)."""
    a, b = bounds[run[0]][0], bounds[run[1] - 1][1]
    for part, src, dst, n in part_pieces([len(v) for v in views], a, b):
        np.copyto(buf[dst : dst + n], views[part][src : src + n])
    return chunk_checksums(buf, bounds[run[0] : run[1]])


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


def verify_tensor_bytes(
    entry: pb.TensorEntry, data, chunk_bytes: int, *, pool: ThreadPoolExecutor | None = None
) -> None:
    """Check a full tensor's bytes against its manifest entry (size, every chunk's xxh3, the sha256
    over the chunks); runs of chunks are hashed in `pool` if given."""
    if len(data) != entry.nbytes:
        raise ChecksumMismatch(f"tensor {entry.name}: {len(data)} bytes, manifest says {entry.nbytes}")
    got, sha = checksums(data, chunk_bytes, pool=pool)
    bad = [i for i, (a, b) in enumerate(zip(got, entry.chunk_xxh3)) if a != b]
    if bad or len(got) != len(entry.chunk_xxh3):
        raise ChecksumMismatch(f"tensor {entry.name}: xxh3 mismatch in chunk(s) {bad[:10]}")
    if sha != entry.sha256:
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
