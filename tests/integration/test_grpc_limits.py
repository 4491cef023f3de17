"""The policy server bounds what a hostile or broken peer can hold: streams per
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
from broker.signing import RUN_TOKEN_HEADER, load_signer, write_secret_file
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from tandem.cli import main
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

FETCH = "/tandem.v1.PolicyService/FetchTensors"
TOKEN = "ab" * 32  # a run token (broker.signing.policy_token of some run secret)
AUTH = ((RUN_TOKEN_HEADER, TOKEN),)


@pytest.fixture(scope="module")
def packed():
    # ~7.6 MB: more than gRPC buffers for a stream that is not read, so a stalled handler blocks
    cfg = ModelConfig.preset("tiny", n_layers=1, dim=1024, n_experts=2, top_k=1)
    recipe = Recipe.load("bf16")
    tensors = quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), recipe.plan(cfg))
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    return mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors, chunk_bytes=16384)


def _stalled_streams(address: str, n: int, names: list[str] | None = None, metadata=None) -> tuple[grpc.Channel, list]:
    """n FetchTensors calls on one connection (its own) whose reader never reads."""
    # No BDP probing: the client's receive window stays at its initial size instead of growing with
    # the measured bandwidth (under load it grew to hold the whole policy, and the stream never stalled).
    ch = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0), ("grpc.use_local_subchannel_pool", 1)])
    # One call first: the server's SETTINGS (its stream cap) arrive before the streams are opened, else
    # streams opened past the cap before the client knew it are refused (REFUSED_STREAM) at once.
    ch.unary_unary("/tandem.v1.PolicyService/GetManifest")(b"", timeout=30, wait_for_ready=True)
    fetch = ch.unary_stream(FETCH)
    req = policy_pb2.FetchTensorsRequest(version=1, tensor_names=names or []).SerializeToString()
    return ch, [fetch(req, timeout=60, metadata=metadata) for _ in range(n)]


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
    blocks until its reader reads: the policy is more than gRPC buffers), and all 8 complete. A stream
    the client opens as another ends can reach the server before that one is closed there: the server
    refuses it (RST_STREAM REFUSED_STREAM, before any handler), and the reader asks again, as the
    policy client does (it resumes on UNAVAILABLE)."""
    n_chunks = sum(len(t.chunk_xxh3) for t in packed.manifest.tensors)
    with PolicyServer(PolicyServerConfig(max_streams_per_connection=3)) as server:
        server.publish(packed)
        ch, calls = _stalled_streams(server.address, 8)
        try:
            _wait(lambda: server.stats()["active_fetches"] == 3)
            got, errors = [0] * len(calls), []

            def drain(i: int) -> None:
                for _ in range(8):
                    try:
                        for _ in calls[i]:
                            got[i] += 1
                        return
                    except grpc.RpcError as e:
                        errors.append((i, e.code(), e.details()))
                        if got[i] or "error code 7" not in (e.details() or ""):
                            return
                    req = policy_pb2.FetchTensorsRequest(version=1).SerializeToString()
                    calls[i] = ch.unary_stream(FETCH)(req, timeout=60)

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
            assert got == [n_chunks] * len(calls) and server.stats()["fetch_streams"] == 8, (errors, server.stats())
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
    """A client that takes 10 ms per chunk: a whole fetch (470 chunks) outlasts a 1 s server deadline.
    Its channel keeps HTTP/2's flow-control window at 64 KiB (no BDP probing): with a window grown to
    the policy's size the server could hand every chunk to the transport within the deadline, however
    slowly the client reads them, and whether it did would depend on the machine's load."""

    @staticmethod
    def _accept(*args) -> bool:
        time.sleep(0.01)
        return PolicyClient._accept(*args)

    def _make_channel(self, extra_options=()):
        return super()._make_channel(
            [*extra_options, ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 65536)]
        )


def test_a_slow_reader_cut_by_the_deadline_resumes_and_completes(packed):
    with PolicyServer(PolicyServerConfig(fetch_deadline_s=1.0)) as server:
        server.publish(packed)
        with _SlowReader(PolicyClientConfig(address=server.address, max_attempts=64)) as client:
            fetched = client.fetch(1)  # every byte verified against the manifest
        assert fetched.stats.resumed_streams >= 1
        assert server.stats()["fetch_deadline_exceeded"] >= 1


