"""A published version as pre-framed gRPC messages in one reusable host buffer (what PolicyServer serves).

Layout (`frame_layout`): the `TensorChunk` messages FetchTensors sends, back to back in chunk-index
order; each is its head (fields 1-7 as protobuf serializes them, with fixed-size slots for the
chunk's xxh3 and, on a tensor's last chunk, the 32-byte `tensor_sha256`), then field 15's tag and
length, then the chunk's data. The bytes equal `TensorChunk(...).SerializeToString(deterministic=True)`
(tested; an xxh3 that happens to be 0 is written out instead of omitted, which parses the same).

Publishing in two steps: `stage` (on the training thread: describe the tensors, record where the
producing CUDA stream is, clone parts that alias a live parameter), then `StagedPublish.run` (any
thread: copy the parts into their chunks, from the GPU straight into the page-locked buffer on its
own stream; hash each chunk in place, xxh3 and sha256, in a thread pool over runs of chunks; write
the digests into their slots). Nothing is copied on the host; a message is a slice of the buffer.
Buffers are reused (`BufferPool`): a version's buffer returns when the server has evicted it and no
stream or TP shard cut still reads it. Why: docs/design-decisions.md, "Publishing"."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import struct
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from broker import ipc
from policy import manifest as mf
from policy.chunks import chunk_checksums, chunk_count, first_chunk_indices, hash_runs, part_pieces, tensor_sha256
from policy.contract import Contract
from policy.formats.params import QuantizedParam
from tandem.v1 import manifest_pb2, policy_pb2

log = logging.getLogger("tandem.frames")

_XXH3_TAG = bytes([(6 << 3) | 1])  # TensorChunk.xxh3: field 6, fixed64
_SHA_TAG = bytes([(7 << 3) | 2, 32])  # TensorChunk.tensor_sha256: field 7, 32 bytes
_DATA_TAG = bytes([(15 << 3) | 2])  # TensorChunk.data: field 15, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


# -- layout ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorFrames:
    """Where one tensor's chunk messages sit in the buffer (positions are absolute byte offsets)."""

    name: str
    nbytes: int
    first_index: int  # chunk_index of its first chunk
    messages: tuple[tuple[int, int], ...]  # (start, stop) of each chunk's message
    data: tuple[tuple[int, int], ...]  # (start, stop) of each chunk's data
    xxh3_at: tuple[int, ...]  # each chunk's 8-byte xxh3 slot
    sha256_at: int  # the 32-byte sha256 slot in the last chunk's head
    chunk_bytes: int  # chunk j holds the tensor's bytes [j * chunk_bytes, ...)


@dataclass(frozen=True)
class FrameLayout:
    version: int
    chunk_bytes: int
    tensors: tuple[TensorFrames, ...]
    heads: tuple[tuple[int, bytes], ...]  # (position, head bytes with zeroed digest slots)
    size: int


def frame_layout(version: int, tensors: Iterable[tuple[str, int, int]], chunk_bytes: int) -> FrameLayout:
    """The layout of `tensors` = (name, nbytes, first chunk index), in the order given."""
    pos, frames, heads = 0, [], []
    for name, nbytes, first in tensors:
        n = chunk_count(nbytes, chunk_bytes)
        messages, data, xxh3_at, sha_at = [], [], [], 0
        for j in range(n):
            length = min(chunk_bytes, nbytes - j * chunk_bytes)
            head = policy_pb2.TensorChunk(
                version=version, chunk_index=first + j, tensor_name=name, tensor_nbytes=nbytes, offset=j * chunk_bytes
            ).SerializeToString(deterministic=True)
            xxh3_at.append(pos + len(head) + 1)
            head += _XXH3_TAG + bytes(8)
            if j == n - 1:
                sha_at = pos + len(head) + 2
                head += _SHA_TAG + bytes(32)
            head += _DATA_TAG + _varint(length)
            heads.append((pos, head))
            data.append((pos + len(head), pos + len(head) + length))
            messages.append((pos, pos + len(head) + length))
            pos += len(head) + length
        frames.append(
            TensorFrames(name, nbytes, first, tuple(messages), tuple(data), tuple(xxh3_at), sha_at, chunk_bytes)
        )
    return FrameLayout(version, chunk_bytes, tuple(frames), tuple(heads), pos)


