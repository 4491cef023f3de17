"""A rollout worker's policy fetch in a process of its own, so that receiving and hashing a version
(protobuf parsing, the copy into host memory, xxh3 per chunk, the sha256 pool: Python threads
holding the GIL for seconds per GB) never competes with the decode loop's Python.

    fetcher = FetchProcess(pinned=True, log=print)      # the child starts at the first fetch
    fetched = fetcher.fetch(FetchRequest(address=..., fingerprint=..., version=7), check=..., cancel=...)
    fetcher.close()

One child per worker (`python -m rollout.fetch_process FD`), started once and reused; it runs the
ordinary broker.policy_client fetch (every chunk and tensor digest verified there) into a slab of
shared memory that the parent owns: an anonymous memfd (Linux memfd_create: no file in /dev/shm,
so nothing to leak when either process is killed, and no /dev/shm size limit), created and
page-locked for the H2D copy on CUDA (`pinned`) by the parent, reused across versions of one
layout like ReceiveBuffers, its descriptor passed to the child once (SCM_RIGHTS over the socket)
and mapped there; the memory is freed when neither process maps it any more.

Nothing pickled crosses the boundary: length-prefixed byte messages over a socketpair
(`Connection.send_bytes`), each "KIND payload":
    parent -> child   FETCH {json request} | SLAB {"nbytes": ..., "new": bool} (+ the memfd when new) | CANCEL
    child -> parent   MANIFEST <the serialized manifest> | DONE {json FetchStats} | ERROR <Type> <one line>
The parent parses and verifies the manifest again (manifest_from_bytes, check_fingerprint, the
version asked for), runs the worker's `check` before any memory is allocated, and rebuilds the
tensors over the slab. An ERROR is raised in the parent as the type the in-process fetch raises
(ChecksumMismatch, FingerprintMismatch, ValueError, OSError, FetchCancelled, a grpc.RpcError with
its status code), so the worker's handling is the same. A child that dies (or stops answering) is
replaced at once with one log line, and the fetch it was running fails with OSError (retried).

CPU workers keep the in-process fetch by default (`rollout.fetch_process`): the CPU engine's
weights alias the fetched bytes, so each version needs fresh memory, and a CPU worker's versions
are small. With the child on CPU (`pinned=False, reuse=False`) each fetch gets a new slab.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import grpc
import numpy as np

from broker.policy_client import (
    ChecksumMismatch,
    FetchCancel,
    FetchCancelled,
    FetchedPolicy,
    FetchStats,
    FingerprintMismatch,
    PolicyClient,
    PolicyClientConfig,
    ReceiveBuffers,
    check_reachable,
)
from broker.tls import ClientTLS
from policy import manifest as mf

MAX_MESSAGE = mf.MAX_MANIFEST_BYTES + (1 << 16)
POLL_S = 0.05  # how often a waiting parent looks at its cancel flag and the child's liveness
CANCEL_GRACE_S = 30.0  # a child that has not ended a cancelled fetch by then is replaced


@dataclass(frozen=True, kw_only=True)
class FetchRequest:
    """One fetch: the whole version `version` from `address` (host:port), its contract fingerprint
    checked against `fingerprint`; the rest as PolicyClientConfig's fields of the same names."""

    address: str
    fingerprint: str
    version: int
    fetch_timeout_s: float = 60.0
    streams: int = 1
    tls: ClientTLS = dataclasses.field(default_factory=ClientTLS)

    def client_config(self) -> PolicyClientConfig:
        return PolicyClientConfig(
            address=self.address,
            expected_fingerprint=self.fingerprint,
            fetch_timeout_s=self.fetch_timeout_s,
            streams=self.streams,
            tls=self.tls,
        )

    def to_bytes(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> FetchRequest:
        d = json.loads(raw)
        return cls(**{**d, "tls": ClientTLS(**d["tls"])})


class FetchRpcError(grpc.RpcError):
    """A gRPC error of the child's fetch, raised in the parent: its status code and details."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_ERROR_TYPES = {
    t.__name__: t for t in (FetchCancelled, ChecksumMismatch, FingerprintMismatch, ValueError, OSError, RuntimeError)
}


def error_line(e: BaseException) -> str:
    """`e` as one line "<Type> <text>" (Type: one of _ERROR_TYPES or RpcError <CODE>)."""
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        return f"RpcError {e.code().name} {_one_line(e.details() or '')}"
    if isinstance(e, FingerprintMismatch):
        return f"FingerprintMismatch {e.expected} {e.got} {e.version}"
    for name, t in _ERROR_TYPES.items():
        if type(e) is t:
            return f"{name} {_one_line(str(e))}"
    for name in ("ChecksumMismatch", "ValueError", "OSError"):  # subclasses
        if isinstance(e, _ERROR_TYPES[name]):
            return f"{name} {_one_line(f'{type(e).__name__}: {e}')}"
    return f"RuntimeError {_one_line(f'{type(e).__name__}: {e}')}"


def error_from_line(line: str) -> BaseException:
    """The exception an `error_line` describes."""
    kind, _, text = line.partition(" ")
    if kind == "RpcError":
        code, _, details = text.partition(" ")
        status = getattr(grpc.StatusCode, code, grpc.StatusCode.UNKNOWN)
        return FetchRpcError(status, details)
    if kind == "FingerprintMismatch":
        expected, got, version = (text.split() + ["", "", ""])[:3]
        return FingerprintMismatch(expected=expected, got=got, version=int(version) if version.isdigit() else None)
    return _ERROR_TYPES.get(kind, RuntimeError)(text)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:500]


def _send(conn: Connection, kind: str, payload: bytes = b"") -> None:
    conn.send_bytes(kind.encode() + b" " + payload)


def _recv(conn: Connection) -> tuple[str, bytes]:
    kind, _, payload = conn.recv_bytes(MAX_MESSAGE).partition(b" ")
    return kind.decode("ascii", "replace"), payload


def _send_fd(conn: Connection, fd: int) -> None:
    """A file descriptor to the peer (SCM_RIGHTS, one marker byte), right after a message."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        socket.send_fds(sock, [b"F"], [fd])
    finally:
        sock.detach()  # the fd stays the Connection's


def _recv_fd(conn: Connection) -> int:
    sock = socket.socket(fileno=conn.fileno())
    try:
        marker, fds, _, _ = socket.recv_fds(sock, 1, 1)
    finally:
        sock.detach()
    if marker != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected one file descriptor after SLAB, got {len(fds)} and {marker!r}")
    return fds[0]


# -- the parent side ------------------------------------------------------------------------------


class SharedSlab(ReceiveBuffers):
    """ReceiveBuffers whose slab is a memfd mapped here (and by the child): `fd` is its descriptor
    until `release_fd` (sent to the child, or the fetch ended), -1 after."""

    def __init__(self, *, pinned: bool = False):
        super().__init__(pinned=pinned)
        self.fd = -1
        self.nbytes = 0
        self._mmap: mmap.mmap | None = None

    def _allocate(self, nbytes: int) -> np.ndarray:
        fd = os.memfd_create("tandem-fetch-slab", os.MFD_CLOEXEC)
        try:
            try:  # reserve the pages now: no room fails here, not with SIGBUS mid-fetch
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise OSError(f"cannot reserve {nbytes} bytes of shared memory: {e.strerror}") from None
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.nbytes, self._mmap = fd, nbytes, mm
        return np.frombuffer(mm, dtype=np.uint8)

    def release_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        super().close()
        self.release_fd()
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:  # tensors still alias it (a CPU model's weights): freed with them
                pass
            self._mmap = None


class _ChildGone(Exception):
    """The child exited or stopped answering."""


class FetchProcess:
    """The parent's handle on one fetch child (see the module docstring). `fetch` runs in one
    thread at a time (the worker's fetch thread); `close` ends the child."""

    def __init__(self, *, pinned: bool, reuse: bool = True, log: Callable[[str], None] = print):
        self.buffers = SharedSlab(pinned=pinned)
        self.reuse, self.log = reuse, log
        self.restarts = 0  # children replaced after dying
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "rollout.fetch_process", str(theirs.fileno())], pass_fds=(theirs.fileno(),)
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self.buffers.close()  # a new child maps a new slab

    def _stop_child(self) -> int | None:
        """End the child (killed if it does not go at once); its exit status."""
        proc, conn, self._proc, self._conn = self._proc, self._conn, None, None
        if conn is not None:
            conn.close()  # the child's read ends: it exits
        if proc is None:
            return None
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def close(self) -> None:
        self._stop_child()
        self.buffers.close()

    def fetch(
        self,
        request: FetchRequest,
        *,
        check: Callable[[mf.pb.Manifest], None] | None = None,
        cancel: FetchCancel | None = None,
    ) -> FetchedPolicy:
        """The verified version `request.version`, its tensors over the shared slab (the next fetch
        overwrites them when `reuse`). Raises what the in-process fetch raises."""
        if self._proc is not None and self._proc.poll() is not None:
            self._replace(f"exited ({self._proc.returncode}) while idle")
        if self._proc is None:
            self._start()
        if not self.reuse:
            self.buffers.close()
        cancel = cancel or FetchCancel()
        try:
            return self._exchange(request, check, cancel)
        except _ChildGone as e:
            self._replace(f"{e} while fetching v{request.version}")
            if cancel.is_set():
                raise FetchCancelled(f"version {request.version}: fetch cancelled") from None
            raise OSError(f"the fetch process {e}") from None
        finally:
            self.buffers.release_fd()

    def _replace(self, why: str) -> None:
        pid = self.pid
        self._stop_child()
        self._start()
        self.restarts += 1
        self.log(f"fetch process {pid} {why}: started a new one (pid {self.pid})")

    def _exchange(self, request: FetchRequest, check, cancel: FetchCancel) -> FetchedPolicy:
        _send(self._conn, "FETCH", request.to_bytes())
        cancelled = False
        refused: BaseException | None = None  # the parent's check failed: raised once the child ended
        manifest = layouts = views = None
        limit = time.monotonic() + request.fetch_timeout_s + 60  # the child has its own deadlines
        while True:
            if not cancelled and (cancel.is_set() or refused is not None):
                cancelled = True
                _send(self._conn, "CANCEL")
                limit = min(limit, time.monotonic() + CANCEL_GRACE_S)
            kind, payload = self._next(limit)
            if kind == "":
                continue
            if kind == "MANIFEST" and not cancelled:
                try:
                    manifest, layouts, views = self._accept_manifest(payload, request, check)
                except BaseException as e:
                    refused = e
                    continue
                new = self.buffers.fd >= 0  # a slab the child has not mapped yet
                _send(self._conn, "SLAB", json.dumps({"nbytes": self.buffers.nbytes, "new": new}).encode())
                if new:
                    _send_fd(self._conn, self.buffers.fd)
                    self.buffers.release_fd()
            elif kind in ("DONE", "ERROR"):
                if refused is not None:
                    raise refused
                if cancelled:
                    raise FetchCancelled(f"version {request.version}: fetch cancelled")
                if kind == "ERROR":
                    raise error_from_line(payload.decode("utf-8", "replace"))
                stats = FetchStats(**{k: v for k, v in json.loads(payload).items() if k in _STATS_FIELDS})
                entries = {t.name: t for t in manifest.tensors}
                tensors = {n: mf.rebuild(entries[n], layouts[n], views[n]) for n in layouts}
                return FetchedPolicy(manifest, tensors, layouts, stats)

    def _accept_manifest(self, raw: bytes, request: FetchRequest, check):
        """The manifest verified again here, checked, and the slab's views for its tensors."""
        manifest = mf.manifest_from_bytes(raw)
        if manifest.version != request.version:
            raise ValueError(f"asked for version {request.version}, the fetch process got {manifest.version}")
        mf.check_fingerprint(manifest, request.fingerprint)
        if check is not None:
            check(manifest)
        plan = mf.tp_plan_of(manifest)
        layouts = {t.name: mf.tensor_layout(t, plan, 0, 1) for t in manifest.tensors}
        views = self.buffers.views({n: lay.nbytes for n, lay in layouts.items()})
        return manifest, layouts, views

    def _next(self, limit: float) -> tuple[str, bytes]:
        """The child's next message, or ("", b"") after POLL_S; _ChildGone if it died or passed `limit`."""
        try:
            if self._conn.poll(POLL_S):
                return _recv(self._conn)
        except (EOFError, OSError):
            rc = self._proc.wait()
            raise _ChildGone(f"{self._proc.pid} exited ({rc})") from None
        if self._proc.poll() is not None:
            raise _ChildGone(f"{self._proc.pid} exited ({self._proc.returncode})")
        if time.monotonic() > limit:
            raise _ChildGone(f"{self._proc.pid} stopped answering")
        return "", b""


