"""A rollout worker's policy fetch in child processes of its own, so that receiving and hashing a
version (protobuf parsing, the copy into host memory, xxh3 per chunk, the sha256 pool: Python
threads holding the GIL for seconds per GB) never competes with the decode loop's Python.

Rules:
- `processes` children (`python -m rollout.fetch_process FD`), started once and reused, each run the
  ordinary broker.policy_client fetch (every chunk and tensor digest verified there) of their share
  of the tensors into ONE shared memfd slab that the parent owns (SharedSlab).
- The parent verifies the manifest again and runs the worker's `check` before any memory is laid
  out; the first ERROR cancels the other parts and is raised (FetchProcess).
- Nothing pickled crosses the boundary: "KIND payload" byte messages over a socketpair (`main`
  lists them); an ERROR is raised in the parent as the type the in-process fetch raises.
- A child that dies or stops answering is replaced at once; the fetch fails with OSError (retried).
Why child processes: docs/design-decisions.md, "The rollout side".
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import grpc
import numpy as np

from broker import ipc
from broker.delta import HeldPolicy
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
    split_by_bytes,
)
from broker.tls import ClientTLS
from policy import manifest as mf
from policy.contract import check_fingerprint
from policy.fields import is_int
from policy.manifest import DigestMismatch
from policy.manifest_check import ValuesRefused
from policy.tp_layout import TensorLayout, rebuild, tensor_layout, tp_plan_of

MAX_MESSAGE = mf.MAX_MANIFEST_BYTES + (1 << 16)
POLL_S = 0.05  # how often a waiting parent looks at its cancel flag and the child's liveness
CANCEL_GRACE_S = 30.0  # a child that has not ended a cancelled fetch by then is replaced


@dataclass(frozen=True, kw_only=True)
class FetchRequest:
    """One fetch: the whole version `version` from `address` (host:port), its contract fingerprint
    checked against `fingerprint` and its manifest's digest against `digest` (hex, the signed
    pointer's; "" = none); the rest as PolicyClientConfig's fields of the same names."""

    address: str
    fingerprint: str
    version: int
    digest: str = ""
    fetch_timeout_s: float = 60.0
    call_timeout_s: float = 10.0
    streams: int = 1
    tls: ClientTLS = dataclasses.field(default_factory=ClientTLS)
    run_token: str = dataclasses.field(default="", repr=False)

    def client_config(self) -> PolicyClientConfig:
        return PolicyClientConfig(
            address=self.address,
            expected_fingerprint=self.fingerprint,
            fetch_timeout_s=self.fetch_timeout_s,
            call_timeout_s=self.call_timeout_s,
            streams=self.streams,
            tls=self.tls,
            run_token=self.run_token,
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
    t.__name__: t
    for t in (
        FetchCancelled,
        ChecksumMismatch,
        DigestMismatch,
        ValuesRefused,
        FingerprintMismatch,
        ValueError,
        OSError,
        RuntimeError,
    )
}


def error_line(e: BaseException) -> str:
    """`e` as one line "<Type> <text>" (Type: one of _ERROR_TYPES or RpcError <CODE>)."""
    if isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None)):
        return f"RpcError {e.code().name} {ipc.one_line(e.details() or '')}"
    if isinstance(e, FingerprintMismatch):
        return f"FingerprintMismatch {e.expected} {e.got} {e.version}"
    for name, t in _ERROR_TYPES.items():
        if type(e) is t:
            return f"{name} {ipc.one_line(str(e))}"
    for name in ("ChecksumMismatch", "ValueError", "OSError"):  # subclasses
        if isinstance(e, _ERROR_TYPES[name]):
            return f"{name} {ipc.one_line(f'{type(e).__name__}: {e}')}"
    return f"RuntimeError {ipc.one_line(f'{type(e).__name__}: {e}')}"


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


def _send(conn: Connection, kind: str, payload: bytes = b"") -> None:
    ipc.send(conn, kind, payload)


def _recv(conn: Connection) -> tuple[str, bytes]:
    return ipc.recv(conn, MAX_MESSAGE)


# -- the parent side ------------------------------------------------------------------------------


class SharedSlab(ReceiveBuffers):
    """ReceiveBuffers whose slab is a memfd mapped here (and by the children): `fd` is its
    descriptor until `release_fd` (sent to the children, or the fetch ended), -1 after.

    An anonymous memfd (memfd_create: no file in /dev/shm, so nothing leaks when any process is
    killed, and no /dev/shm size limit), created and page-locked for the H2D copy on CUDA (`pinned`)
    by the parent, reused across versions of one layout, its descriptor passed to each child once
    (SCM_RIGHTS over its socket) and mapped there; the memory is freed when no process maps it."""

    def __init__(self, *, pinned: bool = False):
        super().__init__(pinned=pinned)
        self.fd = -1
        self.nbytes = 0
        self._mmap: mmap.mmap | None = None

    def _allocate(self, nbytes: int) -> np.ndarray:
        # no room fails here (ipc.memfd reserves the pages), not with SIGBUS mid-fetch
        self.fd, self._mmap = ipc.shared_memory("tandem-fetch-slab", nbytes)
        self.nbytes = nbytes
        return np.frombuffer(self._mmap, dtype=np.uint8)

    def release_fd(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def close(self) -> None:
        super().close()
        self.release_fd()
        if self._mmap is not None:
            ipc.unmap(self._mmap)  # tensors may still alias it (a CPU model's weights): freed with them
            self._mmap = None


class _Child:
    """One fetch child (`python -m rollout.fetch_process FD`): its process, the parent's end of its
    socket, and which slab it has mapped (the SharedSlab's `allocations` count then; 0: none)."""

    def __init__(self) -> None:
        self.proc, self.conn = ipc.spawn("rollout.fetch_process")
        self.slab = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, kind: str, payload: bytes = b"", fd: int = -1) -> None:
        """One message (and `fd` after it when >= 0). A child gone is not an error here: the next
        wait for its answer notices it (FetchProcess._next)."""
        try:
            _send(self.conn, kind, payload)
            if fd >= 0:
                ipc.send_fd(self.conn, fd)
        except OSError:
            pass

    def stop(self) -> int:
        """End the child (killed if it does not go at once); its exit status."""
        self.conn.close()  # the child's read ends: it exits
        try:
            return self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class _ChildGone(Exception):
    """Children exited or stopped answering: (child, why) each."""

    def __init__(self, gone: list[tuple[_Child, str]]):
        super().__init__("; ".join(f"{c.pid} {why}" for c, why in gone))
        self.gone = gone