def manifest_layout(manifest: manifest_pb2.Manifest) -> FrameLayout:
    """The layout of a manifest's tensors in manifest order: what a publish framed them into."""
    firsts = first_chunk_indices(manifest)
    return frame_layout(
        manifest.version, ((t.name, t.nbytes, firsts[t.name]) for t in manifest.tensors), manifest.chunk_bytes
    )


# -- host buffers --------------------------------------------------------------------------------------


def page_aligned_empty(nbytes: int) -> np.ndarray:
    """Uninitialized bytes in pages of their own (anonymous mapping): CUDA registers whole pages."""
    return np.frombuffer(
        mmap.mmap(-1, max(-(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE, mmap.PAGESIZE)), dtype=np.uint8, count=nbytes
    )


def _clear_cuda_error() -> None:
    """torch.cuda.cudart() leaves a failed call's error pending: the next kernel launch raises it."""
    for name in ("libcudart.so.12", "libcudart.so.13", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD).cudaGetLastError()  # only the copy torch loaded
            return
        except (OSError, AttributeError):
            continue


def _unregister(address: int) -> None:
    rc = int(torch.cuda.cudart().cudaHostUnregister(address))
    if rc != 0:
        _clear_cuda_error()
        log.warning("cudaHostUnregister(%#x) failed (cudaError %d)", address, rc)


def page_lock(arr: np.ndarray) -> Callable[[], None]:
    """Page-lock `arr`'s memory in place (cudaHostRegister: host-to-device copies from it run at DMA
    speed); OSError naming the CUDA error if it cannot. The registration ends when the returned
    function is called or when `arr` is freed, whichever comes first: CUDA must never keep a
    registration of freed memory, or copies into memory later allocated at those addresses fail
    ("CUDA error: invalid argument"). `arr` must start on a page (`page_aligned_empty`): CUDA pins
    whole pages, and a copy from a neighbour sharing one of them would fail the same way."""
    address = arr.ctypes.data
    if address % mmap.PAGESIZE:
        raise OSError(f"page_lock: the array at {address:#x} does not start on a page (use page_aligned_empty)")
    rc = int(torch.cuda.cudart().cudaHostRegister(address, arr.nbytes, 0))
    if rc != 0:
        _clear_cuda_error()
        raise OSError(f"cudaHostRegister of {arr.nbytes} bytes failed (cudaError {rc})")
    return weakref.finalize(arr, _unregister, address)


class HostBuffer:
    """`capacity` bytes of host memory (a numpy uint8 array), page-locked for the GPU when `pin`:
    registered with cudaHostRegister (`page_lock`), or torch's pinned allocator if registering fails.
    `shared`: the memory is an anonymous memfd (`fd`), which another process can map (the policy
    server's process, broker/server_process.py); it then stays unpinned if registering fails. `id`
    names the buffer across processes."""

    _ids = itertools.count(1)

    def __init__(self, capacity: int, *, pin: bool, shared: bool = False):
        self.capacity, self.id = capacity, next(HostBuffer._ids)
        self.fd = -1
        self._unlock: Callable[[], None] | None = None
        self._keep = self._mmap = None
        if shared:
            self.fd, self._mmap = ipc.shared_memory("tandem-policy-frames", max(capacity, 1))
            arr = np.frombuffer(self._mmap, dtype=np.uint8, count=capacity)
        else:
            arr = page_aligned_empty(capacity) if pin else np.empty(capacity, dtype=np.uint8)
        self.pinned = False
        if pin and capacity:
            try:
                self._unlock, self.pinned = page_lock(arr), True
            except OSError as e:
                if shared:
                    log.warning("%s; shared buffer unpinned", e)
                else:
                    log.warning("%s; using torch pinned memory", e)
                    self._keep = torch.empty(capacity, dtype=torch.uint8, pin_memory=True)
                    arr, self.pinned = self._keep.numpy(), True
        self.array = arr

    def close(self) -> None:
        if self._unlock is not None:
            self._unlock()
            self._unlock = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._mmap is not None:
            self.array = np.empty(0, dtype=np.uint8)
            ipc.unmap(self._mmap)
            self._mmap = None


class BufferPool:
    """Free host buffers for the next versions. Thread-safe.

    The rule: a version's buffer goes back to the pool when the PolicyServer has evicted the version
    (it keeps the last `keep_versions`) and no FetchTensors stream or TP shard cut is still reading
    it; the next publish takes the smallest free buffer that fits, or allocates one. So a trainer
    that keeps K versions cycles through K + 1 buffers (K served, one being filled); a stream still
    reading an evicted version delays only the reuse of that one buffer, never its bytes."""

    def __init__(self, *, pin: bool = False, shared: bool = False):
        self.pin, self.shared = pin, shared
        self._lock = threading.Lock()
        self._free: list[HostBuffer] = []
        self.allocated = 0  # buffers ever allocated (a steady trainer stops at keep_versions + 1)

    def acquire(self, nbytes: int) -> HostBuffer:
        with self._lock:
            fits = [b for b in self._free if b.capacity >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.capacity)
                self._free.remove(buf)
                return buf
            self.allocated += 1
        return HostBuffer(nbytes, pin=self.pin, shared=self.shared)

    def release(self, buf: HostBuffer) -> None:
        with self._lock:
            self._free.append(buf)

    def free_buffers(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for b in free:
            b.close()


# -- a framed version ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FramedPolicy:
    """A manifest and its messages framed in `data` (the first `layout.size` bytes of a host buffer).
    `release` gives the buffer back to its pool; PolicyServer calls it once nothing reads the version.
    `seconds`: where building it went (StagedPublish.run: layout, acquire, fill, manifest). `host`:
    the pooled buffer `data` lies in (None for a buffer of its own)."""

    manifest: manifest_pb2.Manifest
    layout: FrameLayout
    data: np.ndarray
    release: Callable[[], None] | None = None
    seconds: Mapping[str, float] = field(default_factory=dict)
    host: HostBuffer | None = None


def _flat(t):
    """A part's raw bytes, flat uint8, no copy: a torch tensor on CUDA, else a numpy array."""
    if isinstance(t, torch.Tensor):
        t = t.detach().contiguous().reshape(-1).view(torch.uint8)
        return t if t.device.type == "cuda" else t.numpy()
    return np.frombuffer(t, dtype=np.uint8)


def _on_cuda(t) -> bool:
    return isinstance(t, torch.Tensor)


def _pieces(frames: TensorFrames, part_sizes: Sequence[int], j0: int, j1: int):
    """(part index, start in the part, destination start, length) covering chunks [j0, j1)'s data
    regions: the parts concatenated, cut at chunk boundaries."""
    out = []
    for j in range(j0, j1):
        start, stop = frames.data[j]
        base = j * frames.chunk_bytes  # the chunk's offset in the tensor
        for part, src, at, n in part_pieces(part_sizes, base, base + stop - start):
            out.append((part, src, start + at - base, n))
    return out


def _seal_run(data: np.ndarray, frames: TensorFrames, j0: int, j1: int) -> tuple[list[int], list[bytes]]:
    """xxh3 and sha256 of chunks [j0, j1), computed in the buffer; the xxh3s are also written into
    their slots."""
    xxh3s, shas = chunk_checksums(data, frames.data[j0:j1])
    mv = memoryview(data)
    for at, d in zip(frames.xxh3_at[j0:j1], xxh3s):
        struct.pack_into("<Q", mv, at, d)
    return xxh3s, shas


def fill(
    data: np.ndarray,
    layout: FrameLayout,
    sources: Sequence[Sequence[object]],
    *,
    threads: int | None = None,
    after: torch.cuda.Event | None = None,
) -> list[tuple[list[int], bytes]]:
    """Write the heads, copy every tensor's parts (`sources[i]`: torch tensors on any device, or
    buffers) into its data regions and seal it; returns (chunk xxh3s, sha256) per tensor.

    The work is cut into runs of a tensor's chunks (about policy.chunks.HASH_TASK_BYTES each, hash_runs),
    one thread-pool task each: every chunk's xxh3 and sha256 are independent (the manifest's
    sha256 is over the chunks' sha256s, mf.tensor_sha256, taken here once a tensor's runs are done),
    so even the largest tensor is hashed by every core. CUDA parts are copied on a side stream (after
    `after`, an event on the producing stream; else after the current stream's work so far), largest
    tensors first, one event per tensor that its runs wait for; CPU parts are copied by the runs."""
    mv = memoryview(data)
    for pos, head in layout.heads:
        mv[pos : pos + len(head)] = head
    flat = [[_flat(t) for t in ts] for ts in sources]
    order = sorted(range(len(flat)), key=lambda i: -layout.tensors[i].nbytes)
    cuda_parts = [t for ts in flat for t in ts if _on_cuda(t)]
    host = torch.from_numpy(data) if cuda_parts else None
    stream = _copy_stream(cuda_parts[0].device, after) if cuda_parts else None
    workers = threads or min(32, os.cpu_count() or 1)
    runs: dict[int, list] = {}
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="frame") as pool, _drained(stream):
        for i in order:
            frames, parts = layout.tensors[i], flat[i]
            event = None
            if stream is not None and any(_on_cuda(t) for t in parts):
                event = _copy_cuda_parts(host, stream, frames, parts)
            runs[i] = [
                pool.submit(_copy_and_seal, data, frames, parts, j0, j1, event) for j0, j1 in hash_runs(_bounds(frames))
            ]
        out = []
        for i, frames in enumerate(layout.tensors):
            xxh3s, shas = [], []
            for f in runs[i]:
                x, h = f.result()
                xxh3s += x
                shas += h
            sha = tensor_sha256(frames.nbytes, shas)
            mv[frames.sha256_at : frames.sha256_at + 32] = sha
            out.append((xxh3s, sha))
    return out  # `flat` (and the parts it holds) lives until every copy is done


def _copy_stream(device, after: torch.cuda.Event | None) -> torch.cuda.Stream:
    """The side stream CUDA parts are copied on: after `after`, else after the current stream's work so far."""
    stream = torch.cuda.Stream(device=device)
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    return stream


def _copy_cuda_parts(host: torch.Tensor, stream, frames: TensorFrames, parts: list) -> torch.cuda.Event:
    """Queue the copies of a tensor's CUDA parts into its data regions on `stream`; returns the
    event recorded after them."""
    with torch.cuda.stream(stream):
        for part, src, dst, n in _pieces(frames, [len(t) for t in parts], 0, len(frames.data)):
            if _on_cuda(parts[part]):
                host[dst : dst + n].copy_(parts[part][src : src + n], non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return event


def _copy_and_seal(data: np.ndarray, frames: TensorFrames, parts: list, j0: int, j1: int, event):
    """One thread-pool task: wait for the tensor's CUDA copies (`event`), copy its CPU parts of
    chunks [j0, j1), then seal those chunks (`_seal_run`)."""
    if event is not None:
        event.synchronize()  # releases the GIL
    for part, src, dst, n in _pieces(frames, [len(t) for t in parts], j0, j1):
        if not _on_cuda(parts[part]):
            np.copyto(data[dst : dst + n], parts[part][src : src + n])
    return _seal_run(data, frames, j0, j1)


def _bounds(frames: TensorFrames) -> list[tuple[int, int]]:
    """Each chunk's [start, stop) in the tensor (what mf.hash_runs sizes runs by)."""
    return [(j * frames.chunk_bytes, j * frames.chunk_bytes + b - a) for j, (a, b) in enumerate(frames.data)]


@contextlib.contextmanager
def _drained(stream):
    """On the way out (an error included), no copy into the buffer is still in flight."""
    try:
        yield
    finally:
        if stream is not None:
            stream.synchronize()


@dataclass
class StagedPublish:
    """A version described on the training thread; `run()` (any thread) frames and hashes it.

    `run` may run while training continues: it copies on its own CUDA stream after the point `stage`
    recorded and keeps the parts alive until their copies are done; `stage` cloned every part that
    aliases a live parameter, which a later optimizer step updates in place."""

    version: int
    parent_version: int | None
    contract: Contract
    entries: list
    parts: list[list[torch.Tensor]]
    pool: BufferPool
    chunk_bytes: int
    threads: int | None
    after: object  # a torch.cuda.Event on the producing stream, or None
    created_unix_ns: int | None = None

    def run(self) -> FramedPolicy:
        t0 = time.perf_counter()
        firsts, index = [], 0
        for e in self.entries:
            firsts.append(index)
            index += chunk_count(e.nbytes, self.chunk_bytes)
        layout = frame_layout(
            self.version, ((e.name, e.nbytes, f) for e, f in zip(self.entries, firsts)), self.chunk_bytes
        )
        t1 = time.perf_counter()
        buf = self.pool.acquire(layout.size)
        t2 = time.perf_counter()
        try:
            data = buf.array[: layout.size]
            sealed = fill(data, layout, self.parts, threads=self.threads, after=self.after)
            t3 = time.perf_counter()
            for e, (xxh3s, sha) in zip(self.entries, sealed):
                del e.chunk_xxh3[:]
                e.chunk_xxh3.extend(xxh3s)
                e.sha256 = sha
            manifest = mf.finish_manifest(
                version=self.version,
                parent_version=self.parent_version,
                contract=self.contract,
                entries=self.entries,
                chunk_bytes=self.chunk_bytes,
                created_unix_ns=self.created_unix_ns,
            )
            t4 = time.perf_counter()
        except BaseException:
            self.pool.release(buf)
            raise
        finally:
            self.parts = []  # the device parts may be freed now (their copies are done)
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                self.pool.release(buf)

        seconds = {"layout": t1 - t0, "acquire": t2 - t1, "fill": t3 - t2, "manifest": t4 - t3}
        return FramedPolicy(manifest, layout, data, release, seconds, host=buf)


def stage(
    *,
    version: int,
    parent_version: int | None,
    contract: Contract,
    tensors: Mapping[str, QuantizedParam],
    pool: BufferPool,
    live: Iterable[torch.Tensor] = (),
    chunk_bytes: int = mf.CHUNK_BYTES,
    threads: int | None = None,
    created_unix_ns: int | None = None,
) -> StagedPublish:
    """Describe a version for publishing (cheap; on the thread that produced `tensors`). Parts that
    share storage with a tensor in `live` (the model's parameters) are cloned here, so the optimizer
    may update the parameters while `run()` copies."""
    mf.check_build(
        version=version, parent_version=parent_version, contract=contract, tensors=tensors, chunk_bytes=chunk_bytes
    )
    entries, parts = mf.describe_tensors(contract, tensors)
    storages = {p.untyped_storage().data_ptr() for p in live}
    parts = [[t.clone() if t.untyped_storage().data_ptr() in storages else t for t in ts] for ts in parts]
    after = None
    if any(t.device.type == "cuda" for ts in parts for t in ts):
        after = torch.cuda.Event()
        after.record()
    return StagedPublish(
        version, parent_version, contract, entries, parts, pool, chunk_bytes, threads, after, created_unix_ns
    )


def build_framed(*, pool: BufferPool, **kw) -> FramedPolicy:
    """`stage(...)` and `run()` in one call (kwargs as stage's)."""
    return stage(pool=pool, **kw).run()


def frame_buffers(
    version: int, items: Sequence[tuple[str, int, object]], chunk_bytes: int, *, threads: int | None = None
) -> tuple[FrameLayout, np.ndarray, list[tuple[list[int], bytes]]]:
    """Tensors' bytes (name, first chunk index, a buffer) framed into a new buffer, in the order given;
    also each one's (chunk xxh3s, sha256)."""
    layout = frame_layout(version, ((name, len(memoryview(b)), first) for name, first, b in items), chunk_bytes)
    data = np.empty(layout.size, dtype=np.uint8)
    sealed = fill(data, layout, [[b] for _, _, b in items], threads=threads)
    return layout, data, sealed


def frame_packed(policy: mf.PackedPolicy, *, threads: int | None = None) -> FramedPolicy:
    """A PackedPolicy (blobs by name) copied into a new framed buffer; every chunk's xxh3 and every
    tensor's sha256 must match its manifest (ValueError naming the first tensor that does not)."""
    m = policy.manifest
    firsts = first_chunk_indices(m)
    items = [(t.name, firsts[t.name], policy.blobs[t.name]) for t in m.tensors]
    layout, data, sealed = frame_buffers(m.version, items, m.chunk_bytes, threads=threads)
    for t, (xxh3s, sha) in zip(m.tensors, sealed):
        bad = [j for j, (a, b) in enumerate(zip(xxh3s, t.chunk_xxh3)) if a != b]
        if bad or len(xxh3s) != len(t.chunk_xxh3):
            raise ValueError(f"publish: tensor {t.name} chunk {bad[:1]}: bytes do not match the manifest's xxh3")
        if sha != t.sha256:
            raise ValueError(f"publish: tensor {t.name}: bytes do not match the manifest's sha256")
    return FramedPolicy(m, layout, data)
