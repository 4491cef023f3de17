"""The gRPC policy server and client against each other on 127.0.0.1 (real server, real channel)."""

from __future__ import annotations

import socket
import subprocess
import threading

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from mixed_formats import mixed_tensors  # tests/mixed_formats.py: conftest.py puts tests/ on sys.path

from broker.policy_client import (
    ChecksumMismatch,
    FetchCancel,
    FetchCancelled,
    FingerprintMismatch,
    PolicyClient,
    PolicyClientConfig,
    ReceiveBuffers,
)
from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.tls import ClientTLS, ServerTLS, TLSHandshakeError
from policy import manifest as M
from policy import tp
from policy.chunks import chunk_count, first_chunk_indices
from policy.contract import ActivationSite, Contract
from policy.formats.params import QuantizedParam, quantize_param
from policy.model import ModelConfig, parameter_shapes
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=2, top_k=1)
CHUNK = 8192  # small chunks: most tensors span several


def make_tensors(seed: int) -> dict[str, QuantizedParam]:
    return mixed_tensors(CFG, seed)


def with_one_change(tensors: dict[str, QuantizedParam], seed: int) -> dict[str, QuantizedParam]:
    """The same policy with the final norm's weight replaced (cheap "different content")."""
    w = torch.randn(1, CFG.dim, generator=torch.Generator().manual_seed(seed))
    return {**tensors, "model.norm.weight": quantize_param(w, "bf16")}


def make_contract(mode: str = "global", trainer_tp_size: int = 1) -> Contract:
    sites = [
        ActivationSite(name=n[: -len(".weight")] + ".input", format="nvfp4", tp_scale_mode=mode)
        for n in parameter_shapes(CFG)
        if ".experts." in n
    ]
    return Contract(
        model_config=CFG,
        recipe_name="mixed",
        recipe_rules={"rules": ["test"]},
        activation_sites=sites,
        trainer_tp_size=trainer_tp_size,
    )


@pytest.fixture(scope="module")
def tensors():
    return make_tensors(0)


@pytest.fixture(scope="module")
def policy(tensors):
    return M.build_manifest(
        version=1, parent_version=None, contract=make_contract(), tensors=tensors, chunk_bytes=CHUNK
    )


class FaultyPolicyServer(PolicyServer):
    """The real server with its FetchTensors handler wrapped: faults a test asks for are injected into
    the stream it serves (the production class has no test hooks)."""

    def __init__(self, config: PolicyServerConfig):
        super().__init__(config)
        self._faults = threading.Lock()
        self._corrupt: dict[tuple[int, int, int, int], int] = {}  # (version, chunk, tp_rank, tp_size) -> times
        self._drop_after: list[int] = []  # one entry per next stream

    def corrupt_chunk(self, *, version: int, chunk_index: int, tp_rank: int = 0, tp_size: int = 1, times: int = 1):
        """Flip the last payload byte of this chunk the next `times` times it is sent."""
        with self._faults:
            self._corrupt[(version, chunk_index, tp_rank, tp_size)] = times

    def drop_stream_after(self, n_chunks: int) -> None:
        """End the next FetchTensors stream with UNAVAILABLE after `n_chunks` chunks."""
        with self._faults:
            self._drop_after.append(n_chunks)

    def _corrupted(self, msg: bytes, req) -> bytes:
        chunk = policy_pb2.TensorChunk.FromString(msg)
        key = (chunk.version, chunk.chunk_index, req.tp_rank, req.tp_size or 1)
        with self._faults:
            left = self._corrupt.get(key, 0)
            if not left:
                return msg
            self._corrupt[key] = left - 1
        return msg[:-1] + bytes([msg[-1] ^ 0xFF])

    async def _fetch_messages(self, request: bytes, context):
        try:
            req = policy_pb2.FetchTensorsRequest.FromString(request)
        except DecodeError:  # malformed: the server itself answers it
            req = None
        with self._faults:
            drop_after = self._drop_after.pop(0) if self._drop_after else None
        stream = super()._fetch_messages(request, context)
        try:
            sent = 0
            async for msg in stream:
                yield self._corrupted(msg, req) if self._corrupt and req is not None else msg
                sent += 1
                if drop_after is not None and sent >= drop_after:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "test: stream dropped")
        finally:
            await stream.aclose()  # the server's counters are final when the stream ends