def _raise_first_failure(request: FetchRequest, refused, cancel: FetchCancel, gone: str, errors: list) -> None:
    """A fetch's failure, first of: the parent's check, `cancel`, a child gone, a child's ERROR
    (a real one before any FetchCancelled)."""
    if refused is not None:
        raise refused
    if cancel.is_set():
        raise FetchCancelled(f"version {request.version}: fetch cancelled")
    if gone:
        raise OSError(f"the fetch process {gone}")
    if errors:
        raise ([e for e in errors if not isinstance(e, FetchCancelled)] or errors)[0]


class FetchProcess:
    """The parent's handle on a worker's `processes` fetch children (`rollout.fetch_processes`).
    `fetch` runs in one thread at a time (the worker's fetch thread); `close` ends the children:

        fetcher = FetchProcess(pinned=True, processes=4, log=print)  # the children start at the first fetch
        fetched = fetcher.fetch(FetchRequest(address=..., fingerprint=..., version=7), check=..., cancel=...)
        fetcher.close()

    One fetch: the first child gets the manifest; the parent verifies it again (manifest_from_bytes,
    check_fingerprint, the version asked for), runs the worker's `check` before any memory is
    allocated, lays the whole version out in the slab (ReceiveBuffers.offsets over all its tensors)
    and splits the tensors into one group per child of about equal bytes (split_by_bytes: the rule
    of the client's streams). Each child fetches only its group (`fetch_bytes(names=...)`), verifies
    every chunk and tensor of it, and writes each tensor at its offset in the whole layout. The
    fetch ends when every child sent DONE (the stats summed); the first ERROR cancels the others
    and is raised (a real error before a FetchCancelled of a cancelled sibling). A child that dies
    (or stops answering) is replaced at once with one log line, the others' parts are cancelled,
    and the fetch fails with OSError; a cancel from the worker cancels every child's part.

    Deltas (broker/delta.py): with `reuse`, the slab holds the last version fetched whole and
    verified until the next fetch writes over it; SLAB then names it as the parent (when the slab
    was kept, so the layout is the same) and each child offers it for its part
    (`fetch_bytes(parent=...)`), every tensor rebuilt in place and checked against the manifest. A
    fetch that fails leaves no parent. With `pinned=False, reuse=False` (a child on CPU) each fetch
    gets a new slab: the CPU engine's weights alias the fetched bytes.
    """

    def __init__(self, *, pinned: bool, reuse: bool = True, processes: int = 1, log: Callable[[str], None] = print):
        if not is_int(processes, 1, 16):
            raise ValueError(f"processes={processes!r} (need an int in [1, 16])")
        self.buffers = SharedSlab(pinned=pinned)
        self.reuse, self.processes, self.log = reuse, processes, log
        self.restarts = 0  # children replaced after dying
        self._children: list[_Child] = []  # started at the first fetch; [0] fetches the manifest
        self._held: tuple[int, str, int] | None = None  # the slab's verified version, its digest, slab allocations

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self._children]

    @property
    def pid(self) -> int | None:
        """The first child's (the one that fetches the manifest)."""
        return self._children[0].pid if self._children else None

    def close(self) -> None:
        children, self._children = self._children, []
        for c in children:
            c.stop()
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
        if not self._children:
            self._children = [_Child() for _ in range(self.processes)]
        for i, c in enumerate(self._children):
            if c.proc.poll() is not None:
                self._replace(i, f"exited ({c.proc.returncode}) while idle")
        if not self.reuse:
            self.buffers.close()
        held, self._held = self._held, None  # the fetch writes over it
        try:
            fetched = self._exchange(request, check, cancel or FetchCancel(), held)
        finally:
            self.buffers.release_fd()
        if self.reuse:
            self._held = (fetched.version, mf.manifest_digest(fetched.manifest).hex(), self.buffers.allocations)
        return fetched

    def _replace(self, i: int, why: str) -> None:
        old = self._children[i]
        old.stop()
        self._children[i] = _Child()
        self.restarts += 1
        self.log(f"fetch process {old.pid} {why}: started a new one (pid {self._children[i].pid})")

    def _exchange(self, request: FetchRequest, check, cancel: FetchCancel, held) -> FetchedPolicy:
        """FETCH to the first child; its MANIFEST verified and checked here, the slab laid out and
        each child given its part (`_hand_out`); then every part's DONE or ERROR. The first failure
        (an ERROR, a child gone, the check, `cancel`) CANCELs the parts still running, and is raised
        once they all ended."""
        lead = self._children[0]
        lead.send("FETCH", request.to_bytes())
        running = [lead]  # children whose part has not ended (DONE or ERROR)
        parts: list[FetchStats] = []
        errors: list[BaseException] = []  # the children's ERRORs (a real one before any FetchCancelled)
        gone = ""  # the first child that died or stopped answering (replaced at once)
        refused: BaseException | None = None  # the parent's checks of the manifest failed
        cancelled = False
        manifest = layouts = None
        limit = time.monotonic() + request.fetch_timeout_s + 60  # the children have their own deadlines
        while running:
            if not cancelled and (cancel.is_set() or refused is not None or errors or gone):
                cancelled = True
                for c in running:
                    c.send("CANCEL")
                limit = min(limit, time.monotonic() + CANCEL_GRACE_S)
            try:
                message = self._next(running, limit)
            except _ChildGone as e:
                for c, why in e.gone:
                    running.remove(c)
                    gone = gone or f"{c.pid} {why}"
                    if c in self._children:  # (not when `close` ended them meanwhile)
                        self._replace(self._children.index(c), f"{why} while fetching v{request.version}")
                continue
            if message is None:
                continue
            child, kind, payload = message
            if kind == "MANIFEST" and child is lead and manifest is None and not cancelled:
                try:
                    manifest, layouts = self._accept_manifest(payload, request, check)
                except BaseException as e:
                    refused = e
                    continue
                running += self._hand_out(request, payload, layouts, held)
            elif kind == "DONE":
                running.remove(child)
                parts.append(FetchStats(**{k: v for k, v in json.loads(payload).items() if k in _STATS_FIELDS}))
            elif kind == "ERROR":
                running.remove(child)
                e = error_from_line(payload.decode("utf-8", "replace"))
                if not isinstance(e, FetchCancelled) or not errors:
                    errors.append(e)
        _raise_first_failure(request, refused, cancel, gone, errors)
        # The slab's views only now: a failed fetch's traceback (its frames) holds none, so the slab
        # can be unmapped at once (SharedSlab.close).
        views = self.buffers.views({n: lay.nbytes for n, lay in layouts.items()})
        entries = {t.name: t for t in manifest.tensors}
        tensors = {n: rebuild(entries[n], layouts[n], views[n]) for n in layouts}
        return FetchedPolicy(manifest, tensors, layouts, merged_stats(parts), data={n: views[n] for n in layouts})

    def _accept_manifest(self, raw: bytes, request: FetchRequest, check):
        """The manifest verified again here, checked, and its tensors' layouts, laid out in the slab."""
        manifest = verified_manifest(raw, request, "the fetch process got")
        if check is not None:
            check(manifest)
        layouts = whole_layouts(manifest)
        taking_part = self._children[: len(layouts)]
        if self.buffers.fd < 0 and any(c.slab != self.buffers.allocations for c in taking_part):
            self.buffers.close()  # a new child, and the slab's descriptor is gone: a new slab for all
        self.buffers.views({n: lay.nbytes for n, lay in layouts.items()})  # allocated (or kept) here
        return manifest, layouts

    def _hand_out(self, request: FetchRequest, raw_manifest: bytes, layouts, held) -> list[_Child]:
        """Each child its part: the version's tensors in groups of about equal bytes, one per child
        (split_by_bytes), each written at its offset in the whole slab. The first child has the
        manifest; the others get JOIN and the MANIFEST first. SLAB carries the slab's descriptor to
        a child that has not mapped it, and the parent version `held` while the slab still holds it
        (not reallocated since). Returns the children started here."""
        groups = split_by_bytes({n: lay.nbytes for n, lay in layouts.items()}, len(self._children))
        parent = None
        if held is not None and held[2] == self.buffers.allocations:
            parent = {"version": held[0], "digest": held[1]}
        started = []
        for i, (c, group) in enumerate(zip(self._children, groups)):
            if i > 0:
                c.send("JOIN", request.to_bytes())
                c.send("MANIFEST", raw_manifest)
                started.append(c)
            new = c.slab != self.buffers.allocations
            slab = {
                "nbytes": self.buffers.nbytes,
                "new": new,
                "names": group if len(groups) > 1 else None,
                "parent": parent,
            }
            c.send("SLAB", json.dumps(slab).encode(), fd=self.buffers.fd if new else -1)
            c.slab = self.buffers.allocations
        self.buffers.release_fd()
        return started

    def _next(self, running: list[_Child], limit: float) -> tuple[_Child, str, bytes] | None:
        """A running child's next message (child, KIND, payload), or None after POLL_S; _ChildGone
        for the children that died, or for all of them once `limit` passed."""
        by_conn = {c.conn: c for c in running}
        dead = []
        for conn in wait(list(by_conn), POLL_S):
            try:
                return (by_conn[conn], *_recv(conn))
            except (EOFError, OSError):
                dead.append(by_conn[conn])
        dead += [c for c in running if c not in dead and c.proc.poll() is not None]
        if dead:
            raise _ChildGone([(c, f"exited ({c.proc.wait()})") for c in dead])
        if time.monotonic() > limit:
            raise _ChildGone([(c, "stopped answering") for c in running])
        return None


