"""A tensor's bytes as chunks, and their checksums: xxh3_64 per chunk, one sha256 per tensor.

A tensor's bytes are its parts (`q.parts()`, in the order the format lists them) concatenated, each
part as its raw little-endian element bytes, cut into chunks of the manifest's `chunk_bytes` (the
last one shorter; an empty tensor has one empty chunk): the unit of transport and of xxh3. A
tensor's sha256 (manifest schema 2, `tensor_sha256`) is over its chunks' sha256s:

    H = sha256(b"tandem-tensor-sha256-v2\\0" || uint64_le(nbytes) || sha256(chunk_0) || ... || sha256(chunk_{n-1}))

so chunks hash in parallel (hashlib and xxhash release the GIL: runs of chunks go to a thread
pool) and it is still one collision-resistant digest of the whole tensor: the domain string
separates it from any other use of sha256, the byte count fixes the chunking (a forged, reordered,
truncated or extended tensor changes some chunk digest, their order or the length). A TP shard's
digest is the same definition over the shard's bytes and chunks.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import xxhash

from tandem.v1 import manifest_pb2 as pb

TENSOR_SHA256_DOMAIN = b"tandem-tensor-sha256-v2\0"
HASH_TASK_BYTES = 8 << 20  # bytes of chunks one hashing task covers (a thread pool's unit of work)


class ChecksumMismatch(ValueError):
    """Bytes do not match the xxh3 / sha256 the manifest (or a chunk) declares."""


def chunk_bounds(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of a tensor of `nbytes` bytes (an empty tensor: one empty chunk)."""
    return [(i, min(i + chunk_bytes, nbytes)) for i in range(0, nbytes, chunk_bytes)] or [(0, 0)]


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Chunks of a tensor of `nbytes` bytes (an empty tensor still has one, empty, chunk)."""
    return max(1, -(-nbytes // chunk_bytes))


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


def first_chunk_indices(manifest: pb.Manifest) -> dict[str, int]:
    """Tensor name -> index of its first chunk in the version's chunk sequence (transport order)."""
    out, i = {}, 0
    for t in manifest.tensors:
        out[t.name] = i
        i += chunk_count(t.nbytes, manifest.chunk_bytes)
    return out


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
