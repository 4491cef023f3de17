"""gRPC `tandem.v1.PolicyService`: serves the last `keep_versions` published policies to rollout workers.

Rules:
- grpc.aio runs on its own event loop (uvloop where available) in a background thread; the
  trainer's synchronous code calls the thread-safe `publish()` (PolicyServer shows the use).
- Published versions are immutable and increase: the same content again is a no-op, different
  content a ValueError.
- A version is served from its pre-framed chunk messages (broker.frames): a fetch does no protobuf
  work. A TP shard layout is cut on first request and cached (`_cut_shard`).
- Handlers parse the raw request bytes: a malformed or oversized request gets INVALID_ARGUMENT with
  one line; one above `max_receive_message_bytes` gets gRPC's RESOURCE_EXHAUSTED. Health
  (grpc.health.v1) is NOT_SERVING until the first publish.
- Streams are admitted by `admit` and ended when stalled or past their deadline (PolicyServer).
- A request naming versions the client holds may be answered with a delta (`_delta_for`); a
  version's delta against the version published before it is built when it is published.
Why: docs/design-decisions.md, "Publishing".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from broker import delta as dl
from broker.frames import FramedPolicy, TensorFrames, frame_buffers, frame_packed
from broker.signing import RUN_TOKEN_HEADER
from broker.tls import ServerTLS
from policy.fields import is_int, is_number
from policy.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_NAME_CHARS,
    PackedPolicy,
    chunk_count,
    manifest_digest,
    manifest_to_bytes,
    verify_manifest,
)
from policy.tp import MAX_TP_SIZE
from policy.tp_layout import shard_tensor_bytes, tensor_layout, tp_plan_of
from tandem.v1 import policy_pb2

log = logging.getLogger("tandem.policy_server")

SERVICE_NAME = "tandem.v1.PolicyService"
MAX_HELD_VERSIONS = 16  # FetchTensorsRequest.held entries at most
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True, kw_only=True)
class PolicyServerConfig:
    """`port=0` picks a free port. TLS: `tls=ServerTLS(cert=, key=)`; add `client_ca` to require client certs (mTLS)."""

    host: str = "127.0.0.1"
    port: int = 0
    keep_versions: int = 4
    max_request_bytes: int = 1 << 20  # checked by the handlers: INVALID_ARGUMENT above it
    max_receive_message_bytes: int = 4 << 20  # transport limit: RESOURCE_EXHAUSTED above it
    max_send_message_bytes: int = MAX_MANIFEST_BYTES + (1 << 20)
    max_tensor_names: int = 1 << 16
    shard_layouts_per_version: int = 16
    tls: ServerTLS = field(default_factory=ServerTLS)
    use_uvloop: bool = True
    reflection: bool = False  # gRPC server reflection (grpcurl-style tools can list the services)
    # SO_REUSEPORT: several servers (broker.server_process.ServingProcesses) listen on one port and
    # the kernel spreads connections over them. Off, a taken port is an error.
    reuse_port: bool = False
    start_timeout_s: float = 30.0
    stop_grace_s: float = 2.0
    # Abuse limits: concurrent streams per connection (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS) and in
    # all (RESOURCE_EXHAUSTED beyond); keepalive pings enforced (a client pinging more often than
    # every min_ping_interval_s is disconnected); idle connections closed after idle_s.
    max_streams_per_connection: int = 16
    max_concurrent_rpcs: int = 256
    keepalive_s: float = 60.0
    min_ping_interval_s: float = 10.0
    idle_s: float = 600.0
    # Server-side deadline of one FetchTensors stream (counted in `fetch_deadline_exceeded`; the client
    # resumes at its next chunk). gRPC's asyncio server cannot reset an HTTP/2 stream from a handler, so
    # what the transport buffered for an ended stream goes when its connection goes: connections are
    # closed after fetch_deadline_s (GOAWAY) + fetch_deadline_s (grace).
    fetch_deadline_s: float = 300.0
    # A FetchTensors stream whose reader consumed no chunk for stall_s (gRPC's flow control held the
    # next write that long) is ended (counted in `fetch_stalled`); the client resumes at its next chunk.
    stall_s: float = 5.0
    # Who may hold streams (FetchTensors, WatchVersions): `admit`'s rules. A peer is authenticated by
    # the run token (metadata broker.signing.RUN_TOKEN_HEADER) or, with mTLS, by its client certificate.
    run_token: str = field(default="", repr=False)
    serve_unauthenticated: bool = True
    max_unauthenticated_streams: int = 64
    max_streams_per_peer: int = 16
    # Deltas against a version the client holds (PolicyServer._delta_for); every delta_full_every-th publish full
    # only. Off here (a bare server serves full versions, as its tests expect); the trainer turns it on
    # (trainer.policy_deltas).
    deltas: bool = False
    delta_full_every: int = 16

    def __post_init__(self) -> None:
        bad = []
        for name in (
            "keep_versions",
            "max_request_bytes",
            "max_receive_message_bytes",
            "max_send_message_bytes",
            "max_tensor_names",
            "shard_layouts_per_version",
            "max_streams_per_connection",
            "max_concurrent_rpcs",
            "max_unauthenticated_streams",
            "max_streams_per_peer",
            "delta_full_every",
        ):
            v = getattr(self, name)
            if not is_int(v, 1):
                bad.append(f"{name}={v!r} must be an int >= 1")
        if not is_int(self.port, 0, 65535):
            bad.append(f"port={self.port!r} must be an int in [0, 65535]")
        if not isinstance(self.host, str) or not self.host:
            bad.append(f"host={self.host!r} must be a non-empty string")
        if (
            isinstance(self.max_request_bytes, int)
            and isinstance(self.max_receive_message_bytes, int)
            and self.max_request_bytes > self.max_receive_message_bytes
        ):
            bad.append(
                f"max_request_bytes={self.max_request_bytes} must not exceed "
                f"max_receive_message_bytes={self.max_receive_message_bytes}"
            )
        if isinstance(self.max_send_message_bytes, int) and self.max_send_message_bytes < (2 << 20):
            bad.append(f"max_send_message_bytes={self.max_send_message_bytes} must be >= 2 MiB (1 MiB chunks)")
        if isinstance(self.max_unauthenticated_streams, int) and isinstance(self.max_concurrent_rpcs, int):
            if self.max_unauthenticated_streams >= self.max_concurrent_rpcs:
                bad.append(
                    f"max_unauthenticated_streams={self.max_unauthenticated_streams} must be below "
                    f"max_concurrent_rpcs={self.max_concurrent_rpcs} (the rest is kept for authenticated workers)"
                )
        if not isinstance(self.run_token, str):
            bad.append("run_token must be a string")
        for name in ("serve_unauthenticated", "reuse_port", "deltas"):
            if not isinstance(getattr(self, name), bool):
                bad.append(f"{name}={getattr(self, name)!r} must be a bool")
        bad += self.tls.missing_files()
        for name in (
            "start_timeout_s",
            "stop_grace_s",
            "keepalive_s",
            "min_ping_interval_s",
            "idle_s",
            "fetch_deadline_s",
            "stall_s",
        ):
            v = getattr(self, name)
            if not (is_number(v) and v > 0):
                bad.append(f"{name}={v!r} must be a number > 0")
        if bad:
            raise ValueError("invalid PolicyServerConfig: " + "; ".join(bad))


@dataclass
class _Layout:
    """Pre-serialized TensorChunk messages of one (version, tp_rank, tp_size), in chunk-index order."""

    indices: list[int] = field(default_factory=list)  # chunk_index of each message (rising)
    messages: list[memoryview] = field(default_factory=list)  # slices of a framed buffer
    payloads: list[memoryview] = field(default_factory=list)  # each message's data field
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # tensor -> [start, stop) in the lists

    def add_frames(self, frames: TensorFrames, data) -> None:
        mv = memoryview(data)
        start = len(self.messages)
        for j, ((a, b), (c, d)) in enumerate(zip(frames.messages, frames.data)):
            self.indices.append(frames.first_index + j)
            self.messages.append(mv[a:b])
            self.payloads.append(mv[c:d])
        self.ranges[frames.name] = (start, len(self.messages))

    def reuse_tensor(self, other: _Layout, name: str) -> None:
        a, b = other.ranges[name]
        start = len(self.messages)
        self.indices += other.indices[a:b]
        self.messages += other.messages[a:b]
        self.payloads += other.payloads[a:b]
        self.ranges[name] = (start, len(self.messages))

    def tensor_bytes(self, name: str) -> bytes:
        a, b = self.ranges[name]
        return b"".join(self.payloads[a:b])

    def chunk_payloads(self, name: str, first: int, count: int) -> list[memoryview]:
        """The tensor's chunks [first, first + count) (fewer at its end), no copy."""
        a, b = self.ranges[name]
        return self.payloads[a + first : min(b, a + first + count)]