def verified_manifest(raw: bytes, request: FetchRequest, source: str) -> mf.pb.Manifest:
    """A serialized manifest parsed and verified (manifest_from_bytes), with the request's digest
    (DigestMismatch), of the version asked for (ValueError naming `source` otherwise) and with the
    request's fingerprint (FingerprintMismatch)."""
    manifest = mf.manifest_from_bytes(raw, digest=request.digest)
    if manifest.version != request.version:
        raise ValueError(f"asked for version {request.version}, {source} {manifest.version}")
    check_fingerprint(manifest, request.fingerprint)
    return manifest


def whole_layouts(manifest) -> dict[str, TensorLayout]:
    """Every tensor's layout, whole (TP 1): what the slab holds, parent and children alike."""
    plan = tp_plan_of(manifest)
    return {t.name: tensor_layout(t, plan, 0, 1) for t in manifest.tensors}


def merged_stats(parts: list[FetchStats]) -> FetchStats:
    """The children's FetchStats as one fetch's: counts summed (FetchStats.add), times the slowest part's."""
    total = FetchStats()
    for p in parts:
        total.add(p)
    total.seconds = max((p.seconds for p in parts), default=0.0)
    total.receive_s = max((p.receive_s for p in parts), default=0.0)
    total.verify_s = total.seconds - total.receive_s
    return total


