"""Delta versions over real gRPC on 127.0.0.1: a PolicyServer and PolicyClient (and the fetch process)
against each other; every fetch's bytes are compared with a full fetch's."""

from __future__ import annotations

import contextlib
import logging
import time

import grpc
import numpy as np
import pytest
import torch
import xxhash
from google.protobuf.message import DecodeError
from mixed_formats import format_for  # tests/mixed_formats.py: conftest.py puts tests/ on sys.path

from broker import delta as dl
from broker.delta import HeldPolicy
from broker.policy_client import PolicyClient, PolicyClientConfig, ReceiveBuffers
from broker.policy_server import PolicyServer, PolicyServerConfig
from policy import manifest as M
from policy.formats.params import quantize_param
from policy.model import ModelConfig, parameter_shapes
from rollout.fetch_process import FetchProcess, FetchRequest
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=2, top_k=1)
CHUNK = 8192
CONTRACT = M.Contract(model_config=CFG, recipe_name="mixed", recipe_rules={"rules": ["test"]})
FP = CONTRACT.fingerprint()


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*(s if len(s) == 2 else (1, s[0])), generator=g) for n, s in parameter_shapes(CFG).items()}


def nudged(ws: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """`ws` with a few elements of three tensors moved (a small optimizer step's worth of change)."""
    out = dict(ws)
    for name in sorted(ws)[:: max(1, len(ws) // 3)][:3]:
        w = ws[name].clone()
        w.view(-1)[step : step + 40] += 0.7
        out[name] = w
    return out


def policy(version: int, ws: dict[str, torch.Tensor]) -> M.PackedPolicy:
    tensors = {}
    for n, w in ws.items():
        fmt, kw = format_for(n)
        tensors[n] = quantize_param(w, fmt, **kw)
    return M.build_manifest(
        version=version, parent_version=version - 1 or None, contract=CONTRACT, tensors=tensors, chunk_bytes=CHUNK
    )


@pytest.fixture(scope="module")
def versions() -> dict[int, M.PackedPolicy]:
    ws = weights()
    out = {}
    for v in range(1, 5):
        out[v] = policy(v, ws)
        ws = nudged(ws, 100 * v)
    return out


class RoguePolicyServer(PolicyServer):
    """The real server, its delta payload chunks changed on the way out (a test wraps the handler's
    message generator: the production class has no hooks): `flip` flips a payload byte; with
    `fix_xxh3` the chunk's xxh3 is recomputed, so only the rebuilt tensor's checksums can tell."""

    flip = False
    fix_xxh3 = False

    async def _fetch_messages(self, request: bytes, context):
        stream = super()._fetch_messages(request, context)
        delta = False
        try:
            async for msg in stream:
                try:
                    chunk = policy_pb2.TensorChunk.FromString(msg)
                except DecodeError:
                    chunk = None
                if chunk is not None and chunk.HasField("delta"):
                    delta = True
                elif chunk is not None and delta and self.flip:
                    data = bytearray(chunk.data)
                    data[len(data) // 2] ^= 0x10
                    chunk.data = bytes(data)
                    if self.fix_xxh3:
                        chunk.xxh3 = xxhash.xxh3_64_intdigest(chunk.data)
                    msg = chunk.SerializeToString()
                yield msg
        finally:
            await stream.aclose()


@contextlib.contextmanager
def serve(*pols: M.PackedPolicy, cls=PolicyServer, **kw):
    """A started server (keep_versions 4 unless said) with `pols` published."""
    kw.setdefault("keep_versions", 4)
    kw.setdefault("deltas", True)
    with cls(PolicyServerConfig(**kw)) as s:
        for p in pols:
            s.publish(p)
        yield s


def client(server: PolicyServer, **kw) -> PolicyClient:
    return PolicyClient(PolicyClientConfig(address=server.address, expected_fingerprint=FP, retry_backoff_s=0.0, **kw))


def assert_bytes_of(fetched, p: M.PackedPolicy) -> None:
    assert sorted(fetched.data) == sorted(p.blobs)
    for name, blob in p.blobs.items():
        assert fetched.data[name].tobytes() == bytes(blob), name


def test_delta_when_the_parent_is_held_full_when_not(versions):
    with serve(versions[1], versions[2]) as s, client(s) as c:
        v1 = c.fetch(1)
        assert v1.stats.delta_parent == 0
        v2 = c.fetch(2, parent=v1.held())
        assert v2.stats.delta_parent == 1 and v2.stats.delta_refused == 0
        assert v2.stats.bytes < versions[2].manifest.total_bytes / 4  # three nudged tensors of many
        assert_bytes_of(v2, versions[2])
        # the encoding is the transport's: the version's manifest (and so its fingerprint) is the publish's
        assert M.manifest_digest(v2.manifest) == M.manifest_digest(versions[2].manifest)
        assert v2.manifest.contract_fingerprint == FP
        assert c.fetch(2).stats.delta_parent == 0  # nothing held: full
        assert s.stats()["delta_streams"] == 1


def test_the_delta_against_the_previous_version_is_built_at_publish(versions):
    # delta_full_every=2: publish 1 (v1) and 3 (v3) are full only, v2 gets its delta against v1 at once
    with serve(versions[1], versions[2], versions[3], delta_full_every=2) as s:
        deadline = time.monotonic() + 30
        while s.stats()["deltas_built"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # none more comes
        assert s.stats()["deltas_built"] == 1 and s.stats()["fetch_streams"] == 0
        with client(s) as c:
            v2 = c.fetch(2, parent=c.fetch(1).held())
        assert v2.stats.delta_parent == 1
        assert_bytes_of(v2, versions[2])
        assert s.stats()["deltas_built"] == 1  # served from the build at publish


def test_a_large_tensors_delta_travels_as_frames_rebuilt_apart(versions, monkeypatch):
    # One chunk per frame: every tensor over a chunk is encoded, sent and rebuilt as several frames.
    monkeypatch.setattr(dl, "FRAME_BYTES", CHUNK)
    descriptions = []
    real = PolicyClient._take_delta

    def spy(self, call, desc, *a, **kw):
        descriptions.append(desc)
        return real(self, call, desc, *a, **kw)

    monkeypatch.setattr(PolicyClient, "_take_delta", spy)
    with serve(versions[1], versions[2]) as s, client(s) as c:
        v2 = c.fetch(2, parent=c.fetch(1).held())
    assert v2.stats.delta_parent == 1 and v2.stats.delta_refused == 0
    assert_bytes_of(v2, versions[2])
    (desc,) = descriptions
    assert desc.frame_tensor_bytes == CHUNK
    framed = [t for t in desc.tensors if len(t.frame_bytes) > 1]
    assert framed and all(sum(t.frame_bytes) == t.payload_bytes for t in desc.tensors)


def test_delta_over_several_streams(versions):
    with serve(versions[1], versions[2]) as s, client(s, streams=3) as c:
        v2 = c.fetch(2, parent=c.fetch(1).held())
        assert v2.stats.delta_parent == 1
        assert_bytes_of(v2, versions[2])
        assert s.stats()["delta_streams"] == 3  # one per stream (the delta is built once)


def test_unchanged_tensors_cost_no_bytes():
    ws = weights()
    same = policy(2, ws)  # v1's tensors again: only the version differs
    with serve(policy(1, ws), same) as s, client(s) as c:
        v2 = c.fetch(2, parent=c.fetch(1).held())
        assert v2.stats.delta_parent == 1 and v2.stats.bytes == 0 and v2.stats.chunks == 0
        assert_bytes_of(v2, same)


def test_a_wrong_parent_is_refused_and_fetched_whole(versions, caplog):
    with serve(versions[1], versions[2], versions[3]) as s, client(s) as c:
        v1, v2 = c.fetch(1), c.fetch(2)
        # v1's number and digest over v2's bytes: what the worker holds is not what it says
        wrong = HeldPolicy(1, v1.held().digest, v2.data)
        with caplog.at_level(logging.WARNING, logger="tandem.policy_client"):
            v3 = c.fetch(3, parent=wrong)
        assert v3.stats.delta_refused == 1 and v3.stats.delta_parent == 0
        assert "fails the manifest's checksums" in v3.stats.delta_refusal
        assert_bytes_of(v3, versions[3])
        lines = [r.getMessage() for r in caplog.records if "delta against v1 refused" in r.getMessage()]
        assert len(lines) == 1 and "fetching it whole" in lines[0]


@pytest.mark.parametrize("frame_bytes", [dl.FRAME_BYTES, CHUNK], ids=["one-frame", "frames"])
@pytest.mark.parametrize("fix_xxh3", [False, True], ids=["chunk-xxh3", "rebuilt-checksums"])
def test_flipped_delta_bytes_are_refused_and_fetched_whole(versions, fix_xxh3, frame_bytes, monkeypatch):
    monkeypatch.setattr(dl, "FRAME_BYTES", frame_bytes)
    with serve(versions[1], versions[2], cls=RoguePolicyServer) as s, client(s) as c:
        s.flip, s.fix_xxh3 = True, fix_xxh3
        v2 = c.fetch(2, parent=c.fetch(1).held())
        assert v2.stats.delta_refused == 1 and v2.stats.delta_parent == 0
        why = v2.stats.delta_refusal
        if fix_xxh3:  # the payload decodes to other bytes, or not at all
            reasons = ("fails the manifest's checksums", "undecodable delta payload", "the delta frame holds")
            assert any(r in why for r in reasons), why  # a flip in a frame's header changes its size
        else:
            assert "failed its xxh3 check" in why, why
        assert_bytes_of(v2, versions[2])


def test_a_parent_whose_memory_was_reused_is_refused_the_next_one_is_used(versions):
    """The worker's host buffers held v1 until v2 was fetched into them (in place, from the delta):
    offering v1 again is a wrong parent (refused, full); offering v2 is a delta, in place again."""
    buffers = ReceiveBuffers()
    with serve(versions[1], versions[2], versions[3]) as s, client(s) as c:
        held1 = c.fetch(1, buffers=buffers).held()
        v2 = c.fetch(2, buffers=buffers, parent=held1)
        assert v2.stats.delta_parent == 1 and buffers.allocations == 1
        assert_bytes_of(v2, versions[2])
        stale = c.fetch(3, buffers=buffers, parent=held1)
        assert stale.stats.delta_refused == 1
        assert_bytes_of(stale, versions[3])
        again = c.fetch(2, buffers=buffers, parent=stale.held())  # v3's bytes in place -> v2
        assert again.stats.delta_parent == 3
        assert_bytes_of(again, versions[2])


def test_a_parent_the_server_evicted_or_never_had_gets_full(versions):
    with serve(versions[1], versions[2], versions[3], keep_versions=2) as s, client(s) as c:
        assert s.versions() == [2, 3]
        v1 = HeldPolicy(
            1,
            M.manifest_digest(versions[1].manifest),
            {n: np.frombuffer(b, np.uint8) for n, b in versions[1].blobs.items()},
        )
        v3 = c.fetch(3, parent=v1)
        assert v3.stats.delta_parent == 0 and v3.stats.delta_refused == 0
        assert_bytes_of(v3, versions[3])


def test_a_trainer_restart_breaks_the_chain_full_then_deltas_again(versions):
    with serve(versions[1], versions[2]) as old, client(old) as c:
        held2 = c.fetch(2, parent=c.fetch(1).held()).held()
    # The restarted trainer publishes other content under the same numbers: v2's digest differs.
    ws = nudged(weights(seed=7), 0)
    new2, new3, new4 = policy(2, ws), policy(3, nudged(ws, 5)), policy(4, nudged(ws, 9))
    with serve(new2, new3, new4) as new, client(new) as c:
        v3 = c.fetch(3, parent=held2)
        assert v3.stats.delta_parent == 0 and v3.stats.delta_refused == 0
        assert_bytes_of(v3, new3)
        v4 = c.fetch(4, parent=v3.held())
        assert v4.stats.delta_parent == 3
        assert_bytes_of(v4, new4)
        assert new.stats()["delta_streams"] == 1


def test_every_kth_publish_is_served_full_only(versions):
    with serve(*versions.values(), delta_full_every=2) as s, client(s) as c:
        v1 = c.fetch(1)
        v2 = c.fetch(2, parent=v1.held())  # publish 2 of every 2: deltas allowed
        v3 = c.fetch(3, parent=v2.held())  # publish 3: full only
        v4 = c.fetch(4, parent=v3.held())
        assert [v.stats.delta_parent for v in (v2, v3, v4)] == [1, 0, 3]
        assert_bytes_of(v4, versions[4])


def test_deltas_off_serves_full(versions):
    with serve(versions[1], versions[2], deltas=False) as s, client(s) as c:
        v2 = c.fetch(2, parent=c.fetch(1).held())
        assert v2.stats.delta_parent == 0 and s.stats()["delta_streams"] == 0


def test_fetch_process_children_rebuild_in_the_shared_slab(versions):
    """Two fetch children, each rebuilding its part in the slab that holds the previous version; a
    corrupt delta is refused and fetched whole, and the slab then holds that version for the next."""
    fetcher = FetchProcess(pinned=False, reuse=True, processes=2, log=lambda line: None)
    try:
        with serve(*versions.values(), cls=RoguePolicyServer) as s:
            req = {"address": s.address, "fingerprint": FP}
            v1 = fetcher.fetch(FetchRequest(version=1, **req))
            assert v1.stats.delta_parent == 0
            v2 = fetcher.fetch(FetchRequest(version=2, **req))
            assert v2.stats.delta_parent == 1 and v2.stats.delta_refused == 0
            assert_bytes_of(v2, versions[2])
            s.flip, s.fix_xxh3 = True, True
            v3 = fetcher.fetch(FetchRequest(version=3, **req))
            assert v3.stats.delta_refused >= 1  # by each child whose part changed
            assert_bytes_of(v3, versions[3])
            s.flip = False
            v4 = fetcher.fetch(FetchRequest(version=4, **req))
            assert v4.stats.delta_parent == 3 and v4.stats.delta_refused == 0
            assert_bytes_of(v4, versions[4])
            assert fetcher.buffers.allocations == 1
    finally:
        fetcher.close()


def test_too_many_held_versions_is_invalid_argument(versions):
    with serve(versions[1]) as s, grpc.insecure_channel(s.address) as channel:
        fetch = channel.unary_stream("/tandem.v1.PolicyService/FetchTensors")
        req = policy_pb2.FetchTensorsRequest(version=1)
        for v in range(17):
            req.held.add(version=v + 1, manifest_digest=bytes(32))
        with pytest.raises(grpc.RpcError) as e:
            list(fetch(req.SerializeToString(), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "17 held versions exceed the limit of 16" in e.value.details()