@pytest.fixture
def server():
    s = FaultyPolicyServer(
        PolicyServerConfig(keep_versions=2, max_request_bytes=64 << 10, max_receive_message_bytes=256 << 10)
    )
    s.start()
    yield s
    s.stop()


def client(server: PolicyServer, **kw) -> PolicyClient:
    kw.setdefault("expected_fingerprint", make_contract().fingerprint())
    kw.setdefault("call_timeout_s", 10.0)
    kw.setdefault("fetch_timeout_s", 30.0)
    kw.setdefault("retry_backoff_s", 0.0)
    return PolicyClient(PolicyClientConfig(address=server.address, **kw))


def assert_bitwise_equal(got: dict, want: dict[str, QuantizedParam]) -> None:
    assert sorted(got) == sorted(want)
    for name, q in want.items():
        g = got[name].parts()
        for part, t in q.value.parts().items():
            assert torch.equal(g[part].view(torch.uint8), t.contiguous().view(torch.uint8)), (name, part)


def test_health_goes_from_not_serving_to_serving(server, policy):
    with client(server) as c:
        assert c.health() == "NOT_SERVING"
        assert c.health("") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as e:
            c.get_manifest()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert server.publish(policy) is True
        assert c.health() == "SERVING"
        assert c.health("") == "SERVING"


def test_round_trip_is_bitwise_exact(server, policy, tensors):
    server.publish(policy)
    with client(server) as c:
        fetched = c.fetch()
    assert fetched.version == 1
    assert fetched.manifest == policy.manifest
    assert_bitwise_equal(fetched.tensors, tensors)
    n_chunks = sum(chunk_count(t.nbytes, CHUNK) for t in policy.manifest.tensors)
    assert fetched.stats.chunks == n_chunks > len(tensors)
    assert fetched.stats.refetched_chunks == fetched.stats.resumed_streams == 0


