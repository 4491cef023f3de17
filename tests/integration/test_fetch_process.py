"""The policy fetch in a child process (rollout/fetch_process.py): real PolicyServer on loopback, a
real child process receiving into shared memory. What it fetches is bitwise what the in-process
client fetches; errors come back as the in-process fetch's types; the slab is reused and freed
with the FetchProcess; a child killed mid-fetch is replaced and the worker loses nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
from drive_worker import load, rollout_group  # tests/drive_worker.py
from faults.proxy import Proxy
from test_policy_grpc import FaultyPolicyServer
from test_worker_prefetch import CFG, build

from broker.codec import PromptGroup
from broker.policy_client import (
    ChecksumMismatch,
    FetchCancel,
    FetchCancelled,
    FingerprintMismatch,
    PolicyClient,
    PolicyClientConfig,
    split_by_bytes,
)
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import PolicyPointer
from policy import manifest as mf
from policy.chunks import first_chunk_indices
from policy.manifest_check import ManifestRefused
from rollout.fetch_process import FetchProcess, FetchRequest, whole_layouts
from tandem.services import make_worker

pytestmark = pytest.mark.integration


def with_fetch_process(on: bool, processes: int = 1):
    return dataclasses.replace(
        CFG, rollout=dataclasses.replace(CFG.rollout, fetch_process=on, fetch_processes=processes)
    )


def slab_handles(pid: int | str = "self") -> tuple[int, int]:
    """(open descriptors, mappings) of fetch slabs (memfds) in process `pid`."""
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += "tandem-fetch-slab" in os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            pass
    with open(f"/proc/{pid}/maps") as f:
        maps = sum("tandem-fetch-slab" in line for line in f)
    return fds, maps


def own_slab_handles(before: tuple[int, int]) -> tuple[int, int]:
    """slab_handles() of this process beyond `before` (what an earlier test in this process left
    mapped, e.g. a worker whose CPU model aliases its slab and that is not collected yet)."""
    fds, maps = slab_handles()
    return fds - before[0], maps - before[1]


def slab_bytes(fetcher: FetchProcess, fetched) -> dict[str, bytes]:
    """The received bytes of each tensor, read back from the parent's mapping of the slab."""
    views = fetcher.buffers.views({n: lay.nbytes for n, lay in fetched.layouts.items()})
    return {n: v.tobytes() for n, v in views.items()}


@pytest.mark.parametrize("processes", [1, 3])
def test_child_fetch_is_bitwise_the_in_process_fetch(processes):
    fingerprint = build(1).manifest.contract_fingerprint
    logs: list[str] = []
    before = slab_handles()
    fetcher = FetchProcess(pinned=False, reuse=True, processes=processes, log=logs.append)
    with PolicyServer(PolicyServerConfig(keep_versions=4)) as server:
        for v in (1, 2):
            server.publish(build(v))

        def request(v: int, **kw) -> FetchRequest:
            return FetchRequest(address=server.address, fingerprint=kw.pop("fp", fingerprint), version=v, **kw)

        try:
            pids = set()
            for v in (1, 2):
                fetched = fetcher.fetch(request(v, streams=2))
                pids.add(tuple(fetcher.pids))
                with PolicyClient(PolicyClientConfig(address=server.address, expected_fingerprint=fingerprint)) as c:
                    manifest = c.get_manifest(v)
                    raw, layouts, _ = c.fetch_bytes(manifest)
                assert fetched.version == v and fetched.layouts == layouts
                got = slab_bytes(fetcher, fetched)
                assert got.keys() == raw.keys() and all(got[n] == raw[n].tobytes() for n in raw)
                assert fetched.stats.bytes == manifest.total_bytes and fetched.stats.receive_s > 0
                assert fetched.stats.verify_s >= 0 and fetched.stats.streams >= 2
                assert set(fetched.tensors) == set(raw)
                # one mapping each, whose mmap object keeps its own descriptor (Python's mmap dup()s it)
                assert own_slab_handles(before) == (1, 1) and all(slab_handles(pid) == (1, 1) for pid in fetcher.pids)
            # the same children, one slab, reused; every child fetched a part (3 streams or more each)
            assert len(pids) == 1 and len(fetcher.pids) == processes and fetcher.buffers.allocations == 1
            assert fetched.stats.streams >= 2 * processes

            # Errors: the in-process fetch's types, one line each, and the child serves on after each.
            with pytest.raises(grpc.RpcError) as e:
                fetcher.fetch(request(99))
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
            with pytest.raises(FingerprintMismatch):
                fetcher.fetch(request(1, fp="0" * 64))

            def refuse(m):
                raise ManifestRefused(f"version {m.version}: refused by the test")

            with pytest.raises(ManifestRefused, match="refused by the test"):
                fetcher.fetch(request(2), check=refuse)
            cancel = FetchCancel()
            cancel.cancel()
            with pytest.raises(FetchCancelled):
                fetcher.fetch(request(2), cancel=cancel)
            with pytest.raises(ValueError, match="connection refused"):
                fetcher.fetch(FetchRequest(address="127.0.0.1:1", fingerprint=fingerprint, version=1))
            assert fetcher.fetch(request(1)).version == 1 and tuple(fetcher.pids) in pids and fetcher.restarts == 0
            assert logs == []
            fetched = None  # its tensors alias the slab: closing frees it only once they are gone
        finally:
            procs = [c.proc for c in fetcher._children]
            fetcher.close()
    assert all(p.wait(5) is not None for p in procs) and own_slab_handles(before) == (
        0,
        0,
    )  # children gone, slab unmapped