class _Version:
    """One published policy: immutable once built (the shard cache only grows, on the loop thread).
    `readers` (streams and shard cuts reading its buffer) and `evicted` are guarded by the server's lock."""

    def __init__(self, policy: PackedPolicy | FramedPolicy):
        m = policy.manifest
        verify_manifest(m)
        names = [t.name for t in m.tensors]
        if isinstance(policy, PackedPolicy):
            if sorted(policy.blobs) != names:
                missing = sorted(set(names) - set(policy.blobs))
                extra = sorted(set(policy.blobs) - set(names))
                raise ValueError(f"publish: blobs do not match the manifest (missing {missing[:5]}, extra {extra[:5]})")
            for t in m.tensors:
                if len(policy.blobs[t.name]) != t.nbytes:
                    raise ValueError(
                        f"publish: tensor {t.name} has {len(policy.blobs[t.name])} bytes, manifest says {t.nbytes}"
                    )
            policy = frame_packed(policy)  # one copy, xxh3 and sha256 re-checked
        else:
            lay = policy.layout
            framed = [(f.name, f.nbytes) for f in lay.tensors]
            if framed != [(t.name, t.nbytes) for t in m.tensors] or lay.version != m.version:
                raise ValueError("publish: the framed buffer does not match the manifest (tensors, sizes or version)")
            if lay.chunk_bytes != m.chunk_bytes:
                raise ValueError(f"publish: framed with chunk_bytes={lay.chunk_bytes}, manifest says {m.chunk_bytes}")
        self.release = policy.release
        self.readers = 0
        self.evicted = False
        self.manifest = m
        self.version = m.version
        self.manifest_bytes = manifest_to_bytes(m)
        self.plan = tp_plan_of(m)
        self.entries = {t.name: t for t in m.tensors}
        self.full = _Layout()
        self.full_frames = policy.layout.tensors
        for frames in policy.layout.tensors:
            self.full.add_frames(frames, policy.data)
        announcement = policy_pb2.VersionAnnouncement(
            version=m.version,
            created_unix_ns=m.created_unix_ns,
            contract_fingerprint=m.contract_fingerprint,
            total_bytes=m.total_bytes,
            tensor_count=len(m.tensors),
        )
        if m.HasField("parent_version"):
            announcement.parent_version = m.parent_version
        self.announcement_bytes = announcement.SerializeToString(deterministic=True)
        self.shards: OrderedDict[tuple[int, int], asyncio.Future] = OrderedDict()
        self.deltas: OrderedDict[int, asyncio.Future] = OrderedDict()  # parent version -> _Delta | None
        self.full_only = False  # served full only (set at install: every delta_full_every-th publish)

    def build_shard(self, tp_rank: int, tp_size: int) -> _Layout:
        """Cut every tensor for one rank (runs in a worker thread; reads only immutable state)."""
        first_index = {f.name: f.first_index for f in (self.full_frames or ())}
        cut = {}
        for name, entry in self.entries.items():
            tl = tensor_layout(entry, self.plan, tp_rank, tp_size)
            if tl.sharded:
                cut[name] = shard_tensor_bytes(entry, self.full.tensor_bytes(name), tl)
        items = [(name, first_index[name], data) for name, data in cut.items()]
        frames, data, _ = frame_buffers(self.version, items, self.manifest.chunk_bytes)  # hashed in a pool
        framed = {f.name: f for f in frames.tensors}
        layout = _Layout()
        for name in self.entries:
            if name in framed:
                layout.add_frames(framed[name], data)
            else:
                layout.reuse_tensor(self.full, name)
        return layout


