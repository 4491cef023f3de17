"""Publishing into pooled, pre-framed host buffers (broker.frames) and serving from them (real gRPC)."""

from __future__ import annotations

import time

import grpc
import pytest
import torch
from mixed_formats import mixed_tensors  # tests/mixed_formats.py: conftest.py puts tests/ on sys.path

from broker import frames
from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.policy_server import PolicyServer, PolicyServerConfig
from policy import manifest as M
from policy.chunks import ChecksumMismatch, chunk_bounds, chunk_count, first_chunk_indices, hash_runs
from policy.contract import Contract
from policy.formats.params import QuantizedParam, quantize_param
from policy.model import ModelConfig
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=2, top_k=1)
CHUNK = 8192  # most tensors span several chunks


def make_tensors(seed: int) -> dict[str, QuantizedParam]:
    return mixed_tensors(CFG, seed)


CONTRACT = Contract(model_config=CFG, recipe_name="mixed", recipe_rules={"rules": ["test"]})


@pytest.fixture(scope="module")
def tensors():
    return make_tensors(0)


def framed(version: int, tensors, pool: frames.BufferPool) -> frames.FramedPolicy:
    return frames.build_framed(
        version=version,
        parent_version=version - 1 if version > 1 else None,
        contract=CONTRACT,
        tensors=tensors,
        pool=pool,
        chunk_bytes=CHUNK,
        created_unix_ns=1,
    )


def test_frames_are_the_messages_protobuf_would_serialize(tensors):
    """Every message in the buffer equals TensorChunk(...).SerializeToString() of the same chunk, and
    the manifest equals build_manifest's (same checksums)."""
    f = framed(3, tensors, frames.BufferPool())
    ref = M.build_manifest(
        version=3, parent_version=2, contract=CONTRACT, tensors=tensors, chunk_bytes=CHUNK, created_unix_ns=1
    )
    assert f.manifest == ref.manifest
    first = first_chunk_indices(ref.manifest)
    buf = f.data.tobytes()
    n = 0
    for tf, entry in zip(f.layout.tensors, ref.manifest.tensors):
        blob = bytes(ref.blobs[entry.name])
        assert tf.name == entry.name and tf.first_index == first[entry.name]
        for j, (a, b) in enumerate(tf.messages):
            piece = blob[j * CHUNK : (j + 1) * CHUNK]
            want = policy_pb2.TensorChunk(
                version=3,
                chunk_index=first[entry.name] + j,
                tensor_name=entry.name,
                tensor_nbytes=entry.nbytes,
                offset=j * CHUNK,
                xxh3=entry.chunk_xxh3[j],
                tensor_sha256=entry.sha256 if j == len(tf.messages) - 1 else b"",
                data=piece,
            )
            assert buf[a:b] == want.SerializeToString(deterministic=True), (entry.name, j)
            n += 1
    assert n == sum(chunk_count(t.nbytes, CHUNK) for t in ref.manifest.tensors) > len(tensors)
    assert f.layout.size == len(buf)


def test_stage_clones_parts_that_alias_live_parameters():
    w = torch.randn(4, 64, dtype=torch.bfloat16)
    q = quantize_param(w, "bf16")
    q = QuantizedParam("bf16", {}, type(q.value)(w, (4, 64)))  # its part *is* the parameter
    staged = frames.stage(
        version=1, parent_version=None, contract=CONTRACT, tensors={"w": q}, pool=frames.BufferPool(), live=[w]
    )
    want = w.clone()
    w.add_(1)  # the next optimizer step, before the background run
    out = staged.run()
    got = out.data[out.layout.tensors[0].data[0][0] : out.layout.tensors[0].data[0][1]].tobytes()
    assert got == want.view(torch.uint8).numpy().tobytes() != w.view(torch.uint8).numpy().tobytes()


def client(server: PolicyServer) -> PolicyClient:
    return PolicyClient(
        PolicyClientConfig(
            address=server.address,
            expected_fingerprint=CONTRACT.fingerprint(),
            call_timeout_s=10.0,
            fetch_timeout_s=30.0,
            retry_backoff_s=0.0,
        )
    )


def assert_bitwise_equal(got: dict, want: dict[str, QuantizedParam]) -> None:
    assert sorted(got) == sorted(want)
    for name, q in want.items():
        for part, t in q.value.parts().items():
            assert torch.equal(got[name].parts()[part].view(torch.uint8), t.contiguous().view(torch.uint8)), name


