"""Defect 8 (issue 13): the policy server bounds what a hostile or broken peer can hold: streams per
connection, RPCs in all, the time (and so the memory) of a FetchTensors stream whose reader stopped
reading, name lists no longer than the version's tensor list; the health port binds where configured.

No fixed sleeps: each test waits on the server's own gauges (`active_fetches`, `active_watches`)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest

from broker.health import HealthServer
from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.policy_server import PolicyServer, PolicyServerConfig
from policy import manifest as mf
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

FETCH = "/tandem.v1.PolicyService/FetchTensors"


@pytest.fixture(scope="module")
def packed():
    # ~7.6 MB: more than gRPC buffers for a stream that is not read, so a stalled handler blocks
    cfg = ModelConfig.preset("tiny", n_layers=1, dim=1024, n_experts=2, top_k=1)
    recipe = Recipe.load("bf16")
    tensors = mf.quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), recipe.plan(cfg))
    contract = mf.contract_from_recipe(model_config=cfg, recipe=recipe)
    return mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors, chunk_bytes=16384)


def _stalled_streams(address: str, n: int, names: list[str] | None = None) -> tuple[grpc.Channel, list]:
    """n FetchTensors calls on one connection whose reader never reads."""
    # No BDP probing: the client's receive window stays at its initial size instead of growing with
    # the measured bandwidth (under load it grew to hold the whole policy, and the stream never stalled).
    ch = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    # One call first: the server's SETTINGS (its stream cap) arrive before the streams are opened, else
    # streams opened past the cap before the client knew it are refused (REFUSED_STREAM) at once.
    ch.unary_unary("/tandem.v1.PolicyService/GetManifest")(b"", timeout=30, wait_for_ready=True)
    fetch = ch.unary_stream(FETCH)
    req = policy_pb2.FetchTensorsRequest(version=1, tensor_names=names or []).SerializeToString()
    return ch, [fetch(req, timeout=60) for _ in range(n)]


def _wait(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def _established_server_sockets(port: int) -> int:
    """TCP connections in state ESTABLISHED whose local port is `port` (the server's side), from /proc."""
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if int(r.split()[1].split(":")[1], 16) == port and r.split()[3] == "01")


def test_streams_per_connection_are_capped(packed):
    """8 streams on one connection, 3 slots: while they drain, never more than 3 handlers run (each
    blocks until its reader reads: the policy is more than gRPC buffers), and all 8 complete."""
    n_chunks = sum(len(t.chunk_xxh3) for t in packed.manifest.tensors)
    with PolicyServer(PolicyServerConfig(max_streams_per_connection=3)) as server:
        server.publish(packed)
        ch, calls = _stalled_streams(server.address, 8)
        try:
            _wait(lambda: server.stats()["active_fetches"] == 3)
            got = [0] * len(calls)

            def drain(i: int) -> None:
                for _ in calls[i]:
                    got[i] += 1

            readers = [threading.Thread(target=drain, args=(i,)) for i in range(len(calls))]
            peak = 0
            for t in readers:
                t.start()
            while any(t.is_alive() for t in readers):
                peak = max(peak, server.stats()["active_fetches"])
                time.sleep(0.005)
            for t in readers:
                t.join()
            assert peak == 3, peak  # the other 5 waited for a slot
            assert got == [n_chunks] * len(calls) and server.stats()["fetch_streams"] == 8
        finally:
            for c in calls:
                c.cancel()
            ch.close()


def test_fetch_deadline_ends_a_stalled_reader(packed):
    """A reader that stops reading is ended by the server after fetch_deadline_s (counted); its
    connection, and so what the transport buffered for it, is closed by the server too."""
    with PolicyServer(PolicyServerConfig(fetch_deadline_s=1.0)) as server:
        server.publish(packed)
        ch, (call,) = _stalled_streams(server.address, 1)
        try:
            it = iter(call)
            next(it)  # the stream runs; now stop reading
            _wait(lambda: server.stats()["fetch_deadline_exceeded"] == 1)
            _wait(lambda: server.stats()["active_fetches"] == 0)  # the handler ended
            _wait(lambda: _established_server_sockets(server.port) == 0)  # the connection is gone
            got = 1
            with pytest.raises(grpc.RpcError) as e:
                for _ in it:
                    got += 1
            assert e.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), e.value
            assert got < sum(len(t.chunk_xxh3) for t in packed.manifest.tensors)  # it never got the whole policy
        finally:
            call.cancel()
            ch.close()


class _SlowReader(PolicyClient):
    """A client that takes 10 ms per chunk: a whole fetch (470 chunks) outlasts a 1 s server deadline."""

    @staticmethod
    def _accept(*args) -> bool:
        time.sleep(0.01)
        return PolicyClient._accept(*args)


def test_a_slow_reader_cut_by_the_deadline_resumes_and_completes(packed):
    with PolicyServer(PolicyServerConfig(fetch_deadline_s=1.0)) as server:
        server.publish(packed)
        with _SlowReader(PolicyClientConfig(address=server.address, max_attempts=64)) as client:
            fetched = client.fetch(1)  # every byte verified against the manifest
        assert fetched.stats.resumed_streams >= 1
        assert server.stats()["fetch_deadline_exceeded"] >= 1


def test_concurrent_rpcs_are_capped_in_all(packed):
    with PolicyServer(PolicyServerConfig(max_concurrent_rpcs=2)) as server:
        server.publish(packed)
        ch = grpc.insecure_channel(server.address)
        watch = ch.unary_stream("/tandem.v1.PolicyService/WatchVersions")
        req = policy_pb2.WatchVersionsRequest(after_version=1).SerializeToString()  # waits for v2: holds a slot
        held = [watch(req, timeout=60) for _ in range(2)]
        try:
            _wait(lambda: server.stats()["active_watches"] == 2)
            with pytest.raises(grpc.RpcError) as e:
                next(iter(watch(req, timeout=10)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for c in held:
                c.cancel()
            ch.close()


def test_name_lists_longer_than_the_version_are_refused(packed):
    with PolicyServer(PolicyServerConfig()) as server:
        server.publish(packed)
        names = [t.name for t in packed.manifest.tensors]
        ch, (call,) = _stalled_streams(server.address, 1, names=names * 2)
        with pytest.raises(grpc.RpcError) as e:
            next(iter(call))
        ch.close()
        assert (
            e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tensor names for a version of" in e.value.details()
        )


def test_health_binds_where_configured():
    h = HealthServer(port=0, service="x")
    assert h.host == "127.0.0.1"
    assert HealthServer(port=8080, service="x").host == "127.0.0.1"  # a fixed port no longer means 0.0.0.0
    assert HealthServer(port=8080, service="x", host="10.1.2.3").host == "10.1.2.3"


def test_prometheus_binds_where_configured():
    """A fixed Prometheus port binds metrics_host (loopback by default), not 0.0.0.0; the
    Kubernetes env var sets it to the pod IP."""
    import socket
    import urllib.request

    from broker.metrics import MetricsEndpoint
    from tandem.config import env_overrides

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ep = MetricsEndpoint(port)
    try:
        assert ep._server.server_address == ("127.0.0.1", port)
        assert b"process_cpu_seconds_total" in urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10).read()
    finally:
        ep.close()
    assert env_overrides({"TANDEM_ROLLOUT_METRICS_HOST": "10.1.2.3"}) == ['rollout.metrics_host="10.1.2.3"']