def test_concurrent_rpcs_are_capped_in_all(packed):
    """Authenticated workers too: no stream beyond max_concurrent_rpcs."""
    cfg = PolicyServerConfig(max_concurrent_rpcs=2, max_unauthenticated_streams=1, run_token=TOKEN)
    with PolicyServer(cfg) as server:
        server.publish(packed)
        ch = grpc.insecure_channel(server.address)
        watch = ch.unary_stream("/tandem.v1.PolicyService/WatchVersions")
        req = policy_pb2.WatchVersionsRequest(after_version=1).SerializeToString()  # waits for v2: holds a slot
        held = [watch(req, timeout=60, metadata=AUTH) for _ in range(2)]
        try:
            _wait(lambda: server.stats()["active_watches"] == 2)
            with pytest.raises(grpc.RpcError) as e:
                next(iter(watch(req, timeout=10, metadata=AUTH)))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "2 streams are being served" in e.value.details() and server.stats()["refused_limit"] == 1
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
    from tandem.env_config import env_overrides

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


def test_a_stream_staller_cannot_starve_a_worker(packed):
    """32 connections x 16 FetchTensors streams that are never read, from an unauthenticated peer,
    while a worker (the run token) fetches: the staller holds at most its share of streams (the rest
    are refused, counted), the worker's fetch goes through at once, and every stalled stream is ended
    stall_s after its last chunk was taken (counted), its capacity given back."""
    cfg = PolicyServerConfig(
        run_token=TOKEN,
        serve_unauthenticated=True,
        stall_s=2.0,
        max_unauthenticated_streams=64,
        max_streams_per_peer=64,
    )
    with PolicyServer(cfg) as server:
        server.publish(packed)
        stallers = [_stalled_streams(server.address, 16) for _ in range(32)]
        try:
            _wait(lambda: server.stats()["unauthenticated_streams"] == 64)
            t0 = time.monotonic()
            with PolicyClient(PolicyClientConfig(address=server.address, run_token=TOKEN, fetch_timeout_s=60)) as c:
                fetched = c.fetch(1)  # every byte verified
            took = time.monotonic() - t0
            assert fetched.stats.resumed_streams == 0  # not one RESOURCE_EXHAUSTED on the way
            s = server.stats()
            assert s["unauthenticated_streams"] <= 64 and s["refused_limit"] > 0, s
            _wait(lambda: server.stats()["fetch_stalled"] + server.stats()["refused_limit"] == 32 * 16, 120)
            _wait(lambda: server.stats()["streams"] == 0)
            s = server.stats()
            assert s["fetch_stalled"] >= 64 and s["unauthenticated_streams"] == 0, s
            print(f"worker fetch {took:.2f} s beside 512 stalled streams; {s['fetch_stalled']} ended, "
                  f"{s['refused_limit']} refused")  # fmt: skip
        finally:
            for ch, calls in stallers:
                for call in calls:
                    call.cancel()
                ch.close()


def test_without_the_run_token_nothing_is_served(packed, tmp_path, capsys):
    """A server with a run token that serves workers only: no token or a wrong one gets UNAUTHENTICATED
    on every call (counted), the token gets the policy; `tandem inspect --run-secret-file` sends it."""
    secret = write_secret_file(tmp_path / "run.secret")
    token = load_signer(str(secret)).policy_token()
    with PolicyServer(PolicyServerConfig(run_token=token, serve_unauthenticated=False)) as server:
        server.publish(packed)
        for wrong in ("", "cd" * 32):
            with PolicyClient(PolicyClientConfig(address=server.address, run_token=wrong)) as c:
                with pytest.raises(grpc.RpcError) as e:
                    c.get_manifest()
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value
                assert "authenticated workers only" in e.value.details()
        with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as e:
            next(
                iter(ch.unary_stream(FETCH)(policy_pb2.FetchTensorsRequest(version=1).SerializeToString(), timeout=30))
            )
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.stats()["refused_unauthenticated"] == 3 and server.stats()["chunks_sent"] == 0
        with PolicyClient(PolicyClientConfig(address=server.address, run_token=token)) as c:
            assert c.fetch(1).stats.chunks == sum(len(t.chunk_xxh3) for t in packed.manifest.tensors)
        assert main(["inspect", server.address, "--tensors", "0"]) != 0
        assert "UNAUTHENTICATED" in capsys.readouterr().err
        assert main(["inspect", server.address, "--tensors", "0", "--run-secret-file", str(secret)]) == 0