async def test_fetch_child_killed_mid_fetch_is_replaced_and_nothing_is_lost():
    """A worker fetching in one child (rollout.fetch_process=true on the CPU, fetch_processes=1; the
    same with several children: test_one_of_three_children_killed_mid_fetch): the child is SIGKILLed
    while its fetch hangs mid-stream. The worker keeps v1 (groups start again), logs the new child
    once, and its retry loads v2: what it then generates is what a worker that fetched v2 in process
    generates, bitwise."""
    logs: list[str] = []
    before = slab_handles()
    worker = make_worker(with_fetch_process(True), "w0")
    worker.log = logs.append
    assert worker.fetching.process is not None
    with PolicyServer(PolicyServerConfig(keep_versions=4)) as server:
        for v in (1, 2):
            server.publish(build(v))
        proxy = Proxy(("127.0.0.1", server.port)).start()
        try:

            def pointer(v: int, address: str = server.address) -> PolicyPointer:
                return PolicyPointer(version=v, address=address, contract_fingerprint=worker.fingerprint)

            assert await load(worker, pointer(1)) and worker.version == 1
            p = worker.task.prompt(0)
            group = PromptGroup(
                prompt_id="p0", group_id="g0", prompt_tokens=np.asarray(p.tokens, np.int32), n_samples=2, task=p.fields
            )
            worker.submit(group)
            worker.step()  # a group in flight under v1

            m = build(2).manifest
            proxy.stall_after(len(mf.manifest_to_bytes(m)) + m.total_bytes // 2)  # v2's stream, mid-way
            assert not await worker.offer(pointer(2, proxy.address))
            deadline = time.monotonic() + 60
            while not proxy.stalled_connections:
                assert time.monotonic() < deadline and not worker.swap.fetched, logs
                await asyncio.sleep(0.05)
            child = worker.fetching.process.pid
            os.kill(child, signal.SIGKILL)
            await worker.wait_fetch(120)
            assert not await worker.offer(pointer(2, proxy.address))
            assert worker.version == 1 and not worker.batcher.draining  # kept v1, groups start again
            restarted = [ln for ln in logs if f"fetch process {child} exited" in ln and "started a new one" in ln]
            assert len(restarted) == 1 and worker.fetching.process.pid != child, logs
            assert any("fetching v2" in ln and "failed, will retry" in ln for ln in logs), logs
            finished = []
            while not finished:  # the group started under v1 finishes under v1
                finished = worker.step()
            assert [t.policy_version for t in finished[0].trajectories] == [1, 1]

            worker.swap.retry_s = 0.0  # the retry is due
            assert await load(worker, pointer(2)) and worker.version == 2
            fresh = make_worker(with_fetch_process(False), "w1")
            fresh.log = lambda _: None
            assert fresh.fetching.process is None and await load(fresh, pointer(2))
            for a, b in zip(rollout_group(worker, group), rollout_group(fresh, group)):
                assert a.policy_version == b.policy_version == 2
                assert np.array_equal(a.completion_tokens, b.completion_tokens)
                assert np.array_equal(a.behavior_logprobs, b.behavior_logprobs)
        finally:
            proxy.close()
            worker.fetching.process.close()
    # No descriptor but the mappings' own, and at most the live version's slab still mapped (the
    # CPU model's weights alias it; the earlier versions' slabs are gone).
    fds, maps = own_slab_handles(before)
    assert fds == maps <= 1


def test_cancel_mid_fetch_keeps_the_child():
    """A fetch hung mid-stream is cancelled (a newer version superseded it): FetchCancelled soon,
    the same child serves the next fetch."""
    fingerprint = build(1).manifest.contract_fingerprint
    fetcher = FetchProcess(pinned=False, reuse=True, log=lambda line: pytest.fail(line))
    with PolicyServer(PolicyServerConfig()) as server:
        server.publish(build(1))
        proxy = Proxy(("127.0.0.1", server.port)).start()
        try:
            m = build(1).manifest
            proxy.stall_after(len(mf.manifest_to_bytes(m)) + m.total_bytes // 2)
            cancel = FetchCancel()
            outcome: list = []

            def run() -> None:
                try:
                    fetcher.fetch(
                        FetchRequest(address=proxy.address, fingerprint=fingerprint, version=1), cancel=cancel
                    )
                except BaseException as e:
                    outcome.append(e)

            t = threading.Thread(target=run)
            t.start()
            deadline = time.monotonic() + 60
            while not proxy.stalled_connections:
                assert time.monotonic() < deadline and t.is_alive(), outcome
                time.sleep(0.05)
            child = fetcher.pid
            cancel.cancel()
            t.join(30)
            assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], FetchCancelled), outcome
            fetched = fetcher.fetch(FetchRequest(address=server.address, fingerprint=fingerprint, version=1))
            assert fetched.version == 1 and fetcher.pid == child and fetcher.restarts == 0
        finally:
            proxy.close()
            fetcher.close()


