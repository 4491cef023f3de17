"""The policy server in a child process (broker/server_process.py): versions framed into shared pool
buffers are served from the child's mapping bit for bit, buffers come back to the trainer's pool after
eviction, bad publishes are refused as in-process, and a killed child is replaced on the same port
with the versions it held (real processes, real gRPC on loopback)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time

import pytest
from mixed_formats import mixed_tensors  # tests/mixed_formats.py: conftest.py puts tests/ on sys.path
from test_publish_frames import CFG, CONTRACT, assert_bitwise_equal, client, framed

from broker import frames
from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.policy_server import PolicyServerConfig
from broker.server_process import ATTEMPTS, PolicyServerProcess, ServerProcessGone, ServingProcesses, released_by_all
from policy import manifest as M

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tensors():
    return mixed_tensors(CFG, 0)


@pytest.fixture
def pool():
    p = frames.BufferPool(shared=True)
    yield p
    p.close()


def wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_served_from_the_childs_mapping_and_buffers_come_back(tensors, pool):
    """keep_versions=2: versions cycle through 3 shared buffers, each fetched bitwise from the child;
    the frame layout the child rebuilds from the manifest is the publish's."""
    other = mixed_tensors(CFG, 1)
    lines = []
    server = PolicyServerProcess(PolicyServerConfig(keep_versions=2), log=lines.append)
    server.start()
    try:
        with client(server) as c:
            for v in range(1, 6):
                want = tensors if v % 2 else other
                f = framed(v, want, pool)
                assert f.host is not None and f.host.fd >= 0
                assert frames.manifest_layout(f.manifest) == f.layout
                assert server.publish(f) is True
                assert_bitwise_equal(c.fetch(v).tensors, want)
                assert server.versions() == list(range(max(1, v - 1), v + 1))
            wait_for(lambda: pool.free_buffers() == 1)  # RELEASED crosses asynchronously
            assert pool.allocated == 3
            assert server.publish(framed(5, tensors, pool)) is False  # the same content: its buffer comes back
            wait_for(lambda: pool.free_buffers() == 1)
            assert pool.allocated == 3
    finally:
        server.stop()
    assert lines == []


def test_refusals_as_in_process(tensors, pool):
    server = PolicyServerProcess(PolicyServerConfig(keep_versions=2), log=print)
    server.start()
    try:
        assert server.publish(framed(1, tensors, pool)) is True
        assert server.publish(framed(1, tensors, pool)) is False  # the same content: a no-op
        with pytest.raises(ValueError, match="different content"):
            server.publish(framed(1, mixed_tensors(CFG, 1), pool))
        assert server.publish(framed(3, tensors, pool)) is True
        with pytest.raises(ValueError, match="not newer"):
            server.publish(framed(2, tensors, pool))
        private = framed(4, tensors, frames.BufferPool())  # not shared memory: the child cannot map it
        with pytest.raises(TypeError, match="shared pool buffer"):
            server.publish(private)
        packed = M.build_manifest(version=4, parent_version=3, contract=CONTRACT, tensors=tensors)
        with pytest.raises(TypeError):
            server.publish(packed)
        # Frames whose size is not what the manifest lays out: refused by the child, nothing installed.
        bad = framed(4, tensors, pool)
        bad = dataclasses.replace(bad, layout=dataclasses.replace(bad.layout, size=bad.layout.size - 1))
        with pytest.raises(ValueError, match="the manifest lays out"):
            server.publish(bad)
        assert server.versions() == [1, 3]
        wait_for(lambda: pool.free_buffers() == 1)  # the refused ones came straight back: 3 buffers in all
        assert pool.allocated == 3
        stats = server.stats()
        assert stats["active_fetches"] == 0
        names = [s[1] for s in server.prometheus_samples()]
        assert "tandem_policy_sent_bytes_total" in names
    finally:
        server.stop()


def test_killed_child_is_replaced_on_the_same_port_with_its_versions(tensors, pool):
    lines = []
    server = PolicyServerProcess(PolicyServerConfig(keep_versions=2), log=lines.append)
    port = server.start()
    try:
        for v in (1, 2, 3):
            server.publish(framed(v, tensors, pool))
        wait_for(lambda: pool.free_buffers() == 1)  # v1 evicted and released
        old = server.pid
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: server.restarts == 1 and server.pid != old)
        assert server.port == port
        with client(server) as c:
            assert_bitwise_equal(c.fetch(3).tensors, tensors)
            assert_bitwise_equal(c.fetch(2).tensors, tensors)
        assert server.versions() == [2, 3]
        assert len(lines) == 1 and f"policy server process {old} exited" in lines[0] and "[2, 3]" in lines[0]
        server.publish(framed(4, tensors, pool))  # the new child maps the buffers it is sent
        with client(server) as c:
            assert_bitwise_equal(c.fetch(4).tensors, tensors)
    finally:
        server.stop()