_STATS_FIELDS = {f.name for f in dataclasses.fields(FetchStats)}


# -- the child side -------------------------------------------------------------------------------


class _MappedSlab(ReceiveBuffers):
    """The child's view of the parent's slab (its memfd `fd`, closed once mapped): the same offsets
    (ReceiveBuffers.offsets), never reallocated (a slab too small for a layout is a ValueError)."""

    def __init__(self, fd: int, nbytes: int):
        super().__init__()
        try:
            self._mmap = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)

    def _allocate(self, nbytes: int) -> np.ndarray:
        if nbytes > len(self._mmap):
            raise ValueError(f"the shared slab holds {len(self._mmap)} bytes, the version needs {nbytes}")
        return np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes)

    def close(self) -> None:
        self._slab, self._views, self._key = None, {}, None


class _Job:
    def __init__(self, request: FetchRequest):
        self.request = request
        self.cancel = FetchCancel()
        self.inbox: queue.Queue = queue.Queue()  # SLAB or CANCEL from the parent


def _run_job(conn: Connection, job: _Job, state: dict) -> None:
    """One fetch, ended by DONE or one ERROR line (the job thread is the child's only sender)."""
    try:
        stats = _fetch(conn, job, state)
        _send(conn, "DONE", json.dumps(dataclasses.asdict(stats)).encode())
    except BaseException as e:
        _send(conn, "ERROR", error_line(e).encode())