def test_fetch_by_name_and_by_tp_shard(server, policy, tensors):
    server.publish(policy)
    names = ["model.layers.1.mlp.experts.1.down_proj.weight", "lm_head.weight", "model.norm.weight"]
    with client(server) as c:
        part = c.fetch(1, names=names)
        assert sorted(part.tensors) == sorted(names)
        assert_bitwise_equal(part.tensors, {n: tensors[n] for n in names})
        plan = tp.TPPlan()
        for rank in range(2):
            shard = c.fetch(1, tp_rank=rank, tp_size=2)
            for name, q in tensors.items():
                cut = plan.cut(name, fmt=q.format, kwargs=q.kwargs, shape=q.value.shape, tp_rank=rank, tp_size=2)
                want = tp.shard_quantized(q.value, fmt=q.format, kwargs=q.kwargs, cut=cut)
                got = shard.tensors[name]
                assert got.shape == want.shape
                for p, t in want.parts().items():
                    assert torch.equal(got.parts()[p].view(torch.uint8), t.view(torch.uint8)), (name, p, rank)
        # lm_head is fp8 128x128 with 512 rows: 8 ranks would cut 64-row pieces. The server refuses too.
        with pytest.raises(ValueError, match="lm_head.weight.*not a whole number of 128-row"):
            c.fetch(1, tp_rank=0, tp_size=8)
        raw = c._fetch(policy_pb2.FetchTensorsRequest(version=1, tp_rank=0, tp_size=8), timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            list(raw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lm_head.weight" in e.value.details()


def test_several_streams_and_kept_buffers_fetch_the_same_bytes(server, policy, tensors):
    server.publish(policy)
    buffers = ReceiveBuffers()
    with client(server, streams=3) as c:
        fetched = c.fetch(buffers=buffers)
        assert fetched.stats.streams == 3  # one stream per group, nothing resumed
        assert_bitwise_equal(fetched.tensors, tensors)
        assert server.stats()["chunks_sent"] == fetched.stats.chunks  # every chunk sent once
        name = "model.layers.0.mlp.experts.1.gate_up_proj.weight"
        before = fetched.tensors[name].parts()["codes"].data_ptr()
        fetched.tensors[name].parts()["codes"].zero_()  # the next fetch rewrites the same memory
        again = c.fetch(buffers=buffers)
        assert again.tensors[name].parts()["codes"].data_ptr() == before and buffers.allocations == 1
        assert_bitwise_equal(again.tensors, tensors)
        part = c.fetch(names=[name, "model.norm.weight"], buffers=buffers)  # another set: a new slab
        assert buffers.allocations == 2 and sorted(part.tensors) == sorted([name, "model.norm.weight"])
    # A corrupt chunk in one of the streams is fetched again by that stream alone.
    index = first_chunk_indices(policy.manifest)["lm_head.weight"] + 1
    server.corrupt_chunk(version=1, chunk_index=index)
    with client(server, streams=4) as c:
        fetched = c.fetch()
    assert fetched.stats.refetched_chunks == 1 and fetched.stats.streams == 5
    assert_bitwise_equal(fetched.tensors, tensors)
    # One stream that cannot succeed ends the fetch with its error (the others are cancelled).
    server.corrupt_chunk(version=1, chunk_index=index, times=100)
    with client(server, streams=4, max_refetch_per_chunk=1) as c, pytest.raises(ChecksumMismatch):
        c.fetch()


def test_a_cancelled_fetch_ends_at_once(server, policy):
    server.publish(policy)
    cancel = FetchCancel()
    cancel.cancel()
    with client(server, streams=2) as c, pytest.raises(FetchCancelled):
        c.fetch(cancel=cancel)
    # Cancelled mid-stream (as the worker does from its loop when a newer version appears).
    cancel = FetchCancel()
    with client(server) as c:
        manifest = c.get_manifest(1)
        accepted = []
        real = c._accept

        def accept_then_cancel(chunk, *a):
            accepted.append(chunk.chunk_index)
            threading.Thread(target=cancel.cancel).start()
            return real(chunk, *a)

        c._accept = accept_then_cancel
        with pytest.raises(FetchCancelled):
            c.fetch_bytes(manifest, cancel=cancel)
        assert 0 < len(accepted) < sum(chunk_count(t.nbytes, CHUNK) for t in manifest.tensors)


def test_corrupted_chunk_is_detected_and_fetched_again(server, policy, tensors):
    server.publish(policy)
    first = first_chunk_indices(policy.manifest)
    index = first["model.layers.0.mlp.experts.1.gate_up_proj.weight"] + 2
    server.corrupt_chunk(version=1, chunk_index=index)
    with client(server) as c:
        fetched = c.fetch()
    assert fetched.stats.refetched_chunks == 1 and fetched.stats.streams == 2
    assert_bitwise_equal(fetched.tensors, tensors)
    # A chunk that stays corrupt is refused after a bounded number of attempts.
    server.corrupt_chunk(version=1, chunk_index=index, times=100)
    with client(server, max_refetch_per_chunk=2) as c, pytest.raises(ChecksumMismatch, match=f"chunk {index}"):
        c.fetch()


def test_corrupted_shard_chunk_is_fetched_again(server, policy, tensors):
    server.publish(policy)
    index = first_chunk_indices(policy.manifest)["model.layers.1.mlp.experts.0.down_proj.weight"]
    server.corrupt_chunk(version=1, chunk_index=index, tp_rank=1, tp_size=2)
    with client(server) as c:
        fetched = c.fetch(tp_rank=1, tp_size=2)
    assert fetched.stats.refetched_chunks == 1


def test_dropped_stream_resumes_from_the_next_chunk(server, policy, tensors):
    server.publish(policy)
    server.drop_stream_after(7)
    with client(server) as c:
        fetched = c.fetch()
    assert fetched.stats.resumed_streams == 1 and fetched.stats.streams == 2
    assert_bitwise_equal(fetched.tensors, tensors)
    # No chunk was sent twice: the second stream started where the first one stopped.
    assert server.stats()["chunks_sent"] == fetched.stats.chunks
    # Drops on every stream: the client gives up after max_attempts restarts.
    for _ in range(5):
        server.drop_stream_after(1)
    with client(server, max_attempts=3) as c, pytest.raises(grpc.RpcError) as e:
        c.fetch()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


class DroppingProxy:
    """A TCP proxy on 127.0.0.1 that cuts its first connection after `drop_after` bytes from the server
    (a real dropped stream: the client sees the connection die mid-FetchTensors)."""

    def __init__(self, upstream_port: int, drop_after: int):
        self.upstream_port, self.drop_after = upstream_port, drop_after
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        self.dropped = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                down, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=5)
            limit = self.drop_after if self.connections == 0 else None
            self.connections += 1
            for src, dst, lim in ((down, up, None), (up, down, limit)):
                t = threading.Thread(target=self._pump, args=(src, dst, lim, (down, up)), daemon=True)
                t.start()
                self._threads.append(t)

    def _pump(self, src, dst, limit, pair) -> None:
        sent = 0
        src.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    data = src.recv(65536)
                except TimeoutError:
                    continue
                if not data:
                    break
                if limit is not None and sent + len(data) > limit:
                    self.dropped.set()
                    break
                dst.sendall(data)
                sent += len(data)
        except OSError:
            pass
        for s in pair:  # either direction ending ends the connection
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        for t in self._threads:
            t.join(5)


def test_stream_cut_by_the_network_resumes(server, policy, tensors):
    server.publish(policy)
    proxy = DroppingProxy(server.port, drop_after=policy.manifest.total_bytes // 3)
    try:
        with PolicyClient(
            PolicyClientConfig(
                address=f"127.0.0.1:{proxy.port}", call_timeout_s=10, fetch_timeout_s=30, retry_backoff_s=0.0
            )
        ) as c:
            fetched = c.fetch()
        assert proxy.dropped.is_set() and proxy.connections >= 2
        assert fetched.stats.resumed_streams >= 1
        assert_bitwise_equal(fetched.tensors, tensors)
        n_chunks = sum(chunk_count(t.nbytes, CHUNK) for t in policy.manifest.tensors)
        assert fetched.stats.chunks == n_chunks  # every chunk accepted once, none skipped
        assert server.stats()["chunks_sent"] < 2 * n_chunks  # resumed, not restarted from scratch
    finally:
        proxy.close()


def test_wrong_fingerprint_is_refused_with_a_clear_error(server, policy):
    server.publish(policy)
    expected = make_contract(mode="shard", trainer_tp_size=2).fingerprint()
    with client(server, expected_fingerprint=expected) as c, pytest.raises(FingerprintMismatch) as e:
        c.fetch()
    assert expected in str(e.value) and policy.manifest.contract_fingerprint in str(e.value)


def test_shard_scale_mode_refuses_another_tp_degree(server, tensors):
    pinned = make_contract(mode="shard", trainer_tp_size=2)
    server.publish(M.build_manifest(version=1, parent_version=None, contract=pinned, tensors=tensors))
    with client(server, expected_fingerprint=pinned.fingerprint()) as c:
        assert len(c.fetch(tp_rank=0, tp_size=2).tensors) == len(tensors)
        with pytest.raises(ValueError, match="pins the trainer's partition tp_size=2; this rollout has tp_size=1"):
            c.fetch()
        with pytest.raises(grpc.RpcError) as e:  # the server refuses on its own as well
            list(c._fetch(policy_pb2.FetchTensorsRequest(version=1, tp_size=1), timeout=10))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_malformed_and_oversized_requests_are_rejected_without_crashing(server, policy, tensors):
    server.publish(policy)
    channel = grpc.insecure_channel(server.address)
    try:

        def raw(method: str, payload: bytes, stream: bool = False) -> grpc.RpcError:
            path = f"/tandem.v1.PolicyService/{method}"
            call = (channel.unary_stream if stream else channel.unary_unary)(path)
            with pytest.raises(grpc.RpcError) as e:
                result = call(payload, timeout=10)
                if stream:
                    list(result)
            return e.value

        garbage = b"\x0a\xff\xff\xff\x0f"  # field 1, length-delimited, length far past the end
        for method, stream in (("GetManifest", False), ("FetchTensors", True), ("WatchVersions", True)):
            err = raw(method, garbage, stream)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed" in err.details(), method
        names = policy_pb2.FetchTensorsRequest(version=1, tensor_names=["x" * 500] * 200).SerializeToString()
        err = raw("FetchTensors", names, stream=True)  # ~100 KiB: over the handler's 64 KiB limit
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "exceeds the limit" in err.details()
        huge = policy_pb2.FetchTensorsRequest(version=1, tensor_names=["y" * 500] * 1000).SerializeToString()
        err = raw("FetchTensors", huge, stream=True)  # ~500 KiB: over the 256 KiB transport limit
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        bad = [
            (policy_pb2.FetchTensorsRequest(version=1, tp_rank=2, tp_size=2), grpc.StatusCode.INVALID_ARGUMENT),
            (policy_pb2.FetchTensorsRequest(version=1, tp_size=100_000), grpc.StatusCode.INVALID_ARGUMENT),
            (policy_pb2.FetchTensorsRequest(version=0), grpc.StatusCode.INVALID_ARGUMENT),
            (policy_pb2.FetchTensorsRequest(version=1, tensor_names=["x" * 600]), grpc.StatusCode.INVALID_ARGUMENT),
            (policy_pb2.FetchTensorsRequest(version=77), grpc.StatusCode.NOT_FOUND),
            (policy_pb2.FetchTensorsRequest(version=1, tensor_names=["nope"]), grpc.StatusCode.NOT_FOUND),
        ]
        for req, code in bad:
            assert raw("FetchTensors", req.SerializeToString(), stream=True).code() == code, req
        assert (
            raw("GetManifest", policy_pb2.GetManifestRequest(version=3).SerializeToString()).code()
            == grpc.StatusCode.NOT_FOUND
        )
        assert server.stats()["rejected_requests"] == 3 + 1 + 6 + 1
    finally:
        channel.close()
    with client(server) as c:  # still serving
        assert c.health() == "SERVING"
        assert_bitwise_equal(c.fetch().tensors, tensors)


def test_versions_are_immutable_and_only_the_last_k_are_held(server, policy, tensors):
    assert server.publish(policy) is True
    assert server.publish(policy) is False  # same content again: a no-op
    other = M.build_manifest(
        version=1, parent_version=None, contract=make_contract(), tensors=with_one_change(tensors, 1), chunk_bytes=CHUNK
    )
    with pytest.raises(ValueError, match="version 1 was already published with different content"):
        server.publish(other)
    v2 = M.build_manifest(version=2, parent_version=1, contract=make_contract(), tensors=tensors)
    v3 = M.build_manifest(version=3, parent_version=2, contract=make_contract(), tensors=tensors)
    server.publish(v3)
    with pytest.raises(ValueError, match="version 2 is not newer than the latest published version 3"):
        server.publish(v2)
    v4 = M.build_manifest(version=4, parent_version=3, contract=make_contract(), tensors=with_one_change(tensors, 2))
    server.publish(v4)
    assert server.versions() == [3, 4]  # keep_versions=2
    with pytest.raises(ValueError, match="version 1 was already published"):
        server.publish(other)  # still refused after eviction
    with client(server) as c:
        assert c.get_manifest().version == 4
        assert c.get_manifest(3).version == 3
        with pytest.raises(grpc.RpcError) as e:
            c.get_manifest(1)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


def test_watch_versions_announces_held_and_new_versions(server, tensors):
    server.publish(M.build_manifest(version=1, parent_version=None, contract=make_contract(), tensors=tensors))
    got = []
    with client(server) as c:

        def watch():
            for a in c.watch_versions(0, timeout_s=10):
                got.append(a)
                if a.version == 2:
                    return

        t = threading.Thread(target=watch)
        t.start()
        server.publish(M.build_manifest(version=2, parent_version=1, contract=make_contract(), tensors=tensors))
        t.join(15)
        assert not t.is_alive()
        assert [a.version for a in got] == [1, 2]
        assert got[1].parent_version == 1 and got[1].contract_fingerprint == make_contract().fingerprint()
        assert got[1].tensor_count == len(tensors)
        assert [a.version for a in c.watch_versions(1, timeout_s=0.5)] == [2]  # ends at its deadline


def _self_signed(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return str(key), str(cert)


def test_tls_and_mtls_round_trip(tmp_path, policy, tensors):
    key, cert = _self_signed(tmp_path)
    cfg = PolicyServerConfig(tls=ServerTLS(cert=cert, key=key, client_ca=cert))
    with PolicyServer(cfg) as s:
        s.publish(policy)
        with client(s, tls=ClientTLS(ca=cert, cert=cert, key=key)) as c:
            assert_bitwise_equal(c.fetch().tensors, tensors)
        with client(s, tls=ClientTLS(ca=cert), call_timeout_s=1) as c:  # no client certificate: refused
            with pytest.raises(TLSHandshakeError, match="requires a client certificate"):
                c.get_manifest()


def test_tandem_inspect_prints_a_served_manifest(server, policy, capsys):
    from tandem.cli import main

    assert main(["inspect", server.address, "--timeout", "1"]) == 1  # nothing published yet
    assert "UNAVAILABLE: no policy has been published yet" in capsys.readouterr().err
    server.publish(policy)
    assert main(["inspect", server.address, "--tensors", "-1"]) == 0
    out = capsys.readouterr().out
    assert f"contract fingerprint  {policy.manifest.contract_fingerprint}" in out
    assert "policy version 1 (parent none)" in out
    for t in policy.manifest.tensors:
        assert t.name in out


def test_tandem_inspect_names_a_closed_port_and_a_failed_tls_handshake(tmp_path, free_port, policy, capsys):
    from tandem.cli import main

    # A closed port: "connection refused", not DEADLINE_EXCEEDED after the whole --timeout.
    assert main(["inspect", f"127.0.0.1:{free_port()}", "--timeout", "30"]) == 2
    err = capsys.readouterr().err.strip()
    assert "connection refused" in err and "DEADLINE" not in err and len(err.splitlines()) == 1
    key, cert = _self_signed(tmp_path)
    (tmp_path / "other").mkdir()
    _, other_cert = _self_signed(tmp_path / "other")  # a CA that did not sign the server's certificate
    cfg = PolicyServerConfig(tls=ServerTLS(cert=cert, key=key))
    with PolicyServer(cfg) as s:
        s.publish(policy)
        assert main(["inspect", s.address, "--tls-ca", cert, "--tensors", "0"]) == 0  # the right CA
        capsys.readouterr()
        # The wrong CA: a TLS handshake failure, named with its likely causes.
        assert main(["inspect", s.address, "--tls-ca", other_cert, "--timeout", "30"]) == 2
        err = capsys.readouterr().err
        assert "TLS handshake failed" in err and "wrong CA" in err and "DEADLINE" not in err
        # No CA at all against a TLS server: says it may be one.
        assert main(["inspect", s.address, "--timeout", "30"]) == 2
        assert "pass --tls-ca" in capsys.readouterr().err


def test_server_reflection_lists_the_services(policy):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    def services(server) -> set[str]:
        with grpc.insecure_channel(server.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            try:
                (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=10))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNIMPLEMENTED
                return set()
        return {s.name for s in resp.list_services_response.service}

    with PolicyServer(PolicyServerConfig(reflection=True)) as s:
        got = services(s)
        assert {"tandem.v1.PolicyService", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= got
        # grpcurl resolves the service's methods from its file descriptor
        with grpc.insecure_channel(s.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(file_containing_symbol="tandem.v1.PolicyService")
            (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=10))
            assert resp.file_descriptor_response.file_descriptor_proto
    with PolicyServer(PolicyServerConfig()) as s:  # off by default (and in the Kubernetes overlays)
        assert services(s) == set()


def test_worker_log_line_of_a_failed_fetch_has_code_and_details(free_port):
    from rollout.worker import why

    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as ch:
        call = ch.unary_unary("/tandem.v1.PolicyService/GetManifest")
        with pytest.raises(grpc.RpcError) as e:
            call(b"", timeout=5)
    line = why(e.value)
    assert line.startswith("gRPC UNAVAILABLE: ") and len(line) > len("gRPC UNAVAILABLE: ") + 5
    assert "_InactiveRpcError" not in line and "\n" not in line
    assert why(ValueError("bad checksum\nmore")) == "ValueError: bad checksum"
