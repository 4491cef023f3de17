"""Client of `tandem.v1.PolicyService`: fetch a policy, verify every byte, rebuild the tensors.

Rules:
- Nothing is used unverified: the manifest (its digest against the signed pointer's, its
  consistency, its contract fingerprint against `expected_fingerprint`, the TP degree), every chunk
  (xxh3) and every tensor (sha256 over its chunks' sha256s, against the manifest; a TP shard against
  the digest the server computed when it cut it). Then stored values no quantizer produces are
  refused (policy.manifest_check.check_values). PolicyClient lists each check.
- Recovery is bounded: at most `max_attempts` stream restarts per fetch, `max_refetch_per_chunk`
  per chunk; every call has a deadline, one fetch (all its streams) `fetch_timeout_s`.
- A delta (broker/delta.py) that fails anything is refused with one log line, counted, and the
  version is fetched whole in the same call (`fetch(parent=...)`).
- `streams` > 1 splits one fetch's tensors by bytes over that many streams (`split_by_bytes`);
  `buffers` keeps the receive memory from one fetch to the next; `cancel` ends a fetch from another
  thread.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import heapq
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker import delta as dl
from broker.delta import HeldPolicy
from broker.frames import page_aligned_empty, page_lock
from broker.signing import RUN_TOKEN_HEADER
from broker.tls import ClientTLS, TLSHandshakeError, handshake_problem
from policy.chunks import ChecksumMismatch, chunk_checksums, chunk_count, first_chunk_indices, tensor_sha256
from policy.contract import FingerprintMismatch, check_fingerprint
from policy.fields import is_int, is_number
from policy.manifest import MAX_MANIFEST_BYTES, manifest_digest, manifest_from_bytes
from policy.manifest_check import check_values
from policy.tp import check_tp
from policy.tp_layout import TensorLayout, check_tp_compatible, rebuild, tensor_layout, tp_plan_of
from tandem.v1 import manifest_pb2, policy_pb2

__all__ = [
    "ChecksumMismatch",
    "FetchCancel",
    "FetchCancelled",
    "FetchStats",
    "FetchedPolicy",
    "FingerprintMismatch",
    "HeldPolicy",
    "PolicyClient",
    "PolicyClientConfig",
    "ReceiveBuffers",
    "TLSHandshakeError",
    "split_by_bytes",
]

log = logging.getLogger("tandem.policy_client")

SERVICE = "/tandem.v1.PolicyService/"
HASH_THREADS = 16  # chunk sha256 threads per fetch at most (and at most one per usable core: hash_threads)
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNKNOWN,
}


@dataclass(frozen=True, kw_only=True)
class PolicyClientConfig:
    """`expected_fingerprint=None` accepts any contract (inspection tools only; workers set it)."""

    address: str
    expected_fingerprint: str | None = None
    call_timeout_s: float = 10.0  # GetManifest, health
    fetch_timeout_s: float = 600.0  # one fetch: all its FetchTensors streams (resumes included)
    max_attempts: int = 8  # stream restarts per fetch (resumes + re-fetches)
    max_refetch_per_chunk: int = 3
    retry_backoff_s: float = 0.05
    max_receive_message_bytes: int = MAX_MANIFEST_BYTES + (1 << 20)
    max_send_message_bytes: int = 4 << 20
    streams: int = 1  # concurrent FetchTensors streams (one connection each) per fetch, tensors split by bytes
    tls: ClientTLS = field(default_factory=ClientTLS)  # plaintext unless tls.ca is set
    run_token: str = field(default="", repr=False)  # sent with every call (broker.signing.policy_token)

    def __post_init__(self) -> None:
        bad = []
        if not isinstance(self.address, str) or ":" not in self.address:
            bad.append(f"address={self.address!r} must be 'host:port'")
        if self.expected_fingerprint is not None and (
            not isinstance(self.expected_fingerprint, str) or len(self.expected_fingerprint) != 64
        ):
            bad.append(f"expected_fingerprint={self.expected_fingerprint!r} must be a 64-char sha256 hex or None")
        for name in ("call_timeout_s", "fetch_timeout_s"):
            v = getattr(self, name)
            if not (is_number(v) and v > 0):
                bad.append(f"{name}={v!r} must be a number > 0")
        if not is_number(self.retry_backoff_s, 0, 10):
            bad.append(f"retry_backoff_s={self.retry_backoff_s!r} must be a number in [0, 10]")
        for name in (
            "max_attempts",
            "max_refetch_per_chunk",
            "max_receive_message_bytes",
            "max_send_message_bytes",
            "streams",
        ):
            v = getattr(self, name)
            if not is_int(v, 1):
                bad.append(f"{name}={v!r} must be an int >= 1")
        bad += self.tls.missing_files()
        if bad:
            raise ValueError("invalid PolicyClientConfig: " + "; ".join(bad))


@dataclass
class FetchStats:
    chunks: int = 0
    bytes: int = 0
    streams: int = 0
    refetched_chunks: int = 0
    resumed_streams: int = 0
    seconds: float = 0.0
    receive_s: float = 0.0  # until the last chunk arrived (hashing overlaps it)
    verify_s: float = 0.0  # after that, until every tensor's digest was checked
    delta_parent: int = 0  # the version the bytes were rebuilt against (0: fetched whole)
    delta_refused: int = 0  # deltas refused (then fetched whole)
    delta_refusal: str = ""  # why the first one was

    def add(self, other: FetchStats) -> None:
        """Another stream's counts into these."""
        for name in ("chunks", "bytes", "streams", "refetched_chunks", "resumed_streams", "delta_refused"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.delta_parent = max(self.delta_parent, other.delta_parent)
        self.delta_refusal = self.delta_refusal or other.delta_refusal


class _DeltaFailed(Exception):
    """A delta stream that cannot be used (one line): the version is fetched whole instead."""


class FetchCancelled(Exception):
    """The fetch was cancelled (`FetchCancel.cancel`) before it completed."""


class FetchCancel:
    """Ends a fetch in progress from another thread: its streams are cancelled at once (a stream
    waiting for data included) and `fetch` raises FetchCancelled."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._calls: set = set()

    def cancel(self) -> None:
        with self._lock:
            self._set = True
            calls = list(self._calls)
        for call in calls:
            call.cancel()

    def is_set(self) -> bool:
        return self._set

    def _register(self, call) -> None:
        with self._lock:
            if not self._set:
                self._calls.add(call)
                return
        call.cancel()

    def _unregister(self, call) -> None:
        with self._lock:
            self._calls.discard(call)


class ReceiveBuffers:
    """Host memory that fetches receive into, kept from one fetch to the next: one slab holding
    every tensor (each at a 4 KiB-aligned offset), reallocated only when the tensors' names or
    sizes change. Memory filled before costs nothing to fill again, while fresh memory pays a page
    fault per page (seconds per GB on the hosts measured: docs/benchmarks.md). `pinned=True` also
    page-locks the slab (cudaHostRegister), so host-to-device copies from it run at DMA speed and
    need no staging copy. A fetch's tensors alias the slab: the next fetch overwrites them, so a
    caller must be done with one version's bytes (e.g. copied them to the GPU) before fetching
    the next."""

    ALIGN = 4096

    def __init__(self, *, pinned: bool = False):
        self.pinned = pinned
        self._key: tuple | None = None
        self._slab: np.ndarray | None = None
        self._unlock: Callable[[], None] | None = None
        self._views: dict[str, np.ndarray] = {}
        self.allocations = 0  # slabs allocated so far (1 while the layout stays the same)

    def views(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        """name -> a uint8 array of that many bytes, in the kept slab (a new one if the set changed)."""
        key = tuple(sorted(sizes.items()))
        if key != self._key:
            self.close()
            offsets, total = self.offsets(sizes)
            self._slab = self._allocate(max(total, 1))
            if self.pinned:
                self._unlock = page_lock(self._slab)
            self._views = {n: self._slab[offsets[n] : offsets[n] + sizes[n]] for n in sizes}
            self._key = key
            self.allocations += 1
        return self._views

    @classmethod
    def offsets(cls, sizes: dict[str, int]) -> tuple[dict[str, int], int]:
        """Each tensor's offset in the slab (by name, each 4 KiB-aligned) and the slab's size."""
        offsets, total = {}, 0
        for name, n in sorted(sizes.items()):
            offsets[name] = total
            total += -(-n // cls.ALIGN) * cls.ALIGN
        return offsets, total

    def _allocate(self, nbytes: int) -> np.ndarray:
        """A new slab of `nbytes` bytes (process-private memory here; shared memory in subclasses),
        in pages of its own when it is to be page-locked."""
        return page_aligned_empty(nbytes) if self.pinned else np.empty(nbytes, dtype=np.uint8)

    def close(self) -> None:
        """Give the slab back (unpinned first)."""
        if self._unlock is not None:
            self._unlock()
            self._unlock = None
        self._slab, self._views, self._key = None, {}, None


@dataclass
class FetchedPolicy:
    manifest: manifest_pb2.Manifest
    tensors: dict  # name -> policy.formats object (a TP shard when tp_size > 1)
    layouts: dict[str, TensorLayout]
    stats: FetchStats = field(default_factory=FetchStats)
    tp_rank: int = 0
    tp_size: int = 1
    data: dict[str, np.ndarray] = field(default_factory=dict)  # the verified bytes the tensors were rebuilt from

    @property
    def version(self) -> int:
        return self.manifest.version

    def held(self) -> HeldPolicy | None:
        """This version to fetch the next against (`fetch(parent=)`), when it holds every tensor whole."""
        if self.tp_size != 1 or sorted(self.data) != sorted(t.name for t in self.manifest.tensors):
            return None
        return HeldPolicy(self.version, manifest_digest(self.manifest), self.data)


@dataclass
class _Resume:
    """Where one fetch's FetchTensors stream resumes: the next chunk index, the restarts so far and
    how often each chunk failed its xxh3."""

    next_index: int = 0
    restarts: int = 0
    refetches: dict[int, int] = field(default_factory=dict)


class _Tensor:
    """Reassembly state of one tensor: bytes received so far, in order, and their chunks' sha256s.

    The buffer is np.empty (no zero-fill pass: the copy in is its first touch), and each chunk's
    sha256 runs in a thread pool (hashlib releases the GIL), overlapping the hashing with receiving;
    the tensor's digest (policy.chunks.tensor_sha256) is taken over them once all are in.
    """

    def __init__(self, layout: TensorLayout, entry: manifest_pb2.TensorEntry, first_index: int, chunk_bytes: int):
        self.layout, self.entry, self.first_index = layout, entry, first_index
        self.data = np.empty(layout.nbytes, dtype=np.uint8)
        self.view = memoryview(self.data)
        self.filled = 0
        self.chunk_sha256: list[concurrent.futures.Future] = []  # one per chunk received, in order
        self.n_chunks = chunk_count(layout.nbytes, chunk_bytes)
        self.chunk_bytes = chunk_bytes
        self.done = False
        self.expected_sha256 = b""
        self.values: concurrent.futures.Future | None = None  # check_values, run once the bytes are all in
        self.rebuilt = b""  # the manifest's sha256, once the bytes were rebuilt from a delta and checked

    def sha256(self) -> bytes:
        """The tensor's digest over its chunks' sha256s (once every chunk is in)."""
        if self.rebuilt:
            return self.rebuilt
        return tensor_sha256(self.layout.nbytes, [f.result() for f in self.chunk_sha256])

    def reset(self) -> None:
        """Nothing received yet (a refused delta: fetched whole next)."""
        self.filled, self.chunk_sha256, self.done, self.values, self.rebuilt = 0, [], False, None, b""


class PolicyClient:
    """Fetches and verifies policies from one PolicyService:

        with PolicyClient(PolicyClientConfig(address="127.0.0.1:50051", expected_fingerprint=fp)) as c:
            policy = c.fetch()  # latest version, full tensors
            policy = c.fetch(7, tp_rank=1, tp_size=2, names=[...])
            policy.tensors["model.layers.0.mlp.experts.0.down_proj.weight"]  # a policy.formats object

    What is checked: with `digest` (the signed pointer's), the manifest's own digest first
    (DigestMismatch: content is authenticated whoever serves it); the manifest's internal
    consistency and contract fingerprint (recomputed from the contract, then compared with
    `expected_fingerprint`: FingerprintMismatch names both); the TP degree against the contract;
    each chunk's xxh3 against the chunk; for a tensor received whole, each chunk's xxh3 and the
    tensor's sha256 (over its chunks' sha256s, policy.chunks.tensor_sha256) against the *manifest*
    (end to end); for a TP shard, whose bytes the manifest does not describe, the digest the server
    computed when it cut the shard, and the shard's size against the layout the TP plan predicts.
    Chunks are sha256-hashed in a thread pool as they arrive; once the digests match, stored values
    no quantizer produces are refused (policy.manifest_check.check_values).

    Recovery: a chunk that fails its checksum is fetched again (the stream restarts at that chunk's
    index); a stream that drops (UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, ...) resumes at the chunk
    after the last good one.

    Deltas: `fetch(parent=HeldPolicy)` (a version this client fetched whole and verified before,
    `FetchedPolicy.held()`) tells the server that version is held; the server may then send a delta
    against it. Every tensor rebuilt from a delta (an unchanged one included) is checked against the
    version's manifest, chunk xxh3s and sha256, as a full fetch is; a delta that fails anything (its
    description, a payload chunk's xxh3, decoding, the rebuilt checksums, a dropped stream: a delta
    stream is not resumed) is refused, counted (`FetchStats.delta_refused`) and the version fetched
    whole. The bytes land where a full fetch's would, which may be the parent's own memory
    (`buffers` holding it, each tensor at its own place): after a fetch into it, failed or not, that
    parent is gone.

    Speed (`bench/bench_swap.py`): with `streams` > 1 each group of tensors is fetched by its own
    FetchTensors stream on its own connection (the RPC selects tensors by name), in parallel
    threads; `fetch(buffers=ReceiveBuffers(...))` receives into host memory kept from one fetch to
    the next (page-locked for a GPU worker); `fetch(cancel=FetchCancel())` lets another thread end a
    fetch at once (a newer version superseded it).
    """

    def __init__(self, config: PolicyClientConfig):
        self.config = config
        self._metadata = ((RUN_TOKEN_HEADER, config.run_token),) if config.run_token else None
        self._channel = self._make_channel()
        self._extra_channels: list = []  # streams 2..N of a fetch, one connection each
        self._get_manifest = self._channel.unary_unary(
            SERVICE + "GetManifest",
            request_serializer=policy_pb2.GetManifestRequest.SerializeToString,
            response_deserializer=None,
        )  # raw bytes: parsed and verified by manifest_from_bytes
        self._fetch = self._fetch_callable(self._channel)
        self._watch = self._channel.unary_stream(
            SERVICE + "WatchVersions",
            request_serializer=policy_pb2.WatchVersionsRequest.SerializeToString,
            response_deserializer=policy_pb2.VersionAnnouncement.FromString,
        )
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _make_channel(self, extra_options: Sequence = ()):
        config = self.config
        options = [
            ("grpc.max_receive_message_length", config.max_receive_message_bytes),
            ("grpc.max_send_message_length", config.max_send_message_bytes),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        tls = config.tls
        if tls.enabled:
            creds = grpc.ssl_channel_credentials(
                root_certificates=Path(tls.ca).read_bytes(),
                private_key=Path(tls.key).read_bytes() if tls.key else None,
                certificate_chain=Path(tls.cert).read_bytes() if tls.cert else None,
            )
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            return grpc.secure_channel(config.address, creds, options=options + list(extra_options))
        return grpc.insecure_channel(config.address, options=options + list(extra_options))

    @staticmethod
    def _fetch_callable(channel):
        return channel.unary_stream(
            SERVICE + "FetchTensors",
            request_serializer=policy_pb2.FetchTensorsRequest.SerializeToString,
            response_deserializer=policy_pb2.TensorChunk.FromString,
        )

    def _fetchers(self, n: int) -> list:
        """FetchTensors callables on n distinct connections (the first is the main channel's)."""
        while len(self._extra_channels) < n - 1:  # a local subchannel pool: a connection of its own
            self._extra_channels.append(self._make_channel([("grpc.use_local_subchannel_pool", 1)]))
        return [self._fetch] + [self._fetch_callable(c) for c in self._extra_channels[: n - 1]]

    def close(self) -> None:
        for c in self._extra_channels:
            c.close()
        self._channel.close()

    def __enter__(self) -> PolicyClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- small calls ------------------------------------------------------------------------------

    def health(self, service: str = "tandem.v1.PolicyService", *, wait_for_ready: bool = False) -> str:
        """The grpc.health.v1 status of `service` ("SERVING", "NOT_SERVING", ...); "" = the whole server."""
        resp = self._health.Check(
            health_pb2.HealthCheckRequest(service=service),
            timeout=self.config.call_timeout_s,
            wait_for_ready=wait_for_ready,
            metadata=self._metadata,
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def get_manifest(self, version: int | None = None, *, digest: str = "") -> manifest_pb2.Manifest:
        """The verified manifest of `version` (latest if None); FingerprintMismatch if not expected;
        DigestMismatch unless its manifest_digest is `digest` (hex, from the signed pointer) when given.

        Waits up to call_timeout_s for the server to become reachable (a rollout may start first)."""
        req = policy_pb2.GetManifestRequest()
        if version is not None:
            req.version = version
        raw = self._manifest_bytes(req)
        m = manifest_from_bytes(raw, digest=digest)
        if version is not None and m.version != version:
            raise ValueError(f"asked for version {version}, server sent version {m.version}")
        if self.config.expected_fingerprint is not None:
            check_fingerprint(m, self.config.expected_fingerprint)
        return m

    def _manifest_bytes(self, req: policy_pb2.GetManifestRequest) -> bytes:
        """GetManifest. A first UNAVAILABLE is a server not up yet or a TLS handshake that fails (gRPC
        tells them apart only as a call that waits until its deadline): `handshake_problem` decides,
        TLSHandshakeError at once for the second, else the call waits up to call_timeout_s."""
        call = functools.partial(self._get_manifest, req, timeout=self.config.call_timeout_s, metadata=self._metadata)
        try:
            return call(wait_for_ready=False)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
        problem = handshake_problem(self.config.address, self.config.tls)
        if problem is not None:
            raise TLSHandshakeError(problem)
        return call(wait_for_ready=True)

    def watch_versions(
        self, after_version: int = 0, *, timeout_s: float = 60.0
    ) -> Iterator[policy_pb2.VersionAnnouncement]:
        """Announcements of versions newer than `after_version`, until `timeout_s` passes (then it
        just ends: DEADLINE_EXCEEDED is the normal end of a watch)."""
        req = policy_pb2.WatchVersionsRequest(after_version=after_version)
        call = self._watch(req, timeout=timeout_s, metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
        finally:
            call.cancel()

    # -- fetching ---------------------------------------------------------------------------------

    def fetch(
        self,
        version: int | None = None,
        *,
        names: Sequence[str] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        check: Callable[[manifest_pb2.Manifest], None] | None = None,
        buffers: ReceiveBuffers | None = None,
        cancel: FetchCancel | None = None,
        digest: str = "",
        parent: HeldPolicy | None = None,
    ) -> FetchedPolicy:
        """Manifest + tensors of `version` (latest if None), all verified, rebuilt via from_parts.
        `digest` as for get_manifest; `check(manifest)` runs before anything is allocated (e.g.
        policy.manifest_check); the bytes land in `buffers` when given (the tensors then alias them),
        else in fresh memory; `parent`: a held version the server may send a delta against."""
        manifest = self.get_manifest(version, digest=digest)
        if check is not None:
            check(manifest)
        raw, layouts, stats = self.fetch_bytes(
            manifest, names=names, tp_rank=tp_rank, tp_size=tp_size, buffers=buffers, cancel=cancel, parent=parent
        )
        entries = {t.name: t for t in manifest.tensors}
        tensors = {n: rebuild(entries[n], layouts[n], data) for n, data in raw.items()}
        return FetchedPolicy(manifest, tensors, layouts, stats, tp_rank, tp_size, raw)

    def fetch_bytes(
        self,
        manifest: manifest_pb2.Manifest,
        *,
        names: Sequence[str] | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        buffers: ReceiveBuffers | None = None,
        cancel: FetchCancel | None = None,
        parent: HeldPolicy | None = None,
    ) -> tuple[dict[str, np.ndarray], dict[str, TensorLayout], FetchStats]:
        """The verified bytes (uint8 numpy arrays) of each selected tensor (or TP shard) of a verified
        manifest, over `config.streams` concurrent streams; `parent` as for `fetch` (whole tensors only)."""
        check_tp(tp_rank, tp_size)
        check_tp_compatible(manifest, tp_size)
        entries = {t.name: t for t in manifest.tensors}
        selected = list(entries) if names is None else list(dict.fromkeys(names))
        unknown = [n for n in selected if n not in entries]
        if unknown:
            raise ValueError(f"version {manifest.version} has no tensor(s) {unknown[:5]}")
        plan = tp_plan_of(manifest)
        first = first_chunk_indices(manifest)
        cb = manifest.chunk_bytes
        state = {
            n: _Tensor(tensor_layout(entries[n], plan, tp_rank, tp_size), entries[n], first[n], cb) for n in selected
        }
        if buffers is not None:
            views = buffers.views({n: t.layout.nbytes for n, t in state.items()})
            for n, t in state.items():
                t.data = views[n]
                t.view = memoryview(t.data)
        sizes = {n: t.layout.nbytes for n, t in state.items()}
        if parent is not None and (tp_size != 1 or parent.version == manifest.version or not parent.covers(sizes)):
            parent = None
        stats = FetchStats()
        t0 = time.perf_counter()
        workers = hash_threads()
        hasher = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256")
        try:
            self._stream_all(manifest, state, names, selected, tp_rank, tp_size, stats, hasher, cancel, parent)
            stats.receive_s = time.perf_counter() - t0
        except BaseException:
            hasher.shutdown(cancel_futures=True)  # a failed or cancelled fetch hashes nothing more
            raise
        finally:
            hasher.shutdown()  # every chunk's sha256 is done
        missing = [n for n, t in state.items() if not t.done]
        if missing:
            raise ChecksumMismatch(
                f"version {manifest.version}: stream ended before tensor(s) {missing[:5]} were complete"
            )
        bad = [n for n, t in state.items() if t.sha256() != t.expected_sha256]
        if bad:
            raise ChecksumMismatch(f"version {manifest.version}: tensor(s) {bad[:5]} failed the sha256 check")
        for t in state.values():  # the bytes are the manifest's: refuse values no quantizer produces
            t.values.result()
        stats.seconds = time.perf_counter() - t0
        stats.verify_s = stats.seconds - stats.receive_s
        return ({n: t.data for n, t in state.items()}, {n: t.layout for n, t in state.items()}, stats)

    def _stream_all(self, manifest, state, names, selected, tp_rank, tp_size, stats, hasher, cancel, parent) -> None:
        """`_stream` over config.streams groups of the selected tensors (about equal bytes each, the
        largest first onto the least loaded group), each on its own connection and thread. A failing
        stream cancels the others; its error is raised."""
        n = min(self.config.streams, len(selected))
        if n <= 1:
            return self._stream(
                manifest, state, names, selected, tp_rank, tp_size, stats, hasher, cancel=cancel, parent=parent
            )
        in_order = sorted(selected, key=lambda x: state[x].first_index)
        groups = split_by_bytes({x: state[x].layout.nbytes for x in in_order}, n)
        cancel = cancel or FetchCancel()
        errors: list = []

        def run(group, fetch) -> FetchStats:
            part = FetchStats()
            try:
                mine = {x: state[x] for x in group}
                self._stream(
                    manifest,
                    mine,
                    group,
                    group,
                    tp_rank,
                    tp_size,
                    part,
                    hasher,
                    fetch=fetch,
                    cancel=cancel,
                    parent=parent,
                )
            except BaseException as e:
                if not isinstance(e, FetchCancelled) or not errors:
                    errors.append(e)
                cancel.cancel()  # the others end now
            return part

        with concurrent.futures.ThreadPoolExecutor(max_workers=len(groups), thread_name_prefix="fetch") as pool:
            parts = list(pool.map(run, groups, self._fetchers(len(groups))))
        for part in parts:
            stats.add(part)
        real = [e for e in errors if not isinstance(e, FetchCancelled)]
        if real or errors:
            raise (real or errors)[0]

    def _stream(
        self, manifest, state, names, selected, tp_rank, tp_size, stats, hasher, *, fetch=None, cancel=None, parent=None
    ) -> None:
        """Run FetchTensors until every selected chunk arrived, resuming and re-fetching as needed
        (on `fetch`: one connection's FetchTensors; the main channel's by default). The first
        request offers `parent`; a delta that fails is refused and the tensors fetched whole."""
        fetch = fetch or self._fetch
        at = _Resume()
        # One deadline for the whole fetch: a connection that stalls (the peer stopped sending, a
        # partition) costs fetch_timeout_s once, not on every one of max_attempts restarts.
        deadline = time.monotonic() + self.config.fetch_timeout_s
        while True:
            offer = parent if at.next_index == 0 else None
            req = _fetch_request(manifest, [] if names is None else selected, tp_rank, tp_size, at.next_index, offer)
            stats.streams += 1
            # Not wait_for_ready: the manifest just came from this server, so if it is gone now (a trainer
            # that died mid-fetch; its successor listens elsewhere) fail fast instead of waiting out
            # fetch_timeout_s on every one of max_attempts restarts.
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(f"version {manifest.version}: fetch cancelled")
            call = fetch(
                req, timeout=max(0.001, deadline - time.monotonic()), wait_for_ready=False, metadata=self._metadata
            )
            if cancel is not None:
                cancel._register(call)
            try:
                bad_index = self._read_call(call, manifest, state, stats, hasher, cancel, offer, at)
            except grpc.RpcError as e:
                if cancel is not None and cancel.is_set():
                    # The call is its own RpcError, and its traceback's frames hold the call and this
                    # frame's buffers: cut it, or that cycle keeps a fetch child's slab until the GC runs.
                    e.__traceback__ = None
                    raise FetchCancelled(f"version {manifest.version}: fetch cancelled") from None
                if (
                    e.code() not in _RETRYABLE
                    or at.restarts >= self.config.max_attempts
                    or time.monotonic() >= deadline
                ):
                    raise
                at.restarts += 1
                stats.resumed_streams += 1
                time.sleep(self.config.retry_backoff_s * at.restarts)
                continue
            except _DeltaFailed as e:
                _refuse_delta(e, manifest, state, stats)
                parent = None
                continue
            finally:
                call.cancel()
                if cancel is not None:
                    cancel._unregister(call)
            if bad_index is None:
                return
            self._refetch(at, bad_index, manifest.version, stats)

    def _read_call(self, call, manifest, state, stats, hasher, cancel, offer, at: _Resume) -> int | None:
        """One FetchTensors call's messages into `state`, `at.next_index` moving past each chunk
        accepted; the index of a chunk that failed its xxh3 (to fetch again), else None (the call
        ended, or it was a delta stream, taken whole by `_take_delta`)."""
        for chunk in call:
            if chunk.HasField("delta"):
                if offer is None or at.next_index:
                    raise ValueError(f"version {manifest.version}: a delta description nobody asked for")
                self._take_delta(call, chunk.delta, manifest, state, offer, stats, hasher, cancel)
                return None
            if not self._accept(chunk, state, manifest, at.next_index, hasher):
                return chunk.chunk_index
            stats.chunks += 1
            stats.bytes += len(chunk.data)
            at.next_index = chunk.chunk_index + 1
        return None

    def _refetch(self, at: _Resume, bad_index: int, version: int, stats: FetchStats) -> None:
        """Resume at a chunk that failed its xxh3; ChecksumMismatch once it failed too often."""
        at.refetches[bad_index] = at.refetches.get(bad_index, 0) + 1
        if at.refetches[bad_index] > self.config.max_refetch_per_chunk or at.restarts >= self.config.max_attempts:
            raise ChecksumMismatch(
                f"version {version}: chunk {bad_index} failed its xxh3 check {at.refetches[bad_index]} times"
            )
        at.restarts += 1
        stats.refetched_chunks += 1
        at.next_index = bad_index

    def _take_delta(self, call, desc, manifest, state, parent: HeldPolicy, stats, hasher, cancel) -> None:
        """The rest of a stream served as a delta against `parent` (described by `desc`): payloads
        received and xxh3-checked, every tensor rebuilt and checked against the manifest. _DeltaFailed
        (one line) on anything wrong, FetchCancelled when cancelled."""
        v = manifest.version
        try:
            payloads, frames = _delta_payloads(desc, manifest, state, parent)
            _receive_payloads(call, manifest, payloads, stats)
            sums = {n: ([0] * t.n_chunks, [b""] * t.n_chunks) for n, t in state.items()}
            jobs = [hasher.submit(_rebuild_piece, *job, sums) for job in _rebuild_jobs(state, parent, payloads, frames)]
            failed = [e for e in (f.exception() for f in jobs) if e is not None]  # all ended: none writes any more
            if failed:
                raise failed[0]
            for t in state.values():
                _check_rebuilt(t, sums)
        except (grpc.RpcError, ValueError, OverflowError) as e:  # DeltaError is a ValueError
            if cancel is not None and cancel.is_set():
                raise FetchCancelled(f"version {v}: fetch cancelled") from None
            why = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
            raise _DeltaFailed(f"delta against v{parent.version} refused: {why[:300]}") from None
        for t in state.values():
            t.rebuilt, t.expected_sha256, t.done = t.entry.sha256, t.entry.sha256, True
            t.values = hasher.submit(check_values, v, t.entry.format, t.layout, t.data)
        stats.delta_parent = parent.version

    @staticmethod
    def _accept(chunk, state: dict[str, _Tensor], manifest, next_index: int, hasher) -> bool:
        """Verify one chunk and copy it in place. False: its payload is corrupt (fetch it again).
        Anything else wrong (order, sizes) is a protocol error: ValueError, no retry."""
        v = manifest.version
        t = state.get(chunk.tensor_name)
        if chunk.version != v or t is None:
            raise ValueError(
                f"version {v}: unexpected chunk {chunk.chunk_index} (version {chunk.version}, "
                f"tensor {chunk.tensor_name!r})"
            )
        data = chunk.data
        if xxhash.xxh3_64_intdigest(data) != chunk.xxh3:
            return False
        cb = manifest.chunk_bytes
        j = chunk.chunk_index - t.first_index
        expect_len = min(cb, t.layout.nbytes - t.filled)
        if (
            chunk.chunk_index < next_index
            or chunk.offset != t.filled
            or j != t.filled // cb
            or j >= t.n_chunks
            or chunk.tensor_nbytes != t.layout.nbytes
            or len(data) != expect_len
            or t.done
        ):
            raise ValueError(
                f"version {v}: chunk {chunk.chunk_index} of tensor {t.layout.name} is out of order "
                f"or mis-sized (offset {chunk.offset}, {len(data)} bytes; expected offset {t.filled}, "
                f"{expect_len} bytes of {t.layout.nbytes})"
            )
        if not t.layout.sharded and chunk.xxh3 != t.entry.chunk_xxh3[j]:
            return False  # the server sent bytes other than the manifest's: fetch again
        end = t.filled + len(data)
        t.view[t.filled : end] = data
        t.chunk_sha256.append(hasher.submit(_sha256, t.view[t.filled : end]))
        t.filled = end
        if j == t.n_chunks - 1:
            # A whole tensor is checked against the manifest (end to end); a shard against the
            # digest the server computed when it cut the shard.
            t.expected_sha256 = t.entry.sha256 if not t.layout.sharded else chunk.tensor_sha256
            if not t.layout.sharded and chunk.tensor_sha256 != t.entry.sha256:
                raise ChecksumMismatch(
                    f"version {v}: tensor {t.layout.name}: the server's sha256 differs from the manifest's"
                )
            t.done = True
            t.values = hasher.submit(check_values, v, t.entry.format, t.layout, t.data)
        return True


def _fetch_request(manifest, names: list[str], tp_rank: int, tp_size: int, start_chunk: int, offer):
    """The FetchTensorsRequest from `start_chunk` of the selected tensors (all when `names` is
    empty), offering the held version `offer` for a delta when it is not None."""
    req = policy_pb2.FetchTensorsRequest(
        version=manifest.version, tensor_names=names, tp_rank=tp_rank, tp_size=tp_size, start_chunk=start_chunk
    )
    if offer is not None:
        req.held.add(version=offer.version, manifest_digest=offer.digest)
    return req


def _refuse_delta(e: Exception, manifest, state: dict[str, _Tensor], stats: FetchStats) -> None:
    """A delta failed: counted, its first reason kept, one log line, every tensor reset for the
    whole fetch that follows."""
    stats.delta_refused += 1
    stats.delta_refusal = stats.delta_refusal or str(e)
    log.warning("version %d: %s; fetching it whole", manifest.version, e)
    for t in state.values():
        t.reset()


def _delta_payloads(desc, manifest, state: dict[str, _Tensor], parent: HeldPolicy) -> tuple[dict, dict]:
    """Check a delta description against the request (its parent, exactly the tensors asked for,
    sane payload and frame sizes): each XOR_ZSTD tensor's empty payload buffer and its frames
    (`_frame_bounds`) by name. DeltaError otherwise."""
    if desc.parent_version != parent.version or desc.parent_manifest_digest != parent.digest:
        raise dl.DeltaError(f"the delta is against v{desc.parent_version}, not the v{parent.version} held")
    names = [t.name for t in desc.tensors]
    if sorted(names) != sorted(state):
        raise dl.DeltaError(f"the delta describes {len(names)} tensors, not the {len(state)} asked for")
    step = desc.frame_tensor_bytes
    if step % manifest.chunk_bytes:
        raise dl.DeltaError(f"frame_tensor_bytes {step} is not a multiple of the chunk size {manifest.chunk_bytes}")
    payloads, frames = {}, {}
    for t in desc.tensors:
        n = state[t.name].layout.nbytes
        if t.encoding == policy_pb2.UNCHANGED and t.payload_bytes == 0 and not t.frame_bytes:
            continue
        if t.encoding != policy_pb2.XOR_ZSTD or not 0 < t.payload_bytes <= dl.max_payload_bytes(n):
            raise dl.DeltaError(f"tensor {t.name}: encoding {t.encoding} with {t.payload_bytes} payload bytes")
        frames[t.name] = _frame_bounds(t, n, step)
        payloads[t.name] = np.empty(t.payload_bytes, dtype=np.uint8)
    return payloads, frames


def _frame_bounds(t, n: int, step: int) -> list[tuple[int, int, int, int]]:
    """A tensor's zstd frames as (tensor start, end, payload start, end); DeltaError when their
    sizes do not cover the tensor (`step` bytes each, the last fewer) and the payload exactly."""
    sizes = list(t.frame_bytes) or [t.payload_bytes]
    starts = list(range(0, n, step)) if step and t.frame_bytes else [0]
    if len(sizes) != len(starts) or sum(sizes) != t.payload_bytes or min(sizes) < 1:
        raise dl.DeltaError(f"tensor {t.name}: {len(sizes)} frames of {sum(sizes)} bytes for {n} bytes")
    bounds, at = [], 0
    for a, size in zip(starts, sizes):
        bounds.append((a, min(n, a + step) if len(starts) > 1 else n, at, at + size))
        at += size
    return bounds


def _receive_payloads(call, manifest, payloads: dict[str, np.ndarray], stats: FetchStats) -> None:
    """The payload chunks of a delta stream into `payloads`, in order, each xxh3-checked (DeltaError
    on a wrong, missing or extra one)."""
    cb, filled, last = manifest.chunk_bytes, dict.fromkeys(payloads, 0), -1
    for chunk in call:
        buf = payloads.get(chunk.tensor_name)
        data = chunk.data
        if (
            buf is None
            or chunk.version != manifest.version
            or chunk.chunk_index <= last
            or chunk.offset != filled[chunk.tensor_name]
            or chunk.tensor_nbytes != buf.nbytes
            or len(data) != min(cb, buf.nbytes - chunk.offset)
        ):
            raise dl.DeltaError(f"unexpected delta chunk {chunk.chunk_index} (tensor {chunk.tensor_name!r})")
        if xxhash.xxh3_64_intdigest(data) != chunk.xxh3:
            raise dl.DeltaError(f"delta chunk {chunk.chunk_index} of tensor {chunk.tensor_name} failed its xxh3 check")
        buf[chunk.offset : chunk.offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        filled[chunk.tensor_name] += len(data)
        last = chunk.chunk_index
        stats.chunks += 1
        stats.bytes += len(data)
    short = [n for n, b in payloads.items() if filled[n] != b.nbytes]
    if short:
        raise dl.DeltaError(f"the delta stream ended before tensor(s) {short[:5]} were complete")


def _rebuild_jobs(state: dict[str, _Tensor], parent: HeldPolicy, payloads: dict, frames: dict) -> list[tuple]:
    """The pieces a delta's tensors are rebuilt in, biggest tensors first: (tensor, parent bytes,
    frame payload or None for the parent's bytes, tensor start, end); a tensor's frames, or pieces of
    FRAME_BYTES of an unchanged one, run in parallel."""
    jobs = []
    for name in sorted(state, key=lambda n: -state[n].layout.nbytes):
        t, par = state[name], dl.as_bytes(parent.data[name])
        if name in frames:
            jobs += [(t, par, payloads[name][pa:pb], a, b) for a, b, pa, pb in frames[name]]
        else:
            step = dl.frame_step(t.chunk_bytes)
            n = t.layout.nbytes
            jobs += [(t, par, None, a, min(n, a + step)) for a in range(0, max(n, 1), step)]
    return jobs


def _rebuild_piece(t: _Tensor, parent: np.ndarray, payload, a: int, b: int, sums: dict) -> None:
    """t's bytes [a, b) from the parent's (XOR the frame `payload`, if any), each chunk hashed right
    after it is rebuilt (while in cache) into sums[name] = (xxh3s, sha256s) at its chunk's index."""
    cb, out, par = t.chunk_bytes, t.data[a:b], parent[a:b]
    if payload is None:
        if out.ctypes.data != par.ctypes.data:  # a parent in place (the same buffers) is already there
            np.copyto(out, par)
        x, s = chunk_checksums(t.data, [(i, min(b, i + cb)) for i in range(a, max(b, a + 1), cb)])
    else:
        x, s = [], []

        def hash_chunk(i: int, k: int) -> None:
            xi, si = chunk_checksums(out, [(i, k)])
            x.extend(xi), s.extend(si)

        dl.decode(t.entry.name, payload, par, out, piece=cb, on_piece=hash_chunk)
    xxh3s, shas = sums[t.entry.name]
    xxh3s[a // cb : a // cb + len(x)], shas[a // cb : a // cb + len(s)] = x, s


def _check_rebuilt(t: _Tensor, sums: dict) -> None:
    """A rebuilt tensor against the manifest: every chunk's xxh3 and its sha256 (DeltaError otherwise)."""
    xxh3s, shas = sums[t.entry.name]
    if xxh3s != list(t.entry.chunk_xxh3) or tensor_sha256(t.layout.nbytes, shas) != t.entry.sha256:
        raise dl.DeltaError(f"tensor {t.entry.name}: rebuilt from the delta, it fails the manifest's checksums")


def split_by_bytes(sizes: dict[str, int], n: int) -> list[list[str]]:
    """The names of `sizes` (name -> bytes) in at most `n` groups of about equal bytes: each name,
    largest first, goes onto the group with the fewest bytes so far (the lower group on a tie);
    each group keeps the order of `sizes`, and no group is empty. With n >= 1 every name is in
    exactly one group; the largest group holds at most mean + the largest tensor's bytes."""
    loads = [(0, i, []) for i in range(n)]
    for name in sorted(sizes, key=lambda x: -sizes[x]):
        load, i, group = heapq.heappop(loads)
        group.append(name)
        heapq.heappush(loads, (load + sizes[name], i, group))
    order = {name: k for k, name in enumerate(sizes)}
    return [sorted(g, key=order.__getitem__) for _, _, g in sorted(loads, key=lambda x: x[1]) if g]


def hash_threads() -> int:
    """The sha256 pool's size: one thread per core this process may run on (its CPU affinity: a
    container's cpuset, not the host's core count), at most HASH_THREADS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(HASH_THREADS, cores))


def _sha256(chunk) -> bytes:
    return hashlib.sha256(chunk).digest()


def check_reachable(target: str, timeout_s: float = 3.0) -> None:
    """ValueError at once for a closed port or an unknown host of `target` (host:port): a gRPC call
    that waits for the channel would retry those until its deadline."""
    host, _, port = target.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"{target!r}: want host:port")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        raise ValueError(f"{target}: connection refused (nothing listens there)") from None
    except socket.gaierror as e:
        raise ValueError(f"{target}: unknown host ({e.strerror})") from None
    except OSError as e:
        raise ValueError(f"{target}: cannot connect: {e.strerror or e}") from None
