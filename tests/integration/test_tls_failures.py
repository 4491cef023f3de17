"""A rollout worker whose TLS settings do not fit the trainer's says so once, in one line naming the
side that refused and the setting at fault, instead of DEADLINE_EXCEEDED on every retry; and a
`tandem` process keeps gRPC's own line per failed handshake out of its log."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from drive_worker import load  # tests/drive_worker.py
from tls_certs import make_certs

from broker.policy_server import PolicyServer, PolicyServerConfig
from broker.registry import PolicyPointer
from broker.tls import ServerTLS
from policy import manifest as mf
from policy.contract import contract_from_recipe
from policy.formats.params import quantize_params
from policy.model import Transformer
from tandem import config as run_config
from tandem.services import make_worker, task_and_model

pytestmark = pytest.mark.integration

MODEL = "model.overrides={n_layers: 2, dim: 64, n_experts: 2, expert_ffn_dim: 64, shared_expert_ffn_dim: 64}"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> tuple[Path, Path]:
    """The run's CA with server and client certificates, and another CA with a client certificate."""
    run, other = tmp_path_factory.mktemp("run-ca"), tmp_path_factory.mktemp("other-ca")
    make_certs(run, ("server", "client"))
    make_certs(other, ("client",))
    return run, other


def _mtls_server(run: Path) -> PolicyServer:
    tls = ServerTLS(cert=str(run / "server.crt"), key=str(run / "server.key"), client_ca=str(run / "ca.crt"))
    return PolicyServer(PolicyServerConfig(tls=tls))


def _policy(cfg) -> mf.PackedPolicy:
    _, model_config, recipe = task_and_model(cfg)
    tensors = quantize_params(dict(Transformer(model_config, seed=0).named_parameters()), recipe.plan(model_config))
    contract = contract_from_recipe(model_config=model_config, recipe=recipe)
    return mf.build_manifest(version=1, parent_version=None, contract=contract, tensors=tensors)


def _cases(run: Path, other: Path) -> dict[str, tuple[dict, list[str]]]:
    """name -> (rollout.tls, what its one line must say)."""
    good = {"ca": str(run / "ca.crt"), "cert": str(run / "client.crt"), "key": str(run / "client.key")}
    return {
        "wrong CA": ({**good, "ca": str(other / "ca.crt")}, ["worker's side", str(other / "ca.crt")]),
        "no client certificate": ({"ca": good["ca"]}, ["trainer's side", "requires a client certificate"]),
        "a client certificate of another CA": (
            {**good, "cert": str(other / "client.crt"), "key": str(other / "client.key")},
            ["trainer's side", str(other / "client.crt")],
        ),
        "plaintext": ({}, ["is a TLS server", "rollout.tls.ca"]),
    }


@pytest.mark.parametrize(
    "case", ["wrong CA", "no client certificate", "a client certificate of another CA", "plaintext"]
)
async def test_a_worker_with_wrong_tls_settings_says_so_once(certs, case):
    run, other = certs
    tls, expected = _cases(run, other)[case]
    cfg = run_config.load(None, [MODEL] + [f"rollout.tls.{k}={v}" for k, v in tls.items()])
    worker = make_worker(cfg, "w0")
    logs: list[str] = []
    worker.log = logs.append
    with _mtls_server(run) as server:
        server.publish(_policy(cfg))
        pointer = PolicyPointer(version=1, address=server.address, contract_fingerprint=worker.fingerprint)
        worker.swap.retry_s = 0.0  # every attempt fetches
        for _ in range(3):
            assert not await load(worker, pointer)
        failures = worker.metrics.endpoint.registry.get_sample_value("tandem_rollout_policy_fetch_failures_total")
        assert failures == 3  # every attempt counted
    assert len(logs) == 1, logs  # ... and logged once
    line = logs[0]
    assert "TLS" in line and "DEADLINE" not in line and all(e in line for e in expected), line


def test_failed_handshakes_stay_out_of_a_tandem_process_log(certs):
    """`tandem inspect` with the wrong CA, against a server that requires client certificates: one
    line, and none of gRPC's per-handshake lines (it retries the handshake until --timeout)."""
    run, other = certs
    with _mtls_server(run) as server:
        r = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "inspect", server.address, "--timeout", "3",
             "--tls-ca", str(other / "ca.crt"), "--tls-cert", str(run / "client.crt"), "--tls-key", str(run / "client.key")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert r.returncode == 2, r.stderr
    assert "Handshake failed" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