def test_a_request_while_the_child_dies_fails_with_one_error(tensors, pool):
    server = PolicyServerProcess(PolicyServerConfig(keep_versions=2), log=lambda s: None)
    server.start()
    try:
        with server._lock:  # no replacement before the request has failed
            os.kill(server.pid, signal.SIGKILL)
            with pytest.raises(OSError):  # ServerProcessGone, or the send's broken pipe
                server._request("VERSIONS")
        wait_for(lambda: server.restarts == 1)
        assert server.versions() == []
    finally:
        server.stop()


@pytest.mark.slow
def test_a_publish_whose_child_dies_under_it_goes_to_the_replacement(tensors, pool):
    """The child stopped (SIGSTOP) so that the publish waits for its reply, then SIGKILLed: the
    publish is sent to the replacement after the versions the dead child held, and succeeds."""
    lines = []
    server = PolicyServerProcess(PolicyServerConfig(keep_versions=3), log=lines.append)
    server.start()
    try:
        for v in (1, 2):
            server.publish(framed(v, tensors, pool))
        old = server.pid
        os.kill(old, signal.SIGSTOP)
        result = []
        publishing = threading.Thread(target=lambda: result.append(server.publish(framed(3, tensors, pool))))
        publishing.start()
        deadline = time.monotonic() + 30
        while not any(f"{old}: no reply to PUBLISH of version 3 in" in ln for ln in lines):
            assert time.monotonic() < deadline, lines  # the publish waits for the stopped child's reply
            time.sleep(0.05)
        os.kill(old, signal.SIGKILL)
        publishing.join(timeout=60)
        assert result == [True]
        assert server.pid != old and server.versions() == [1, 2, 3]
        with client(server) as c:
            for v in (1, 2, 3):
                assert_bitwise_equal(c.fetch(v).tensors, tensors)
        assert any(f"{old} exited (-9) during publishing version 3" in ln for ln in lines), lines
    finally:
        server.stop()


@pytest.mark.slow
def test_a_child_that_dies_at_every_attempt_fails_the_publish_with_one_error(tensors, pool):
    """Every child SIGKILLed as soon as it exists: the publish gives up after ATTEMPTS children with one
    ServerProcessGone, and once children live again the next publish goes through."""
    server = PolicyServerProcess(PolicyServerConfig(keep_versions=2), log=lambda s: None)
    server.start()
    server.publish(framed(1, tensors, pool))
    stop = threading.Event()

    def kill_every_child():
        while not stop.is_set():
            with contextlib.suppress(ProcessLookupError, TypeError):
                os.kill(server.pid, signal.SIGKILL)
            time.sleep(0.005)

    killer = threading.Thread(target=kill_every_child)
    killer.start()
    try:
        with pytest.raises(ServerProcessGone, match=f"publishing version 2 at each of {ATTEMPTS} attempts") as e:
            server.publish(framed(2, tensors, pool))
        assert "\n" not in str(e.value)
        stop.set()
        killer.join()
        assert server.publish(framed(2, tensors, pool)) is True
        assert server.versions() == [1, 2]
    finally:
        stop.set()
        server.stop()


def test_released_by_all_gives_the_buffer_back_after_the_last_holder():
    calls = []
    f = frames.FramedPolicy(manifest=None, layout=None, data=None, release=lambda: calls.append(1))
    copies = released_by_all(f, 3)
    for c in copies[:2]:
        c.release()
    assert calls == []
    copies[2].release()
    assert calls == [1]
    assert released_by_all(dataclasses.replace(f, release=None), 2)[0].release is None


def test_several_serving_processes_share_one_port_and_each_buffer(tensors, pool):
    """Two children on one port (SO_REUSEPORT): a fetch over 16 connections is served by both, bit
    for bit; an evicted version's buffer returns only once both released it; a killed child is
    replaced on the port and serves again."""
    lines = []
    server = ServingProcesses(PolicyServerConfig(keep_versions=2), processes=2, log=lines.append)
    server.start()
    wide = PolicyClientConfig(
        address=server.address, expected_fingerprint=CONTRACT.fingerprint(), call_timeout_s=10.0,
        fetch_timeout_s=30.0, retry_backoff_s=0.0, streams=16,
    )  # fmt: skip
    try:
        assert len(set(server.pids)) == 2
        for v in (1, 2, 3):
            assert server.publish(framed(v, tensors, pool)) is True
        wait_for(lambda: pool.free_buffers() == 1)  # v1 evicted by both children
        assert pool.allocated == 3 and server.versions() == [2, 3]
        with contextlib.closing(PolicyClient(wide)) as c:
            assert_bitwise_equal(c.fetch(3).tensors, tensors)
        per_child = [child.stats()["fetch_streams"] for child in server.children]
        assert all(n > 0 for n in per_child) and server.stats()["fetch_streams"] == sum(per_child), per_child
        old = server.pids[1]
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: server.children[1].pid != old and server.children[1].versions() == [2, 3])
        server.publish(framed(4, tensors, pool))
        with contextlib.closing(PolicyClient(wide)) as c:
            assert_bitwise_equal(c.fetch(4).tensors, tensors)
        assert any(f"{old} exited (-9)" in ln for ln in lines), lines
    finally:
        server.stop()