def _fetch(conn: Connection, job: _Job, state: dict) -> FetchStats:
    req = job.request
    check_reachable(req.address)  # a trainer gone from the address fails at once
    with PolicyClient(req.client_config()) as client:
        manifest = client.get_manifest(req.version)
        _send(conn, "MANIFEST", mf.manifest_to_bytes(manifest))
        if job.inbox.get() != "SLAB":  # the main thread mapped a new slab into state["slab"] first
            raise FetchCancelled(f"version {req.version}: fetch cancelled")
        _, _, stats = client.fetch_bytes(manifest, buffers=state["slab"], cancel=job.cancel)
    return stats


def main(argv: list[str]) -> int:
    # The child lives as long as its parent's end of the socket: ^C and SIGTERM are the parent's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    state: dict = {"slab": None}
    job: _Job | None = None
    while True:
        try:
            kind, payload = _recv(conn)
        except (EOFError, OSError):
            os._exit(0)  # the parent is gone: a fetch in progress ends with us
        if kind == "FETCH":
            try:
                job = _Job(FetchRequest.from_bytes(payload))
            except (ValueError, TypeError, KeyError) as e:
                _send(conn, "ERROR", f"ValueError bad fetch request: {_one_line(str(e))}".encode())
                continue
            threading.Thread(target=_run_job, args=(conn, job, state), name="fetch", daemon=True).start()
        elif kind == "SLAB" and job is not None:
            slab = json.loads(payload)
            if slab["new"]:  # mapped here, at once: a descriptor never waits in a queue
                state["slab"] = None  # the previous mapping goes
                state["slab"] = _MappedSlab(_recv_fd(conn), slab["nbytes"])
            job.inbox.put(kind)
        elif kind == "CANCEL" and job is not None:
            job.cancel.cancel()
            job.inbox.put(kind)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