def test_served_from_pooled_buffers_reused_only_after_eviction(tensors):
    """keep_versions=2: versions 1..7 cycle through 3 buffers (2 served, 1 being filled); a worker
    fetches each bitwise; an evicted version is NOT_FOUND."""
    pool = frames.BufferPool()
    other = {n: quantize_param(torch.randn(1, CFG.dim), "bf16") if n == "model.norm.weight" else q
             for n, q in tensors.items()}  # fmt: skip
    with PolicyServer(PolicyServerConfig(keep_versions=2)) as server, client(server) as c:
        for v in range(1, 6):
            want = tensors if v % 2 else other
            assert server.publish(framed(v, want, pool)) is True
            fetched = c.fetch(v)
            assert_bitwise_equal(fetched.tensors, want)
            assert server.versions() == list(range(max(1, v - 1), v + 1))
        assert pool.allocated == 3 and pool.free_buffers() == 1  # 2 served + 1 free for the next
        # Republishing the same content is a no-op that gives its buffer straight back.
        assert server.publish(framed(5, other if 5 % 2 == 0 else tensors, pool)) is False
        assert pool.free_buffers() == 1 and pool.allocated == 3

        server.publish(framed(6, tensors, pool))
        server.publish(framed(7, other, pool))
        assert pool.allocated == 3 and pool.free_buffers() == 1
        with pytest.raises(grpc.RpcError) as e:
            list(c._fetch(policy_pb2.FetchTensorsRequest(version=4), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        # TP shards of a framed version are cut from its buffer and served bitwise.
        fetched = c.fetch(7, tp_rank=1, tp_size=2)
        assert fetched.version == 7


def test_a_stream_reading_an_evicted_version_keeps_its_buffer():
    """A version bigger than gRPC's flow-control window: the server is still reading its buffer while
    the worker has read one chunk. Evicting it then does not free the buffer until the stream ends."""
    big = {"w": quantize_param(torch.randn(3072, 8192).to(torch.bfloat16), "bf16")}  # 48 MiB

    def version(v, pool):
        return frames.build_framed(version=v, parent_version=None, contract=CONTRACT, tensors=big, pool=pool)

    pool = frames.BufferPool()
    with PolicyServer(PolicyServerConfig(keep_versions=1)) as server, client(server) as c:
        server.publish(version(1, pool))
        stream = c._fetch(policy_pb2.FetchTensorsRequest(version=1), timeout=60)
        assert next(stream).version == 1
        server.publish(version(2, pool))  # evicts 1, which the stream still reads
        assert pool.allocated == 2 and pool.free_buffers() == 0
        server.publish(version(3, pool))  # 1's buffer is still held: a third one; 2's is released
        assert pool.allocated == 3 and pool.free_buffers() == 1
        rest = list(stream)
        assert len(rest) == 47 and all(ch.version == 1 for ch in rest)
        n = sum(len(ch.data) for ch in rest)
        assert n == 47 << 20
        deadline = time.monotonic() + 10
        while pool.free_buffers() < 2 and time.monotonic() < deadline:  # the stream's end is async
            time.sleep(0.01)
        assert pool.free_buffers() == 2
        with pytest.raises(grpc.RpcError) as e:
            list(c._fetch(policy_pb2.FetchTensorsRequest(version=1), timeout=10))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_corrupt_framed_buffer_is_caught_by_the_worker(tensors):
    """The worker verifies what the buffer holds: a byte changed after sealing fails its checksum."""
    pool = frames.BufferPool()
    f = framed(1, tensors, pool)
    a, b = f.layout.tensors[0].data[0]
    f.data[a] ^= 0xFF
    with PolicyServer(PolicyServerConfig()) as server, client(server) as c:
        server.publish(f)
        with pytest.raises(Exception, match="xxh3|checksum|sha256"):
            c.fetch(1)


def test_worker_checks_the_sha256_over_chunks_end_to_end(tensors):
    """Every chunk passes its xxh3, but the manifest's (and the server's) sha256 says other bytes: the
    worker's own digest over the chunks' sha256s, hashed in its pool, refuses the tensor. A clean
    version fetches whole and as TP shards (the server's shard digests, same definition)."""
    pool = frames.BufferPool()
    ok = framed(1, tensors, pool)
    bad = framed(2, tensors, pool)
    big = max(bad.layout.tensors, key=lambda t: t.nbytes)
    assert len(big.data) > 2
    entry = next(t for t in bad.manifest.tensors if t.name == big.name)
    entry.sha256 = bytes(32)
    bad.data[big.sha256_at : big.sha256_at + 32] = 0  # the served slot agrees with the manifest
    with PolicyServer(PolicyServerConfig()) as server, client(server) as c:
        server.publish(ok)
        server.publish(bad)
        got = c.fetch(1)
        assert set(got.tensors) == set(tensors)
        for rank in range(2):
            c.fetch(1, tp_rank=rank, tp_size=2)
        with pytest.raises(ChecksumMismatch, match=f"{big.name}.*failed the sha256 check"):
            c.fetch(2)


@pytest.mark.parametrize("task_chunks", [1, 3])
def test_tensors_hashed_in_runs_of_chunks_give_the_same_manifest(tensors, monkeypatch, task_chunks):
    """A tensor cut into several hashing tasks (runs of `task_chunks` chunks, in a pool of 4 threads)
    gets the same chunk xxh3s, sha256 and framed bytes as one task per tensor, in broker.frames and in
    build_manifest alike."""
    one = framed(1, tensors, frames.BufferPool())
    ref = M.build_manifest(
        version=1, parent_version=None, contract=CONTRACT, tensors=tensors, chunk_bytes=CHUNK, created_unix_ns=1
    )
    monkeypatch.setattr("policy.chunks.HASH_TASK_BYTES", task_chunks * CHUNK)
    runs = [hash_runs(chunk_bounds(t.nbytes, CHUNK)) for t in one.manifest.tensors]
    assert max(len(r) for r in runs) >= 4  # some tensors really are cut into several tasks
    cut = frames.build_framed(
        version=1, parent_version=None, contract=CONTRACT, tensors=tensors, pool=frames.BufferPool(),
        chunk_bytes=CHUNK, created_unix_ns=1, threads=4,
    )  # fmt: skip
    packed = M.build_manifest(
        version=1, parent_version=None, contract=CONTRACT, tensors=tensors, chunk_bytes=CHUNK, created_unix_ns=1,
        threads=4,
    )  # fmt: skip
    assert cut.manifest == one.manifest == ref.manifest == packed.manifest
    assert bytes(cut.data) == bytes(one.data)
    assert all(bytes(packed.blobs[n]) == bytes(ref.blobs[n]) for n in tensors)