class HoldingPolicyServer(PolicyServer):
    """The real server whose FetchTensors streams each stop after their first chunk while `hold` is
    set (counted in `held`), so a test acts while every child's stream is mid-fetch."""

    def __init__(self, config: PolicyServerConfig):
        super().__init__(config)
        self.hold = True
        self.held = 0

    async def _fetch_messages(self, request: bytes, context):
        stream = super()._fetch_messages(request, context)
        try:
            first = True
            async for msg in stream:
                yield msg
                if first and self.hold:
                    self.held += 1  # the server's event loop is its only writer
                    while self.hold:
                        await asyncio.sleep(0.02)
                first = False
        finally:
            await stream.aclose()


def _fetch_in_thread(fetcher: FetchProcess, request: FetchRequest, cancel: FetchCancel):
    outcome: list = []

    def run() -> None:
        try:
            outcome.append(fetcher.fetch(request, cancel=cancel))
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, outcome


def _wait_held(server: HoldingPolicyServer, n: int, t: threading.Thread, outcome: list) -> None:
    deadline = time.monotonic() + 60
    while server.held < n:
        assert time.monotonic() < deadline and t.is_alive(), (server.held, outcome)
        time.sleep(0.02)


def _wait_no_fetches(server: PolicyServer) -> None:
    deadline = time.monotonic() + 30
    while server.stats()["active_fetches"]:
        assert time.monotonic() < deadline, server.stats()
        time.sleep(0.02)


def _in_process_bytes(address: str, fingerprint: str, v: int) -> dict:
    with PolicyClient(PolicyClientConfig(address=address, expected_fingerprint=fingerprint)) as c:
        raw, _, _ = c.fetch_bytes(c.get_manifest(v))
    return {n: a.tobytes() for n, a in raw.items()}


@pytest.mark.parametrize("victim", [0, 1], ids=["first-child", "other-child"])
def test_one_of_three_children_killed_mid_fetch(victim):
    """Three children, each mid-stream on its part; one is SIGKILLed: the fetch fails with OSError
    (the others' parts cancelled, one log line for the new child), and the next fetch runs on all
    three children (the replaced one included) and is bitwise the in-process fetch."""
    fingerprint = build(1).manifest.contract_fingerprint
    logs: list[str] = []
    fetcher = FetchProcess(pinned=False, reuse=True, processes=3, log=logs.append)
    with HoldingPolicyServer(PolicyServerConfig()) as server:
        server.publish(build(1))
        request = FetchRequest(address=server.address, fingerprint=fingerprint, version=1)
        try:
            t, outcome = _fetch_in_thread(fetcher, request, FetchCancel())
            _wait_held(server, 3, t, outcome)
            pids = fetcher.pids
            os.kill(pids[victim], signal.SIGKILL)
            t.join(60)
            assert not t.is_alive() and len(outcome) == 1 and type(outcome[0]) is OSError, outcome
            assert f"fetch process {pids[victim]}" in str(outcome[0])
            assert len(logs) == 1 and f"fetch process {pids[victim]} exited" in logs[0], logs
            after = fetcher.pids
            assert len(after) == 3 and after[victim] != pids[victim]
            assert [p for i, p in enumerate(after) if i != victim] == [p for i, p in enumerate(pids) if i != victim]
            assert fetcher.restarts == 1
            _wait_no_fetches(server)  # the server sees each cancelled stream end

            server.hold = False
            fetched = fetcher.fetch(request)
            assert fetched.version == 1 and fetched.stats.streams >= 3 and fetcher.pids == after
            got = slab_bytes(fetcher, fetched)
            assert got == _in_process_bytes(server.address, fingerprint, 1)
            assert all(slab_handles(pid) == (1, 1) for pid in after)
            fetched = None
        finally:
            server.hold = False
            fetcher.close()


