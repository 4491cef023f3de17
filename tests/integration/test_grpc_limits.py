"""Defect 8 (issue 13): the policy server bounds what a hostile or broken peer can hold: streams per
connection, RPCs in all, name lists no longer than the version's tensor list; the health port binds
where configured. (A server-side deadline on FetchTensors is not done: see docs/reliability.md.)"""

from __future__ import annotations

import time

import grpc
import pytest

from broker.health import HealthServer
from broker.policy_server import PolicyServer, PolicyServerConfig
from policy import manifest as mf
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from tandem.v1 import policy_pb2

pytestmark = pytest.mark.integration

FETCH = "/tandem.v1.PolicyService/FetchTensors"


@pytest.fixture(scope="module")
def packed():
    cfg = ModelConfig.preset("tiny", n_layers=1, dim=512, n_experts=2, top_k=1)  # ~3.8 MB: over the flow window
    recipe = Recipe.load("bf16")
    tensors = mf.quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), recipe.plan(cfg))
    contract = mf.contract_from_recipe(model_config=cfg, recipe=recipe)
    return mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors, chunk_bytes=16384)


def _stalled_streams(address: str, n: int, names: list[str] | None = None) -> tuple[grpc.Channel, list]:
    """n FetchTensors calls on one connection whose reader never reads."""
    ch = grpc.insecure_channel(address)
    fetch = ch.unary_stream(FETCH)
    req = policy_pb2.FetchTensorsRequest(version=1, tensor_names=names or []).SerializeToString()
    return ch, [fetch(req, timeout=60) for _ in range(n)]


def _wait(cond, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_streams_per_connection_are_capped(packed):
    with PolicyServer(PolicyServerConfig(max_streams_per_connection=3)) as server:
        server.publish(packed)
        ch, calls = _stalled_streams(server.address, 8)
        try:
            _wait(lambda: server.stats()["fetch_streams"] >= 3)
            time.sleep(0.5)
            assert server.stats()["fetch_streams"] == 3  # the other 5 wait for a stream slot
        finally:
            for c in calls:
                c.cancel()
            ch.close()


def test_concurrent_rpcs_are_capped_in_all(packed):
    with PolicyServer(PolicyServerConfig(max_concurrent_rpcs=2)) as server:
        server.publish(packed)
        ch = grpc.insecure_channel(server.address)
        watch = ch.unary_stream("/tandem.v1.PolicyService/WatchVersions")
        req = policy_pb2.WatchVersionsRequest(after_version=1).SerializeToString()  # waits for v2: holds a slot
        held = [watch(req, timeout=60) for _ in range(2)]
        try:
            time.sleep(1.0)
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
