"""A worker fetching from a trainer that dies mid-fetch gives up quickly and re-reads
`policy:latest` (the restarted trainer listens elsewhere), instead of waiting for the dead address
for the whole fetch_timeout_s on every FetchTensors restart (which would take minutes, while the
restarted trainer's collect times out waiting for trajectories)."""

from __future__ import annotations

import time

import grpc
import pytest

from broker.policy_client import PolicyClient, PolicyClientConfig
from broker.policy_server import PolicyServer, PolicyServerConfig
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe

pytestmark = pytest.mark.integration


def test_fetch_fails_fast_when_the_server_died_after_the_manifest():
    cfg = ModelConfig.preset("tiny", n_layers=1, n_experts=2, top_k=1)
    recipe = Recipe.load("bf16")
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    tensors = quantize_params(dict(Transformer(cfg, seed=0).named_parameters()), recipe.plan(cfg))
    server = PolicyServer(PolicyServerConfig())
    server.start()
    server.publish(mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors))
    fetch_timeout_s = 120.0
    client_cfg = PolicyClientConfig(
        address=server.address, expected_fingerprint=contract.fingerprint(), fetch_timeout_s=fetch_timeout_s
    )
    with PolicyClient(client_cfg) as client:
        manifest = client.get_manifest(1)
        server.stop()  # the trainer dies between GetManifest and FetchTensors
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.fetch_bytes(manifest)
        elapsed = time.monotonic() - t0
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    # Bounded by the restarts' backoff (max_attempts * retry_backoff_s), not by fetch_timeout_s.
    assert elapsed < fetch_timeout_s / 4, elapsed
