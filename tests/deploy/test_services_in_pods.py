"""The services configured the way the Kubernetes manifests configure them, as real processes.

One trainer and one rollout worker (`tandem trainer`, `tandem rollout`), against the real
redis-server fixture, with everything a pod gets from its environment: the Redis URL from a
ConfigMap and the password apart (an ACL user with a password, created for the test), mTLS on the
policy gRPC, the trainer advertising an address other than the one it binds, and both services'
plaintext grpc.health.v1 endpoints, which must go NOT_SERVING -> SERVING when a policy is there.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from broker.health import ROLLOUT_HEALTH, TRAINER_HEALTH
from broker.keys import Keys
from broker.registry import PolicyRegistry
from broker.streams import connect, run_async
from tandem.env_config import redis_url_with

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _self_signed(tmp: Path) -> tuple[str, str]:
    """One self-signed certificate for localhost: the trainer's, the rollout's and the CA of both."""
    key, cert = tmp / "key.pem", tmp / "cert.pem"
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
            "subjectAltName=DNS:localhost",
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


def _acl_user(redis_url: str, user: str, password: str) -> None:
    async def main():
        r = connect(redis_url)
        try:
            await r.execute_command("ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all")
        finally:
            await r.aclose()

    run_async(main())


def _pointer(redis_url: str, run_id: str):
    async def main():
        r = connect(redis_url)
        try:
            return await PolicyRegistry(r, Keys(run_id=run_id)).latest()
        finally:
            await r.aclose()

    return run_async(main())


def _health(port: int, service: str) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _wait(cond, what: str, timeout_s: float, procs=(), logs=()):
    deadline = time.monotonic() + timeout_s
    while True:
        value = cond()
        if value:
            return value
        for p in procs:
            assert p.poll() is None, f"a process exited while waiting for {what}:\n" + "\n".join(
                Path(log).read_text()[-2000:] for log in logs
            )
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s waiting for {what}"
        time.sleep(0.1)


def _health_port(log: Path):
    m = re.search(r"health \(grpc\.health\.v1\) on 127\.0\.0\.1:(\d+)", log.read_text() if log.exists() else "")
    return int(m.group(1)) if m else None


def test_pod_configuration_health_advertise_mtls_and_redis_password(tmp_path, redis_url, run_id, free_port):
    key, cert = _self_signed(tmp_path)
    user, password = f"u{uuid.uuid4().hex[:8]}", "p@ss w/#:" + uuid.uuid4().hex[:6]  # needs URL quoting
    _acl_user(redis_url, user, password)
    grpc_port = free_port()
    cfg = {  # the run config of the ConfigMap: ports fixed, the address the Service would give
        "run_id": run_id,
        "loop": {"seed": 1, "max_staleness": 1},
        "recipe": "nvfp4_moe",
        "model": {
            "preset": "tiny",
            "overrides": {"n_layers": 2, "dim": 64, "n_experts": 4, "expert_ffn_dim": 64, "shared_expert_ffn_dim": 64},
        },
        "task": {"digits": 1},
        "trainer": {
            "max_steps": 1000,
            "groups_per_step": 1,
            "group_size": 2,
            "minibatches": 1,
            "warmstart_steps": 1,
            "warmstart_batch": 4,
            "metrics_port": -1,
            "health": {"port": 0},
            "grpc_host": "127.0.0.1",
            "grpc_port": grpc_port,
            "grpc_advertise": f"localhost:{grpc_port}",
        },
        "rollout": {"health": {"port": 0}, "read_block_ms": 100, "heartbeat_s": 0.5, "heartbeat_ttl_s": 3.0},
    }
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    url = redis_url.replace("redis://", f"redis://{user}@", 1)  # the user name only: the password comes apart
    base = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TANDEM_CONFIG": str(config),
        "TANDEM_REDIS_URL": url,
        "TANDEM_REDIS_PASSWORD": password,
    }
    trainer_env = {
        **base,
        "TANDEM_RUN_DIR": str(tmp_path / "run"),
        "TANDEM_TRAINER_TLS_CERT": cert,
        "TANDEM_TRAINER_TLS_KEY": key,
        "TANDEM_TRAINER_TLS_CLIENT_CA": cert,
    }
    rollout_env = {
        **base,
        "TANDEM_WORKER_ID": "pod-0",
        "TANDEM_ROLLOUT_TLS_CA": cert,
        "TANDEM_ROLLOUT_TLS_CERT": cert,
        "TANDEM_ROLLOUT_TLS_KEY": key,
    }
    logs = {name: tmp_path / f"{name}.log" for name in ("trainer", "rollout")}

    def spawn(cmd: str, env: dict) -> subprocess.Popen:  # no arguments: everything from the environment
        return subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", cmd],
            stdout=open(logs[cmd], "wb"),
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )

    rollout = spawn("rollout", rollout_env)
    trainer = None
    try:
        r_port = _wait(lambda: _health_port(logs["rollout"]), "the rollout's health port", 30, [rollout], logs.values())
        assert _health(r_port, ROLLOUT_HEALTH) == _health(r_port, "") == "NOT_SERVING"  # no policy yet

        trainer = spawn("trainer", trainer_env)
        t_port = _wait(
            lambda: _health_port(logs["trainer"]), "the trainer's health port", 30, [trainer, rollout], logs.values()
        )
        _wait(
            lambda: _health(r_port, ROLLOUT_HEALTH) == "SERVING",
            "the rollout to load a policy",
            60,
            [trainer, rollout],
            logs.values(),
        )
        assert _health(r_port, "") == "SERVING"
        assert _health(t_port, TRAINER_HEALTH) == _health(t_port, "") == "SERVING"
        pointer = _pointer(redis_url_with(url, password=password), run_id)
        assert pointer.address == f"localhost:{grpc_port}"  # advertised, not the bound 127.0.0.1
        assert "pod-0: policy v1 live" in logs["rollout"].read_text()
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:  # the policy port speaks TLS only
            with pytest.raises(grpc.RpcError) as e:
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE

        rollout.send_signal(signal.SIGTERM)  # drains: finishes its group, exits 0
        assert rollout.wait(timeout=30) == 0, logs["rollout"].read_text()[-2000:]
        assert "pod-0: drained after" in logs["rollout"].read_text()
        trainer.send_signal(signal.SIGTERM)
        assert trainer.wait(timeout=30) == 0, logs["trainer"].read_text()[-2000:]
    finally:
        for p in (rollout, trainer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
