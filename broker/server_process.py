"""The trainer's PolicyServer in a process of its own, so that serving a version never competes with
the training loop's Python (why: docs/design-decisions.md, "Publishing").

    pool = BufferPool(pin=True, shared=True)          # versions framed into shared memory
    server = PolicyServerProcess(PolicyServerConfig(port=0), log=print)
    port = server.start()
    server.publish(framed)                            # a FramedPolicy from that pool (frames.stage(...).run())
    server.versions(); server.stats(); server.stop()

It offers what the trainer uses of PolicyServer. The child (`python -m broker.server_process FD`)
runs the ordinary broker.policy_server.PolicyServer over the trainer's memfd-backed pool buffers,
mapped once each: a version's bytes are never copied. A buffer goes back to the trainer's pool when
the child says RELEASED. Nothing pickled crosses (broker.ipc; the messages: `_child`). A child that
dies is replaced on the same port and given every version it had not released; a request whose
child dies under it is sent again, up to ATTEMPTS children in a row, then ServerProcessGone.
ServingProcesses runs several children on one port (SO_REUSEPORT) over the same buffers: a publish
goes to each, a buffer returns once every one released it (trainer.policy_server_processes)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import mmap
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import TypeVar

import numpy as np

from broker import ipc
from broker.frames import FramedPolicy, manifest_layout
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.tls import ServerTLS
from policy import manifest as mf
from policy.fields import is_int

MAX_MESSAGE = mf.MAX_MANIFEST_BYTES + (1 << 16)
REPLY_TIMEOUT_S = 120.0  # a publish installs in the child's event loop (PolicyServer.publish: <= 30 s)
SLOW_REPLY_S = 3.0  # a reply this late is logged once (a stopped or swapped-out child), then waited for
T = TypeVar("T")
ATTEMPTS = 3  # children one request is sent to before it fails: a child that dies at every attempt ends it


def config_to_json(config: PolicyServerConfig) -> bytes:
    return json.dumps(dataclasses.asdict(config)).encode()


def config_from_json(raw: bytes) -> PolicyServerConfig:
    d = json.loads(raw)
    return PolicyServerConfig(**{**d, "tls": ServerTLS(**d["tls"])})


class ServerProcessGone(OSError):
    """The server process exited while a request was waiting for its reply."""


class PolicyServerProcess:
    """The trainer's handle on its policy-server process (module docstring). Thread-safe."""

    def __init__(self, config: PolicyServerConfig, *, log: Callable[[str], None] = print):
        self.config, self.log = config, log
        self.restarts = 0  # children replaced after dying
        self._port = config.port
        self._lock = threading.RLock()  # one request at a time; (re)starting a child
        self._held: dict[int, FramedPolicy] = {}  # buffer id -> the version in it, until RELEASED
        self._held_lock = threading.Lock()
        self._mapped: set[int] = set()  # buffer ids the current child has mapped
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._replies: queue.Queue = queue.Queue()
        self._stopping = False

    port = PolicyServer.port  # self._port: the bound port, kept for restarts
    address = PolicyServer.address  # "host:port"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self) -> int:
        """Start the child and its server; the bound port."""
        with self._lock:
            if self._proc is not None:
                raise RuntimeError("PolicyServerProcess already started")
            self._spawn()
        return self._port

    def publish(self, policy: FramedPolicy) -> bool:
        """Publish a version framed in a shared pool buffer (True if new, False if this exact content was
        already published; ValueError as PolicyServer.publish). Its buffer returns to its pool once the
        child has evicted the version and nothing reads it."""
        host = policy.host if isinstance(policy, FramedPolicy) else None
        if host is None or host.fd < 0:
            raise TypeError(
                "PolicyServerProcess.publish takes a FramedPolicy framed in a shared pool buffer "
                "(broker.frames.BufferPool(shared=True))"
            )

        def request(retry: bool) -> bool:
            if retry and host.id in self._mapped and self._held.get(host.id) is policy:
                return True  # the replacement was given it with the versions its predecessor held
            return self._publish(policy)

        with self._lock:
            try:
                return self._on_a_child(f"publishing version {policy.manifest.version}", request)
            except ServerProcessGone:  # not installed anywhere: not given to a later child either
                with self._held_lock:
                    dropped = self._held.pop(host.id) if self._held.get(host.id) is policy else None
                if dropped is not None and dropped.release is not None:
                    dropped.release()
                raise

    def versions(self) -> list[int]:
        with self._lock:
            return list(self._on_a_child("VERSIONS", lambda _: self._request("VERSIONS"))["versions"])

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._on_a_child("STATS", lambda _: self._request("STATS")))

    prometheus_samples = PolicyServer.prometheus_samples  # (kind, name, help, value) of stats()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            proc, conn = self._proc, self._conn
            if proc is None:
                return
            try:
                ipc.send(conn, "STOP")
                proc.wait(timeout=self.config.stop_grace_s + 10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            conn.close()
            with self._held_lock:
                held, self._held = list(self._held.values()), {}
        for p in held:  # the buffers go back to the pool, which its owner closes
            if p.release is not None:
                p.release()

    # -- internals -------------------------------------------------------------------------------

    def _spawn(self) -> None:
        """A new child serving on self._port (0: a free one, then kept for restarts). Caller holds _lock."""
        proc, conn = ipc.spawn("broker.server_process")
        self._proc, self._conn, self._mapped, self._replies = proc, conn, set(), queue.Queue()
        threading.Thread(
            target=self._read, args=(proc, conn, self._replies), name="policy-server-ipc", daemon=True
        ).start()
        ipc.send(conn, "START", config_to_json(dataclasses.replace(self.config, port=self._port)))
        self._port = self._reply("START", log_slow=False)["port"]  # a child importing is slow

    def _on_a_child(self, what: str, request: Callable[[bool], T]) -> T:
        """`request(retry)` on a live child. A child that dies under it is reaped and replaced (with the
        versions it held, _ensure_child) and the request sent again (retry=True), up to ATTEMPTS
        children; then one ServerProcessGone line. Caller holds _lock."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self._ensure_child()
                return request(attempt > 1)
            except (ServerProcessGone, ConnectionError) as e:
                rc = self._reap()
                if attempt == ATTEMPTS:
                    raise ServerProcessGone(
                        f"policy server process exited during {what} at each of {ATTEMPTS} attempts "
                        f"(the last, pid {self.pid}, with {rc}: {type(e).__name__})"
                    ) from None
                self.log(f"policy server process {self.pid} exited ({rc}) during {what}: sending it to a new one")
        raise AssertionError("unreachable")

    def _reap(self) -> int:
        """Wait for the current child, whose socket broke, to exit (killed if it lingers); its exit code."""
        try:
            return self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            return self._proc.wait()

    def _ensure_child(self) -> None:
        """A child that died is replaced, with the versions it held. Caller holds _lock."""
        if self._stopping:
            raise RuntimeError("PolicyServerProcess stopped")
        if self._proc is None:
            raise RuntimeError("PolicyServerProcess: start() it first")
        rc = self._proc.poll()
        if rc is None:
            return
        old = self._proc.pid
        self._conn.close()
        self._spawn()
        with self._held_lock:
            again = sorted(self._held.values(), key=lambda p: p.manifest.version)
        for p in again:
            self._publish(p)
        self.restarts += 1
        self.log(
            f"policy server process {old} exited ({rc}): started a new one (pid {self._proc.pid}) on port "
            f"{self._port} with versions {[p.manifest.version for p in again]}"
        )

    def _publish(self, policy: FramedPolicy) -> bool:
        host = policy.host
        new = host.id not in self._mapped
        with self._held_lock:
            self._held[host.id] = policy  # before the child can say RELEASED
        meta = {"buffer": host.id, "capacity": host.capacity, "size": policy.layout.size, "new": new}
        ipc.send(self._conn, "PUBLISH", json.dumps(meta).encode() + b"\n" + mf.manifest_to_bytes(policy.manifest))
        if new:
            ipc.send_fd(self._conn, host.fd)
            self._mapped.add(host.id)
        return bool(self._reply(f"PUBLISH of version {policy.manifest.version}")["installed"])

    def _request(self, kind: str) -> dict:
        ipc.send(self._conn, kind)
        return self._reply(kind)

    def _reply(self, what: str, *, log_slow: bool = True) -> dict:
        """The next reply; a late one (past SLOW_REPLY_S) logged once when `log_slow`, then waited for
        up to REPLY_TIMEOUT_S in all."""
        gone = f"policy server process: no reply to {what} in {REPLY_TIMEOUT_S:.0f} s"
        try:
            kind, payload = self._replies.get(timeout=SLOW_REPLY_S if log_slow else REPLY_TIMEOUT_S)
        except queue.Empty:
            if not log_slow:
                raise TimeoutError(gone) from None
            self.log(f"policy server process {self.pid}: no reply to {what} in {SLOW_REPLY_S:.0f} s: still waiting")
            try:
                kind, payload = self._replies.get(timeout=REPLY_TIMEOUT_S - SLOW_REPLY_S)
            except queue.Empty:
                raise TimeoutError(gone) from None
        if kind == "OK":
            return json.loads(payload)
        if kind == "GONE":
            raise ServerProcessGone(f"policy server process {self.pid} exited during {what}")
        name, _, text = payload.decode("utf-8", "replace").partition(" ")
        raise (ValueError if name == "ValueError" else RuntimeError)(text)

    def _read(self, proc: subprocess.Popen, conn: Connection, replies: queue.Queue) -> None:
        """The child's messages: RELEASED handled here, replies queued; GONE when it ends. A child that
        died while serving (not stopped) is replaced at once."""
        while True:
            try:
                kind, payload = ipc.recv(conn, MAX_MESSAGE)
            except (EOFError, OSError):
                break
            if kind == "RELEASED":
                with self._held_lock:
                    p = self._held.pop(json.loads(payload)["buffer"], None)
                if p is not None and p.release is not None:
                    p.release()
            else:
                replies.put((kind, payload))
        replies.put(("GONE", b""))
        if not self._stopping:
            threading.Thread(target=self._replace, args=(proc,), daemon=True).start()

    def _replace(self, proc: subprocess.Popen) -> None:
        proc.wait()
        with self._lock:
            if self._stopping or proc is not self._proc:
                return
            try:
                self._ensure_child()
            except Exception as e:  # the next publish or query tries again
                self.log(f"policy server process: could not start a new one: {type(e).__name__}: {e}")


class ServingProcesses:
    """`processes` policy-server processes (PolicyServerProcess each) on one port: SO_REUSEPORT lets
    the kernel spread the workers' connections over them, so serving is not one event loop's. Each
    maps the same framed buffers; a publish goes to all of them (at once, in threads) and a
    version's buffer returns to its pool once every one has released it. A child that dies is
    replaced on the port by its own handle, as with one. Limits (max_concurrent_rpcs, the
    per-peer stream caps) hold per process: N processes admit N times as many streams."""

    def __init__(self, config: PolicyServerConfig, *, processes: int, log: Callable[[str], None] = print):
        if not is_int(processes, 1):
            raise ValueError(f"processes={processes!r} (want an int >= 1)")
        self.config = dataclasses.replace(config, reuse_port=processes > 1)
        self.processes, self.log = processes, log
        self.children: list[PolicyServerProcess] = []

    def start(self) -> int:
        """Start the children (the first picks the port when it is 0, the rest bind it too); the port."""
        first = PolicyServerProcess(self.config, log=self.log)
        port = first.start()
        self.children = [first]
        for _ in range(1, self.processes):
            child = PolicyServerProcess(dataclasses.replace(self.config, port=port), log=self.log)
            child.start()
            self.children.append(child)
        return port

    @property
    def port(self) -> int:
        return self.children[0].port

    @property
    def address(self) -> str:
        return self.children[0].address

    @property
    def pids(self) -> list[int | None]:
        return [c.pid for c in self.children]

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.children)

    def publish(self, policy: FramedPolicy) -> bool:
        """Publish to every child (as PolicyServerProcess.publish; the first child's answer). The
        buffer goes back to its pool when the last child releases it."""
        copies = released_by_all(policy, len(self.children))
        with concurrent.futures.ThreadPoolExecutor(len(self.children)) as pool:
            results = list(pool.map(lambda cp: cp[0].publish(cp[1]), zip(self.children, copies)))
        return results[0]

    def versions(self) -> list[int]:
        return self.children[0].versions()

    def stats(self) -> dict[str, int]:
        """Every counter summed over the children."""
        total: dict[str, int] = {}
        for child in self.children:
            for k, v in child.stats().items():
                total[k] = total.get(k, 0) + v
        return total

    prometheus_samples = PolicyServer.prometheus_samples  # of the summed stats()

    def stop(self) -> None:
        for child in self.children:
            child.stop()


def released_by_all(policy: FramedPolicy, holders: int) -> list[FramedPolicy]:
    """`holders` copies of `policy` whose `release` gives its buffer back once all of them called it."""
    if policy.release is None or holders == 1:
        return [policy] * holders
    left, lock = [holders], threading.Lock()

    def release() -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            policy.release()

    return [dataclasses.replace(policy, release=release) for _ in range(holders)]


# -- the child ----------------------------------------------------------------------------------------


def _child(conn: Connection) -> int:
    """The child's loop. Messages (broker.ipc: length-prefixed "KIND payload"):
        parent -> child   START {config json} | PUBLISH {json}\\n<serialized manifest> (+ the memfd when
                          the child has not mapped that buffer yet) | VERSIONS | STATS | STOP
        child -> parent   OK {json} | ERROR <Type> <one line>   (the replies, in order)
                          RELEASED {"buffer": id}              (at any time)
    The child maps each buffer once (its descriptor passed with SCM_RIGHTS), rebuilds the frame
    layout from the manifest (broker.frames.manifest_layout) and refuses a size that differs from the
    trainer's; a publish it refuses before its server saw it is RELEASED at once."""
    send_lock = threading.Lock()

    def send(kind: str, payload: bytes = b"") -> None:
        with send_lock:  # the server's threads say RELEASED while the main thread replies
            ipc.send(conn, kind, payload)

    kind, payload = ipc.recv(conn, MAX_MESSAGE)
    try:
        if kind != "START":
            raise ValueError(f"expected START, got {kind!r}")
        server = PolicyServer(config_from_json(payload))
        port = server.start()
    except Exception as e:
        send("ERROR", _error_reply(e))
        return 1
    send("OK", json.dumps({"port": port}).encode())
    maps: dict[int, mmap.mmap] = {}
    try:
        while True:
            try:
                kind, payload = ipc.recv(conn, MAX_MESSAGE)
            except (EOFError, OSError):
                return 0  # the trainer is gone
            if kind == "STOP":
                return 0
            try:
                send("OK", json.dumps(_answer(server, conn, kind, payload, maps, send)).encode())
            except Exception as e:
                send("ERROR", _error_reply(e))
    finally:
        server.stop()


def _error_reply(e: BaseException) -> bytes:
    return f"{'ValueError' if isinstance(e, ValueError) else 'RuntimeError'} {ipc.one_line(f'{e}')}".encode()


def _answer(server: PolicyServer, conn: Connection, kind: str, payload: bytes, maps: dict, send) -> dict:
    """The OK reply's JSON to one message other than START / STOP; ValueError for an unknown one."""
    if kind == "PUBLISH":
        return {"installed": server.publish(_received_policy(conn, payload, maps, send))}
    if kind == "VERSIONS":
        return {"versions": server.versions()}
    if kind == "STATS":
        return server.stats()
    raise ValueError(f"unknown message {kind!r}")


def _received_policy(conn: Connection, payload: bytes, maps: dict, send) -> FramedPolicy:
    """A PUBLISH's policy over its mapped buffer (mapping a new one into `maps`), whose release says
    RELEASED; a publish refused here is RELEASED at once, then its error raised."""
    head, _, raw = payload.partition(b"\n")
    meta = json.loads(head)
    buffer = int(meta["buffer"])
    released = json.dumps({"buffer": buffer}).encode()
    fd = ipc.recv_fd(conn, "PUBLISH") if meta["new"] else -1
    try:
        if fd >= 0:
            maps[buffer] = ipc.map_fd(fd, max(1, int(meta["capacity"])))
        manifest = mf.manifest_from_bytes(raw)
        layout = manifest_layout(manifest)
        if layout.size != meta["size"] or buffer not in maps or layout.size > len(maps[buffer]):
            raise ValueError(
                f"version {manifest.version}: frames of {meta['size']} bytes in buffer {buffer}, "
                f"the manifest lays out {layout.size}"
            )
    except Exception:
        send("RELEASED", released)  # never handed to the server: the trainer's pool takes it back
        raise
    data = np.frombuffer(maps[buffer], dtype=np.uint8, count=layout.size)
    return FramedPolicy(manifest, layout, data, release=lambda r=released: send("RELEASED", r))


def main(argv: list[str]) -> int:
    # The child lives as long as its parent's end of the socket: ^C and SIGTERM are the trainer's,
    # which stops it (STOP) or, gone, closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return _child(Connection(int(argv[0])))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