def test_cancel_ends_every_childs_part():
    """A fetch on three children, each mid-stream, is cancelled: FetchCancelled, every stream of it
    ended on the server, the same three children serve the next fetch."""
    fingerprint = build(1).manifest.contract_fingerprint
    fetcher = FetchProcess(pinned=False, reuse=True, processes=3, log=lambda line: pytest.fail(line))
    with HoldingPolicyServer(PolicyServerConfig()) as server:
        server.publish(build(1))
        request = FetchRequest(address=server.address, fingerprint=fingerprint, version=1)
        try:
            cancel = FetchCancel()
            t, outcome = _fetch_in_thread(fetcher, request, cancel)
            _wait_held(server, 3, t, outcome)
            pids = fetcher.pids
            cancel.cancel()
            t.join(30)
            assert not t.is_alive() and len(outcome) == 1 and isinstance(outcome[0], FetchCancelled), outcome
            _wait_no_fetches(server)  # the server sees each cancelled stream end
            server.hold = False
            assert fetcher.fetch(request).version == 1 and fetcher.pids == pids and fetcher.restarts == 0
        finally:
            server.hold = False
            fetcher.close()


def test_a_corrupted_chunk_served_to_one_of_three_children():
    """A chunk corrupted once is fetched again by the child whose part holds it (the fetch is then
    bitwise the in-process one); a chunk that stays corrupt fails the fetch with ChecksumMismatch,
    as in process, and the children serve on."""
    policy = build(1)
    fingerprint = policy.manifest.contract_fingerprint
    fetcher = FetchProcess(pinned=False, reuse=True, processes=3, log=lambda line: pytest.fail(line))
    with FaultyPolicyServer(PolicyServerConfig()) as server:
        server.publish(policy)
        request = FetchRequest(address=server.address, fingerprint=fingerprint, version=1)
        expected = _in_process_bytes(server.address, fingerprint, 1)
        # the first chunk of a tensor of the second child's part
        parts = split_by_bytes({n: lay.nbytes for n, lay in whole_layouts(policy.manifest).items()}, 3)
        index = first_chunk_indices(policy.manifest)[parts[1][0]]
        try:
            server.corrupt_chunk(version=1, chunk_index=index)
            fetched = fetcher.fetch(request)
            assert fetched.stats.refetched_chunks == 1 and slab_bytes(fetcher, fetched) == expected
            server.corrupt_chunk(version=1, chunk_index=index, times=100)
            with pytest.raises(ChecksumMismatch, match=f"chunk {index}"):
                fetcher.fetch(request)
            server.corrupt_chunk(version=1, chunk_index=index, times=0)
            fetched = fetcher.fetch(request)
            assert slab_bytes(fetcher, fetched) == expected and fetcher.restarts == 0
            fetched = None
        finally:
            fetcher.close()


KILLED_PARENT = """
import sys, time
from rollout.fetch_process import FetchProcess, FetchRequest
f = FetchProcess(pinned=False)
f.fetch(FetchRequest(address=sys.argv[1], fingerprint=sys.argv[2], version=1))
print(f.pid, flush=True)
time.sleep(600)
"""


def test_a_killed_worker_leaves_no_child_and_no_slab():
    """SIGKILL the process owning a FetchProcess (after a fetch, its slab mapped by both): the child
    exits (its socket closed), so the slab (a memfd, no file anywhere) is freed with it."""
    fingerprint = build(1).manifest.contract_fingerprint
    with PolicyServer(PolicyServerConfig()) as server:
        server.publish(build(1))
        parent = subprocess.Popen(
            [sys.executable, "-c", KILLED_PARENT, server.address, fingerprint], stdout=subprocess.PIPE, text=True
        )
        try:
            child = int(parent.stdout.readline())
            assert slab_handles(child) == (1, 1)
        finally:
            parent.kill()
            parent.wait()
            parent.stdout.close()
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{child}") and "Z" not in _state(child):
        assert time.monotonic() < deadline, f"fetch child {child} outlived its parent"
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"