_STATS_FIELDS = {f.name for f in dataclasses.fields(FetchStats)}


# -- the child side -------------------------------------------------------------------------------


class _MappedSlab(ReceiveBuffers):
    """The child's view of the parent's slab (its memfd `fd`, closed once mapped), laid out as the
    parent lays it out: `layout` (name -> bytes, set per fetch) is every tensor of the version, and
    `views(sizes)` places the tensors of `sizes` (this child's part) at their offsets in that whole
    layout (ReceiveBuffers.offsets). Never reallocated (a slab too small for a layout is a ValueError)."""

    def __init__(self, fd: int, nbytes: int):
        super().__init__()
        self.layout: dict[str, int] = {}
        self._mmap = ipc.map_fd(fd, nbytes)

    def views(self, sizes: dict[str, int]) -> dict[str, np.ndarray]:
        whole = super().views(self.layout or sizes)
        wrong = [n for n in sizes if n not in whole or whole[n].nbytes != sizes[n]]
        if wrong:
            raise ValueError(f"tensor(s) {wrong[:5]} are not in the shared slab's layout")
        return {n: whole[n] for n in sizes}

    def _allocate(self, nbytes: int) -> np.ndarray:
        if nbytes > len(self._mmap):
            raise ValueError(f"the shared slab holds {len(self._mmap)} bytes, the version needs {nbytes}")
        return np.frombuffer(self._mmap, dtype=np.uint8, count=nbytes)

    def close(self) -> None:
        self._slab, self._views, self._key = None, {}, None


