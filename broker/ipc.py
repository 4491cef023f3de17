"""Messages between a service and a child process of its own, over a socketpair: nothing pickled.

Each message is one length-prefixed frame (`multiprocessing.connection.Connection.send_bytes`) holding
"KIND payload" (KIND ascii, one space, the payload bytes); a file descriptor travels right after a
message as SCM_RIGHTS with one marker byte. Used by the trainer's policy-server process
(broker/server_process.py) and the rollout worker's fetch process (rollout/fetch_process.py), with
the child's start (`spawn`) and the shared memory both sides map (`memfd`, `shared_memory`, `map_fd`).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import subprocess
import sys
from multiprocessing.connection import Connection


def spawn(module: str) -> tuple[subprocess.Popen, Connection]:
    """`python -m module FD`, FD its end of a new socketpair: the child process and our end."""
    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen([sys.executable, "-m", module, str(theirs.fileno())], pass_fds=(theirs.fileno(),))
    finally:
        theirs.close()
    return proc, Connection(ours.detach())


def one_line(text: str) -> str:
    """`text` as one line of at most 500 characters (error messages crossing the boundary)."""
    return " ".join(text.split())[:500]


def send(conn: Connection, kind: str, payload: bytes = b"") -> None:
    conn.send_bytes(kind.encode() + b" " + payload)


def recv(conn: Connection, max_bytes: int) -> tuple[str, bytes]:
    """(KIND, payload) of the next message; OSError for one above `max_bytes`, EOFError at the end."""
    kind, _, payload = conn.recv_bytes(max_bytes).partition(b" ")
    return kind.decode("ascii", "replace"), payload


def send_fd(conn: Connection, fd: int) -> None:
    """A file descriptor to the peer (SCM_RIGHTS, one marker byte), right after a message."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        socket.send_fds(sock, [b"F"], [fd])
    finally:
        sock.detach()  # the fd stays the Connection's


def recv_fd(conn: Connection, after: str) -> int:
    """The descriptor sent after the message `after` (named in the error if something else came)."""
    sock = socket.socket(fileno=conn.fileno())
    try:
        marker, fds, _, _ = socket.recv_fds(sock, 1, 1)
    finally:
        sock.detach()
    if marker != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected one file descriptor after {after}, got {len(fds)} and {marker!r}")
    return fds[0]


def memfd(name: str, nbytes: int) -> int:
    """An anonymous shared-memory file of `nbytes` (Linux memfd_create: no file in /dev/shm, nothing
    to leak when a process is killed, no /dev/shm size limit), its pages reserved now: no room fails
    here with OSError, not with SIGBUS when a page is first touched."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        raise OSError(f"cannot reserve {nbytes} bytes of shared memory: {e.strerror}") from None
    return fd


def shared_memory(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """A `memfd` of `nbytes` mapped here: (its descriptor, to send to a peer; the mapping)."""
    fd = memfd(name, nbytes)
    try:
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def map_fd(fd: int, nbytes: int) -> mmap.mmap:
    """A descriptor received from the peer (`recv_fd`), mapped; the descriptor itself is closed."""
    try:
        return mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def unmap(mapping: mmap.mmap) -> None:
    """Close a mapping, unless arrays still alias it: it then goes with the last of them."""
    with contextlib.suppress(BufferError):
        mapping.close()