@dataclass
class _Delta:
    """A version's delta against one parent: each tensor's (encoding, payload bytes), and the XOR_ZSTD
    payloads' chunk messages (their own chunk index space; `layout.ranges` has the changed tensors)."""

    parent: int
    parent_digest: bytes
    encodings: dict[str, tuple[int, list[int]]]  # name -> (encoding, its zstd frames' sizes)
    layout: _Layout
    payload_bytes: int
    frame_tensor_bytes: int

    def header(self, version: int, names: list[str]) -> bytes:
        """The stream's first message: the description of `names` (manifest order)."""
        d = policy_pb2.DeltaDescription(
            parent_version=self.parent, parent_manifest_digest=self.parent_digest,
            frame_tensor_bytes=self.frame_tensor_bytes,
        )  # fmt: skip
        for n in names:
            encoding, frames = self.encodings[n]
            d.tensors.add(name=n, encoding=encoding, payload_bytes=sum(frames), frame_bytes=frames)
        return policy_pb2.TensorChunk(version=version, delta=d).SerializeToString(deterministic=True)


def build_delta(v: _Version, parent: _Version, parent_digest: bytes, *, threads: int | None = None) -> _Delta | None:
    """v's delta against `parent` (reads both buffers: the caller holds them), or None when there is
    none (tensors that do not match up, broker.delta rule 1) or it is not smaller than v."""
    sizes = {n: e.nbytes for n, e in v.entries.items()}
    if dl.xor_compatible(sizes, {n: e.nbytes for n, e in parent.entries.items()}):
        return None
    names, cb = [t.name for t in v.manifest.tensors], v.manifest.chunk_bytes
    step = dl.frame_step(cb)
    changed = [n for n in names if v.entries[n].sha256 != parent.entries[n].sha256]  # equal digests: equal bytes
    pieces = [  # every frame of every changed tensor, the biggest tensors' first
        (n, a) for n in sorted(changed, key=lambda n: -v.entries[n].nbytes) for a in range(0, v.entries[n].nbytes, step)
    ]

    def encode(piece: tuple[str, int]) -> bytes:  # one frame: whole chunks (step is), read in place
        name, a = piece
        new, old = (x.full.chunk_payloads(name, a // cb, step // cb) for x in (v, parent))
        return dl.encode_pieces(new, old)[0]

    workers = threads or min(16, os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="policy-delta") as pool:
        frames = dict(zip(pieces, pool.map(encode, pieces)))
    total = sum(len(f) for f in frames.values())
    if not dl.worth_it(total, v.manifest.total_bytes):
        return None
    items, encodings, index, frames_of = [], dict.fromkeys(names, (policy_pb2.UNCHANGED, [])), 0, set(changed)
    for name in (n for n in names if n in frames_of):
        parts = [frames[(name, a)] for a in range(0, v.entries[name].nbytes, step)]
        encodings[name] = (policy_pb2.XOR_ZSTD, [len(f) for f in parts])
        payload = b"".join(parts)
        items.append((name, index, payload))
        index += chunk_count(len(payload), cb)
    layout = _Layout()
    if items:
        frames, data, _ = frame_buffers(v.version, items, cb, threads=workers)
        for f in frames.tensors:
            layout.add_frames(f, data)
    return _Delta(parent.version, parent_digest, encodings, layout, total, step)


def _delta_selection(d: _Delta, v: _Version, req) -> tuple[list[bytes], _Layout, list[int]]:
    """A delta stream's first message (the description of the requested tensors, manifest order),
    the layout its chunks come from, and the positions of the requested ones from start_chunk on."""
    order = {t.name: i for i, t in enumerate(v.manifest.tensors)}
    names = sorted(set(req.tensor_names or v.entries), key=order.__getitem__)
    layout = d.layout
    ranges = sorted(layout.ranges[n] for n in names if n in layout.ranges)
    positions = [i for a, b in ranges for i in range(a, b) if layout.indices[i] >= req.start_chunk]
    return [d.header(v.version, names)], layout, positions


def admit(
    *, authenticated: bool, streams: int, peer_streams: int, unauthenticated_streams: int, config: PolicyServerConfig
) -> tuple[grpc.StatusCode, str] | None:
    """Why a new stream (or, with zero counts, a request) is refused (status, reason), or None to admit it. `streams`:
    the streams served now; `peer_streams`: those of the peer's client address (its IP);
    `unauthenticated_streams`: those of all unauthenticated peers. Rules, in order:
    1. no stream beyond max_concurrent_rpcs;
    2. an authenticated peer is admitted;
    3. an unauthenticated peer is refused when the server has a run token and serve_unauthenticated is off;
    4. with a run token (workers to keep capacity for), it is refused when unauthenticated peers hold
       max_unauthenticated_streams already: the rest of max_concurrent_rpcs stays for the workers;
    5. it is refused when its address holds max_streams_per_peer already."""
    if streams >= config.max_concurrent_rpcs:
        return EXHAUSTED, f"{streams} streams are being served, the limit"
    if authenticated:
        return None
    if config.run_token and not config.serve_unauthenticated:
        return grpc.StatusCode.UNAUTHENTICATED, "this server serves authenticated workers only (the run token or mTLS)"
    if config.run_token and unauthenticated_streams >= config.max_unauthenticated_streams:
        return EXHAUSTED, f"unauthenticated peers hold {unauthenticated_streams} streams, the limit"
    if peer_streams >= config.max_streams_per_peer:
        return EXHAUSTED, f"this address holds {peer_streams} streams, the per-peer limit for unauthenticated peers"
    return None


def peer_address(peer: str) -> str:
    """A gRPC peer string without its port: "ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1" (one per host)."""
    head, sep, port = peer.rpartition(":")
    return head if sep and port.isdigit() else peer


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _grpc_options(cfg) -> list[tuple[str, int]]:
    """The gRPC server's channel options: message sizes, stream cap, keepalive, connection ages."""
    return [
        ("grpc.max_receive_message_length", cfg.max_receive_message_bytes),
        ("grpc.max_send_message_length", cfg.max_send_message_bytes),
        ("grpc.so_reuseport", int(cfg.reuse_port)),
        ("grpc.max_concurrent_streams", cfg.max_streams_per_connection),
        ("grpc.keepalive_time_ms", int(cfg.keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.http2.min_ping_interval_without_data_ms", int(cfg.min_ping_interval_s * 1000)),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.max_connection_idle_ms", int(cfg.idle_s * 1000)),
        ("grpc.max_connection_age_ms", int(cfg.fetch_deadline_s * 1000)),
        ("grpc.max_connection_age_grace_ms", int(cfg.fetch_deadline_s * 1000)),
    ]


def _bind(server, cfg) -> int:
    """Bind cfg.host:cfg.port (TLS, with client certificates when client_ca is set); the port bound."""
    address = f"{cfg.host}:{cfg.port}"
    if cfg.tls.enabled:
        creds = grpc.ssl_server_credentials(
            [(Path(cfg.tls.key).read_bytes(), Path(cfg.tls.cert).read_bytes())],
            root_certificates=Path(cfg.tls.client_ca).read_bytes() if cfg.tls.client_ca else None,
            require_client_auth=bool(cfg.tls.client_ca),
        )
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if not port:
        raise OSError(f"could not bind {address}")
    return port


class PolicyServer:
    """The policy service on a background event loop. All public methods are thread-safe:

        server = PolicyServer(PolicyServerConfig(port=0))
        port = server.start()
        server.publish(build_manifest(version=1, ...))
        ...
        server.stop()

    The trainer frames a version straight into a pooled, page-locked buffer (`publish(FramedPolicy)`:
    no host copy at publish); a `PackedPolicy` is copied into a new framed buffer once. A
    FramedPolicy's buffer goes back to its pool when the version is evicted and no stream or shard
    cut still reads it. A shard layout reuses the full layout's messages for the tensors it does
    not cut (replicated ones).

    Capacity: a FetchTensors stream whose reader takes no chunk for `stall_s` (each `context.write`
    returns when HTTP/2 flow control lets the message out) or that runs past `fetch_deadline_s` is
    ended (counted: `fetch_stalled`, `fetch_deadline_exceeded`); the client resumes at its next
    chunk. Streams (FetchTensors, WatchVersions) are admitted by `admit`; with a `run_token` and
    `serve_unauthenticated` off only authenticated peers (the token as metadata, or an mTLS
    certificate) are served at all. `stats()` has gauges (`active_fetches`, `active_watches`,
    `streams`, `unauthenticated_streams`), also on Prometheus.
    """

    def __init__(self, config: PolicyServerConfig):
        self.config = config
        self._lock = threading.Lock()  # guards _versions, _digests, _latest, hooks, counters
        self._versions: OrderedDict[int, _Version] = OrderedDict()
        self._digests: dict[int, bytes] = {}  # every version ever published -> content digest
        self._latest = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._changed: asyncio.Condition | None = None
        self._stopping: asyncio.Event | None = None
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="policy-shard")
        self._port = 0
        # Totals, and two gauges: the FetchTensors / WatchVersions handlers running now.
        self._counters = {
            "fetch_streams": 0,
            "chunks_sent": 0,
            "bytes_sent": 0,
            "rejected_requests": 0,
            "fetch_deadline_exceeded": 0,
            "fetch_stalled": 0,
            "refused_unauthenticated": 0,
            "refused_limit": 0,
            "active_fetches": 0,
            "active_watches": 0,
            "streams": 0,
            "unauthenticated_streams": 0,
            "delta_streams": 0,
            "deltas_built": 0,
        }
        self._published = 0  # versions installed (every delta_full_every-th is served full only)
        self._peer_streams: dict[str, int] = {}  # unauthenticated client address -> streams it holds

    # -- lifecycle ----------------------------------------------------------------------------

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self._port}"

    def start(self) -> int:
        """Start serving in a background thread; return the bound port."""
        if self._thread is not None:
            raise RuntimeError("PolicyServer already started")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = _new_event_loop(self.config.use_uvloop)
            self._loop = loop
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as e:  # reported to start() below
                failure.append(e)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="policy-server", daemon=True)
        self._thread.start()
        if not ready.wait(self.config.start_timeout_s):
            raise TimeoutError(f"policy server did not start within {self.config.start_timeout_s} s")
        if failure:
            raise RuntimeError(f"policy server failed to start: {failure[0]}") from failure[0]
        return self._port

    def stop(self) -> None:
        if self._thread is None or self._loop is None or self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._signal_stop(), self._loop).result(self.config.stop_grace_s + 10)
        except RuntimeError:  # loop already stopped
            pass
        self._thread.join(self.config.stop_grace_s + 10)
        self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> PolicyServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _serve(self, ready: threading.Event) -> None:
        cfg = self.config
        self._changed = asyncio.Condition()
        self._stopping = asyncio.Event()
        # no maximum_concurrent_rpcs: gRPC frees its slot only when the HTTP/2 stream closes (`admit` caps)
        server = grpc.aio.server(options=_grpc_options(cfg))
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    SERVICE_NAME,
                    {
                        "GetManifest": grpc.unary_unary_rpc_method_handler(self._get_manifest),
                        "FetchTensors": grpc.unary_stream_rpc_method_handler(self._fetch_tensors),
                        "WatchVersions": grpc.unary_stream_rpc_method_handler(self._watch_versions),
                    },
                ),
            )
        )
        await self._add_health(server)
        if cfg.reflection:
            from grpc_reflection.v1alpha import reflection

            reflection.enable_server_reflection(
                (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
                server,
            )
        port = _bind(server, cfg)
        await server.start()
        self._server, self._port = server, port
        log.info("policy server listening on %s:%d (%s)", cfg.host, port, "TLS" if cfg.tls.enabled else "plaintext")
        ready.set()
        await self._stopping.wait()
        await self._health.enter_graceful_shutdown()
        async with self._changed:
            self._changed.notify_all()
        await server.stop(cfg.stop_grace_s)

    async def _add_health(self, server) -> None:
        """The standard health service: SERVING once a version is published."""
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        status = health_pb2.HealthCheckResponse.SERVING if self._latest else health_pb2.HealthCheckResponse.NOT_SERVING
        await self._health.set("", status)
        await self._health.set(SERVICE_NAME, status)

    async def _signal_stop(self) -> None:
        self._stopping.set()

    # -- publishing ---------------------------------------------------------------------------

    def publish(self, policy: PackedPolicy | FramedPolicy) -> bool:
        """Publish a version. True if new; False if this exact content was already published.

        A FramedPolicy (broker.frames) is served from its buffer as it is; a PackedPolicy is copied
        into a new framed buffer here, in the caller's thread (one copy, in parallel threads). A
        FramedPolicy that is not installed (already published, or refused) is released at once.
        """
        installed = False
        try:
            m = policy.manifest
            digest = manifest_digest(m)
            with self._lock:
                known = self._digests.get(m.version)
                if known is not None:
                    if known != digest:
                        raise ValueError(
                            f"publish: version {m.version} was already published with different "
                            f"content; published versions are immutable"
                        )
                    return False
                if m.version <= self._latest:
                    raise ValueError(
                        f"publish: version {m.version} is not newer than the latest published version {self._latest}"
                    )
            built = _Version(policy)
            if self._loop is None or self._thread is None:
                raise RuntimeError("publish: start() the server first")
            installed = asyncio.run_coroutine_threadsafe(self._install(built, digest), self._loop).result(30)
            return installed
        finally:
            if not installed and isinstance(policy, FramedPolicy) and policy.release is not None:
                policy.release()

    def _hold(self, v: _Version) -> None:
        """One more reader of v's buffer; NOT_FOUND if v was evicted since it was looked up."""
        with self._lock:
            if v.evicted:
                raise _Abort(grpc.StatusCode.NOT_FOUND, f"version {v.version} is no longer held")
            v.readers += 1

    def _unhold(self, v: _Version) -> None:
        with self._lock:
            v.readers -= 1
            self._maybe_release(v)

    def _maybe_release(self, v: _Version) -> None:
        """Give an evicted version's buffer back to its pool once nothing reads it (caller holds _lock)."""
        if v.evicted and v.readers == 0 and v.release is not None:
            release, v.release = v.release, None
            release()

    async def _install(self, v: _Version, digest: bytes) -> bool:
        first = False
        with self._lock:
            if v.version in self._digests:  # a concurrent publish of the same version won
                if self._digests[v.version] != digest:
                    raise ValueError(f"publish: version {v.version} was already published with different content")
                return False
            if v.version <= self._latest:
                raise ValueError(f"publish: version {v.version} is not newer than {self._latest}")
            self._digests[v.version] = digest
            v.full_only = self._published % self.config.delta_full_every == 0
            self._published += 1
            first = self._latest == 0
            previous = self._versions.get(self._latest)
            self._latest = v.version
            self._versions[v.version] = v
            while len(self._versions) > self.config.keep_versions:
                _, old = self._versions.popitem(last=False)
                old.evicted = True
                self._maybe_release(old)
        if self.config.deltas and not v.full_only and previous is not None and not previous.evicted:
            self._start_delta(v, previous)  # against the version the workers hold, before they ask
        if first:
            await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
            await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "published policy version %d (%d tensors, %d bytes)", v.version, len(v.entries), v.manifest.total_bytes
        )
        async with self._changed:
            self._changed.notify_all()
        return True

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._versions)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def prometheus_samples(self):
        """(kind, name, help, value) of stats() for broker.metrics.MetricsEndpoint.add_callback."""
        s = self.stats()
        yield (
            "gauge",
            "tandem_policy_active_fetches",
            "FetchTensors streams being served now (streams)",
            s["active_fetches"],
        )
        yield "gauge", "tandem_policy_active_watches", "WatchVersions streams open now (streams)", s["active_watches"]
        yield (
            "counter",
            "tandem_policy_fetch_streams_total",
            "FetchTensors streams started (streams)",
            s["fetch_streams"],
        )
        yield (
            "counter",
            "tandem_policy_fetch_deadline_exceeded_total",
            "FetchTensors streams ended by the server's fetch deadline (streams)",
            s["fetch_deadline_exceeded"],
        )
        yield (
            "counter",
            "tandem_policy_fetch_stalled_total",
            "FetchTensors streams ended because their reader took no chunk for stall_s (streams)",
            s["fetch_stalled"],
        )
        yield (
            "counter",
            "tandem_policy_refused_unauthenticated_total",
            "requests refused for want of the run token or a client certificate (requests)",
            s["refused_unauthenticated"],
        )
        yield (
            "counter",
            "tandem_policy_refused_limit_total",
            "streams refused by the server's, the unauthenticated or the per-peer limit (streams)",
            s["refused_limit"],
        )
        yield (
            "gauge",
            "tandem_policy_unauthenticated_streams",
            "streams held by unauthenticated peers now (streams)",
            s["unauthenticated_streams"],
        )
        yield "counter", "tandem_policy_chunks_sent_total", "tensor chunks handed to gRPC (chunks)", s["chunks_sent"]
        yield "counter", "tandem_policy_sent_bytes_total", "TensorChunk bytes handed to gRPC (bytes)", s["bytes_sent"]
        yield "counter", "tandem_policy_rejected_requests_total", "requests refused (requests)", s["rejected_requests"]
        yield (
            "counter",
            "tandem_policy_delta_streams_total",
            "FetchTensors streams served as a delta against a version the client holds (streams)",
            s["delta_streams"],
        )
        yield (
            "counter",
            "tandem_policy_deltas_built_total",
            "delta versions built (XOR + zstd against a parent), at publish or when first asked for (deltas)",
            s["deltas_built"],
        )

    # -- handlers -----------------------------------------------------------------------------

    def _parse(self, cls, request: bytes):
        if len(request) > self.config.max_request_bytes:
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request of {len(request)} bytes exceeds the limit of {self.config.max_request_bytes}",
            )
        msg = cls()
        try:
            msg.ParseFromString(request)
        except Exception as e:  # DecodeError: malformed bytes
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.DESCRIPTOR.name}: {e}") from None
        return msg

    def _lookup(self, version: int | None) -> _Version:
        with self._lock:
            if not self._versions:
                raise _Abort(grpc.StatusCode.UNAVAILABLE, "no policy has been published yet")
            if version is None:
                return self._versions[next(reversed(self._versions))]
            v = self._versions.get(version)
            if v is None:
                raise _Abort(grpc.StatusCode.NOT_FOUND, f"version {version} is not held (held: {list(self._versions)})")
            return v

    async def _reject(self, context, e: _Abort) -> None:
        with self._lock:
            self._counters["rejected_requests"] += 1
        await context.abort(e.code, e.message)

    def _authenticated(self, context) -> bool:
        if self.config.tls.client_ca:  # mTLS: gRPC let in only peers whose certificate that CA signed
            return True
        token = self.config.run_token
        if not token:
            return False
        sent = dict(context.invocation_metadata() or ()).get(RUN_TOKEN_HEADER, "")
        return isinstance(sent, str) and hmac.compare_digest(sent.encode(), token.encode())

    def _admit(self, context, *, stream: bool = True) -> tuple[str, bool]:
        """(address, authenticated) of an admitted caller, its stream counted (`_release` uncounts it);
        _Abort (UNAUTHENTICATED or RESOURCE_EXHAUSTED, counted) when `admit` refuses it."""
        authenticated = self._authenticated(context)
        address = peer_address(context.peer() or "")
        with self._lock:
            c = self._counters
            counts = (c["streams"], self._peer_streams.get(address, 0), c["unauthenticated_streams"])
            why = admit(
                authenticated=authenticated,
                streams=counts[0] if stream else 0,
                peer_streams=counts[1] if stream else 0,
                unauthenticated_streams=counts[2] if stream else 0,
                config=self.config,
            )
            if why is not None:
                code, reason = why
                c["refused_limit" if code == EXHAUSTED else "refused_unauthenticated"] += 1
                raise _Abort(code, reason)
            if stream:
                c["streams"] += 1
                if not authenticated:
                    self._peer_streams[address] = counts[1] + 1
                    c["unauthenticated_streams"] += 1
        return address, authenticated

    def _release(self, slot: tuple[str, bool]) -> None:
        address, authenticated = slot
        with self._lock:
            self._counters["streams"] -= 1
            if not authenticated:
                self._counters["unauthenticated_streams"] -= 1
                left = self._peer_streams.pop(address) - 1
                if left:
                    self._peer_streams[address] = left

    async def _get_manifest(self, request: bytes, context) -> bytes:
        try:
            self._admit(context, stream=False)
            req = self._parse(policy_pb2.GetManifestRequest, request)
            return self._lookup(req.version if req.HasField("version") else None).manifest_bytes
        except _Abort as e:
            await self._reject(context, e)

    def _selection(self, req, v: _Version, layout: _Layout) -> list[int]:
        """Positions in `layout` of the requested chunks, rising."""
        if not req.tensor_names:
            ranges = [(0, len(layout.messages))]
        elif len(req.tensor_names) > len(layout.ranges):  # bounded work: no more names than tensors
            raise _Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(req.tensor_names)} tensor names for a version of {len(layout.ranges)} tensors",
            )
        else:
            unknown = sorted({n for n in req.tensor_names if n not in layout.ranges})
            if unknown:
                raise _Abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"version {v.version} has no tensor(s) {unknown[:5]}"
                    + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""),
                )
            ranges = sorted({layout.ranges[n] for n in req.tensor_names})
        out = []
        for a, b in ranges:
            out += [i for i in range(a, b) if layout.indices[i] >= req.start_chunk]
        return out

    async def _layout_for(self, v: _Version, tp_rank: int, tp_size: int) -> _Layout:
        if tp_size == 1:
            return v.full
        key = (tp_rank, tp_size)
        fut = v.shards.get(key)
        if fut is None:
            fut = asyncio.wrap_future(self._executor.submit(self._cut_shard, v, tp_rank, tp_size))
            v.shards[key] = fut
            while len(v.shards) > self.config.shard_layouts_per_version:
                v.shards.popitem(last=False)
        else:
            v.shards.move_to_end(key)
        try:
            return await asyncio.shield(fut)
        except _Abort:  # evicted before the cut started
            if v.shards.get(key) is fut:
                v.shards.pop(key)
            raise
        except ValueError as e:  # the TP plan refuses this split
            if v.shards.get(key) is fut:
                v.shards.pop(key)
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except Exception as e:  # a bug: do not cache it, report it
            if v.shards.get(key) is fut:
                v.shards.pop(key)
            log.exception("cutting TP shard %s of version %d failed", key, v.version)
            raise _Abort(grpc.StatusCode.INTERNAL, f"cutting TP shard {key} failed: {e}") from None

    def _cut_shard(self, v: _Version, tp_rank: int, tp_size: int) -> _Layout:
        self._hold(v)  # the cut reads v's buffer
        try:
            return v.build_shard(tp_rank, tp_size)
        finally:
            self._unhold(v)

    async def _fetch_tensors(self, request: bytes, context) -> None:
        """FetchTensors: the messages of `_fetch_messages`, each written within stall_s of the reader
        taking the one before (`context.write` returns when flow control lets the message out), all
        within fetch_deadline_s."""
        try:
            slot = self._admit(context)
        except _Abort as e:
            await self._reject(context, e)
            return
        cfg, loop = self.config, asyncio.get_running_loop()
        stream = self._fetch_messages(request, context)
        with self._lock:
            self._counters["active_fetches"] += 1
        end = loop.time() + cfg.fetch_deadline_s
        stalled = None  # True: ended for want of progress, False: by the deadline
        try:
            async with asyncio.timeout_at(end) as timer:
                async for msg in stream:
                    timer.reschedule(min(end, loop.time() + cfg.stall_s))
                    await context.write(msg)
        except TimeoutError:
            stalled = timer.when() < end
        finally:
            await stream.aclose()  # the counters are final when the stream's capacity is given back
            with self._lock:
                self._counters["active_fetches"] -= 1
                if stalled is not None:
                    self._counters["fetch_stalled" if stalled else "fetch_deadline_exceeded"] += 1
            self._release(slot)
        if stalled is not None:
            await self._end_stream(context, stalled)

    async def _end_stream(self, context, stalled: bool) -> None:
        """Abort a FetchTensors the server ended. Its status queues behind the data its reader left
        unread, so a reader that reads no more never gets it: after stall_s more the handler gives up
        (a cancelled handler sends no status) and ends; the HTTP/2 stream itself (gRPC asyncio cannot
        reset one) stays with its connection until that closes."""
        cfg = self.config
        why = f"no chunk taken for {cfg.stall_s} s" if stalled else f"past the deadline of {cfg.fetch_deadline_s} s"
        try:
            async with asyncio.timeout(cfg.stall_s):
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"FetchTensors ended: {why}; resume there")
        except TimeoutError:
            raise asyncio.CancelledError from None

    async def _fetch_messages(self, request: bytes, context):
        """The requested chunk messages, in order (or an abort naming what is wrong with the request).

        The tests inject faults (corrupted chunks, dropped streams) from outside by wrapping this
        generator in a subclass (tests/integration/test_policy_grpc.py)."""
        try:
            req = self._parse(policy_pb2.FetchTensorsRequest, request)
            tp_size = req.tp_size or 1
            bad = []
            if req.version < 1:
                bad.append("version must be set (>= 1); GetManifest gives the latest")
            if tp_size > MAX_TP_SIZE:
                bad.append(f"tp_size={tp_size} exceeds {MAX_TP_SIZE}")
            if req.tp_rank >= tp_size:
                bad.append(f"tp_rank={req.tp_rank} must be below tp_size={tp_size}")
            if len(req.tensor_names) > self.config.max_tensor_names:
                bad.append(f"{len(req.tensor_names)} tensor names exceed the limit of {self.config.max_tensor_names}")
            if any(len(n) > MAX_NAME_CHARS for n in req.tensor_names):
                bad.append(f"a tensor name is longer than {MAX_NAME_CHARS} characters")
            if len(req.held) > MAX_HELD_VERSIONS:
                bad.append(f"{len(req.held)} held versions exceed the limit of {MAX_HELD_VERSIONS}")
            if bad:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "; ".join(bad))
            v = self._lookup(req.version)
            pinned = v.manifest.contract.tp_plan.partition_tp_size
            if pinned and tp_size != pinned:
                raise _Abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"version {v.version} uses tp_scale_mode 'shard', which pins tp_size={pinned}; "
                    f"requested tp_size={tp_size}",
                )
            layout = await self._layout_for(v, req.tp_rank, tp_size)
            positions = self._selection(req, v, layout)
            first: list[bytes] = []
            d = await self._delta_for(v, req.held) if req.held and tp_size == 1 else None
            if d is not None:
                first, layout, positions = _delta_selection(d, v, req)
            self._hold(v)  # released when the stream ends
        except _Abort as e:
            await self._reject(context, e)
            return
        with self._lock:
            self._counters["fetch_streams"] += 1
            self._counters["delta_streams"] += d is not None
        sent, nbytes = len(first), sum(map(len, first))
        try:
            for msg in first:
                yield msg
            for pos in positions:
                msg = layout.messages[pos]
                sent += 1  # counted when handed to gRPC
                nbytes += len(msg)
                yield bytes(msg)  # grpcio takes bytes only (and copies them once more itself)
        finally:
            self._unhold(v)
            with self._lock:
                self._counters["chunks_sent"] += sent
                self._counters["bytes_sent"] += nbytes

    async def _delta_for(self, v: _Version, held) -> _Delta | None:
        """v's delta against the newest version in `held` that this server holds with the same
        manifest digest (built in a worker thread when first asked for, or at publish against the
        version published before it; cached), or None: serve full.

        A delta is XOR + zstd per changed tensor (broker/delta.py), framed like a version, cached per
        version for at most `keep_versions` parents, and served only when its payload is smaller than
        the full version's. Every `delta_full_every`-th publish (the first included) is full only, so
        a worker's chain of deltas is at most delta_full_every - 1 long. A stream served as a delta
        starts with a message carrying the DeltaDescription; the client checks what it rebuilds
        against the manifest."""
        if not self.config.deltas or v.full_only:
            return None
        with self._lock:
            known = [
                h.version
                for h in held
                if h.version != v.version
                and h.version in self._versions
                and self._digests[h.version] == h.manifest_digest
            ]
            parent = self._versions[max(known)] if known else None
        if parent is None:
            return None
        fut = v.deltas.get(parent.version) or self._start_delta(v, parent)
        try:
            return await asyncio.shield(fut)
        except _Abort:  # evicted before the build started
            v.deltas.pop(parent.version, None)
            return None
        except Exception:  # a bug: serve full, do not cache it
            v.deltas.pop(parent.version, None)
            log.exception("building the delta of version %d against %d failed", v.version, parent.version)
            return None

    def _start_delta(self, v: _Version, parent: _Version) -> asyncio.Future:
        """Build v's delta against `parent` in the worker thread (on the loop thread), cached in v.deltas."""
        fut = asyncio.wrap_future(self._executor.submit(self._build_delta, v, parent))
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: nobody may ask for it
        v.deltas[parent.version] = fut
        while len(v.deltas) > self.config.keep_versions:
            v.deltas.popitem(last=False)
        return fut

    def _build_delta(self, v: _Version, parent: _Version) -> _Delta | None:
        self._hold(v)
        try:
            self._hold(parent)
            try:
                d = build_delta(v, parent, self._digests[parent.version])
                with self._lock:
                    self._counters["deltas_built"] += d is not None
                return d
            finally:
                self._unhold(parent)
        finally:
            self._unhold(v)

    async def _watch_versions(self, request: bytes, context):
        try:
            req = self._parse(policy_pb2.WatchVersionsRequest, request)
            slot = self._admit(context)
        except _Abort as e:
            await self._reject(context, e)
            return
        last = req.after_version
        with self._lock:
            self._counters["active_watches"] += 1
        try:
            while not self._stopping.is_set():
                with self._lock:
                    newer = [v for k, v in self._versions.items() if k > last]
                for v in newer:
                    yield v.announcement_bytes
                    last = v.version
                async with self._changed:
                    await self._changed.wait_for(lambda: self._latest > last or self._stopping.is_set())  # noqa: B023 (called here)
        finally:
            with self._lock:
                self._counters["active_watches"] -= 1
            self._release(slot)


def _new_event_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()