class _Job:
    def __init__(self, request: FetchRequest, *, lead: bool):
        self.request, self.lead = request, lead  # lead: this child fetches the manifest (FETCH, not JOIN)
        self.cancel = FetchCancel()
        self.inbox: queue.Queue = queue.Queue()  # (KIND, payload) from the parent: MANIFEST, SLAB, CANCEL


def _run_job(conn: Connection, job: _Job, state: dict) -> None:
    """One fetch, ended by DONE or one ERROR line (the job thread is the child's only sender)."""
    try:
        stats = _fetch(conn, job, state)
        _send(conn, "DONE", json.dumps(dataclasses.asdict(stats)).encode())
    except BaseException as e:
        _send(conn, "ERROR", error_line(e).encode())


def _fetch(conn: Connection, job: _Job, state: dict) -> FetchStats:
    req = job.request
    cancelled = FetchCancelled(f"version {req.version}: fetch cancelled")
    check_reachable(req.address)  # a trainer gone from the address fails at once
    with PolicyClient(req.client_config()) as client:
        if job.lead:  # the parent verifies and checks it, then hands out the parts
            manifest = client.get_manifest(req.version, digest=req.digest)
            _send(conn, "MANIFEST", mf.manifest_to_bytes(manifest))
        else:  # the manifest the parent verified, verified here again
            kind, raw = job.inbox.get()
            if kind != "MANIFEST":
                raise cancelled
            manifest = verified_manifest(raw, req, "the parent sent")
        kind, message = job.inbox.get()
        if kind != "SLAB":  # the main thread mapped a new slab into state["slab"] first
            raise cancelled
        slab = state["slab"]
        slab.layout = {n: lay.nbytes for n, lay in whole_layouts(manifest).items()}
        held = message.get("parent")
        parent = HeldPolicy(held["version"], bytes.fromhex(held["digest"]), slab.views(slab.layout)) if held else None
        _, _, stats = client.fetch_bytes(
            manifest, names=message["names"], buffers=slab, cancel=job.cancel, parent=parent
        )
    return stats


def main(argv: list[str]) -> int:
    """A fetch child on socket FD `argv[0]`. The messages, length-prefixed "KIND payload":

        parent -> first child   FETCH {json request}
        parent -> other child   JOIN {json request}, then MANIFEST <the serialized manifest>
        parent -> each child    SLAB {"nbytes": ..., "new": bool, "names": [its tensors] | null = all,
                                "parent": {"version": v, "digest": hex} | null} (+ the memfd when new) | CANCEL
        child -> parent         MANIFEST <the serialized manifest> (first child) | DONE {json FetchStats}
                                | ERROR <Type> <one line>

    ERROR's Type is one of ChecksumMismatch, DigestMismatch, ValuesRefused, FingerprintMismatch,
    ValueError, OSError, FetchCancelled or RpcError <CODE> (`error_line`, `error_from_line`)."""
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
        if kind in ("FETCH", "JOIN"):
            try:
                job = _Job(FetchRequest.from_bytes(payload), lead=kind == "FETCH")
            except (ValueError, TypeError, KeyError) as e:
                _send(conn, "ERROR", f"ValueError bad fetch request: {ipc.one_line(str(e))}".encode())
                continue
            threading.Thread(target=_run_job, args=(conn, job, state), name="fetch", daemon=True).start()
        elif kind == "MANIFEST" and job is not None:
            job.inbox.put((kind, payload))
        elif kind == "SLAB" and job is not None:
            slab = json.loads(payload)
            if slab["new"]:  # mapped here, at once: a descriptor never waits in a queue
                state["slab"] = None  # the previous mapping goes
                state["slab"] = _MappedSlab(ipc.recv_fd(conn, "SLAB"), slab["nbytes"])
            job.inbox.put((kind, slab))
        elif kind == "CANCEL" and job is not None:
            job.cancel.cancel()
            job.inbox.put((kind, None))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
