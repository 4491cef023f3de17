"""What a pod's environment adds to the config (tandem.config.env_overrides), the new config fields
and their validation, and the plaintext health server the probes talk to (broker/health.py),
including a rollout worker's drain (SIGTERM path: NOT_SERVING before the loop ends)."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.connection import parse_url

from broker.health import ROLLOUT_HEALTH, TRAINER_HEALTH, HealthConfig, HealthServer
from broker.tls import ClientTLS, ServerTLS
from rollout.config import RolloutConfig
from tandem import config as run_config
from tandem import env_config, services
from trainer.config import TrainerConfig


def _load(env: dict, overrides=()):
    return run_config.load(None, env_config.env_overrides(env) + list(overrides))


def _check(port: int, service: str) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_every_env_key_lands_in_its_config_field():
    env = {name: f"/x/{name.lower()}" for name in env_config.ENV_KEYS}
    env.update(TANDEM_RUN_ID="2024", TANDEM_REDIS_URL="redis://r:6379/0", TANDEM_ROLLOUT_TLS_SERVER_NAME="trainer")
    env.update(TANDEM_ROLLOUT_RELAY_ADVERTISE="10.1.2.3:50052", TANDEM_ROLLOUT_RELAY_SERVER_NAME="tandem-rollout")
    cfg = _load(env)
    assert cfg.run_id == "2024"  # quoted: YAML would have made it an int
    assert cfg.redis_url == "redis://r:6379/0"
    assert cfg.trainer.tls == ServerTLS(
        cert="/x/tandem_trainer_tls_cert", key="/x/tandem_trainer_tls_key", client_ca="/x/tandem_trainer_tls_client_ca"
    )
    assert cfg.rollout.tls == ClientTLS(
        ca="/x/tandem_rollout_tls_ca",
        cert="/x/tandem_rollout_tls_cert",
        key="/x/tandem_rollout_tls_key",
        server_name="trainer",
    )
    assert (cfg.rollout.relay_advertise, cfg.rollout.relay_server_name) == ("10.1.2.3:50052", "tandem-rollout")
    # Command-line overrides come after the environment and win.
    assert _load(env, ["run_id=cli"]).run_id == "cli"
    assert env_config.env_overrides({}) == []


def test_the_redis_password_is_merged_quoted_and_replaces_one_in_the_url():
    password = "p@ss w/#:%?"
    cfg = _load({"TANDEM_REDIS_URL": "redis://tandem:old@redis.svc:6379/2", "TANDEM_REDIS_PASSWORD": password})
    got = parse_url(cfg.redis_url)
    assert (got["username"], got["password"], got["host"], got["port"], got["db"]) == (
        "tandem",
        password,
        "redis.svc",
        6379,
        2,
    )
    got = parse_url(_load({"TANDEM_REDIS_URL": "redis://h:1/0", "TANDEM_REDIS_PASSWORD": "s"}).redis_url)
    assert got["password"] == "s" and "username" not in got


def test_the_redis_ca_file_needs_rediss():
    url = _load(
        {
            "TANDEM_REDIS_URL": "rediss://h:6380/0",
            "TANDEM_REDIS_PASSWORD": "s",
            "TANDEM_REDIS_CA_FILE": "/etc/redis ca/ca.pem",
        }
    ).redis_url
    got = parse_url(url)
    assert got["ssl_ca_certs"] == "/etc/redis ca/ca.pem" and got["password"] == "s"
    assert got["connection_class"].__name__ == "SSLConnection"
    with pytest.raises(ValueError, match="TANDEM_REDIS_CA_FILE.*needs a rediss://"):
        env_config.env_overrides({"TANDEM_REDIS_URL": "redis://h:6379", "TANDEM_REDIS_CA_FILE": "/ca.pem"})
    with pytest.raises(ValueError, match="TANDEM_REDIS_PASSWORD set without TANDEM_REDIS_URL"):
        env_config.env_overrides({"TANDEM_REDIS_PASSWORD": "s"})
    with pytest.raises(ValueError, match="want redis://"):
        env_config.env_overrides({"TANDEM_REDIS_URL": "http://h:6379"})


def test_trainer_config_checks_advertise_and_tls():
    TrainerConfig(grpc_host="0.0.0.0", grpc_port=50051, grpc_advertise="tandem-trainer:50051")
    with pytest.raises(ValueError) as e:
        TrainerConfig(grpc_advertise="tandem-trainer")
    assert "grpc_advertise='tandem-trainer' (want host:port)" in str(e.value)
    with pytest.raises(ValueError, match=r"tls.cert='c.pem', tls.key='' \(set both or neither\)"):
        ServerTLS(cert="c.pem", client_ca="ca.pem")
    with pytest.raises(ValueError, match="health.port=70000"):
        HealthConfig(port=70000)
    with pytest.raises(ValueError, match="needs a fixed grpc_port"):
        TrainerConfig(grpc_advertise="t:50051")  # grpc_port 0: the advertised port could be wrong
    with pytest.raises(ValueError, match="mTLS needs tls.cert"):
        ServerTLS(client_ca="ca.pem")
    # In a run config the nested sections are keys like any other.
    with pytest.raises(ValueError, match="mTLS needs tls.cert"):
        run_config.load(None, ["trainer.tls.client_ca=ca.pem"])


def test_rollout_config_checks_tls():
    RolloutConfig(tls=ClientTLS(ca="ca.pem"))  # server-authenticated TLS, no client certificate
    with pytest.raises(ValueError, match="need tls.ca"):
        ClientTLS(cert="c.pem", key="k.pem")
    with pytest.raises(ValueError, match="set both or neither"):
        ClientTLS(ca="ca.pem", cert="c.pem")
    with pytest.raises(ValueError, match="health.port=-2"):
        run_config.load(None, ["rollout.health.port=-2"])


def test_health_server_reports_one_bit_for_both_names():
    off = HealthServer(port=-1, service=TRAINER_HEALTH)
    assert off.start() is None
    off.set_serving(True)
    off.stop()  # disabled: all no-ops

    h = HealthServer(port=0, service=TRAINER_HEALTH)
    port = h.start()
    try:
        assert h.host == "127.0.0.1" and port > 0
        assert _check(port, "") == _check(port, TRAINER_HEALTH) == "NOT_SERVING"
        h.set_serving(True)
        assert _check(port, "") == _check(port, TRAINER_HEALTH) == "SERVING"
        with pytest.raises(grpc.RpcError) as e:
            _check(port, ROLLOUT_HEALTH)  # a probe aimed at the wrong service fails
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        h.stop()
    with pytest.raises(grpc.RpcError):
        _check(port, "")
    with pytest.raises(ValueError, match="port=65536"):
        HealthServer(port=65536, service=TRAINER_HEALTH)


def _tiny_cfg(**rollout):
    return run_config.load(
        None,
        [
            "model.overrides={n_layers: 2, dim: 32, n_experts: 2, expert_ffn_dim: 32, shared_expert_ffn_dim: 32}",
            "redis_url=redis://127.0.0.1:1/0",
            *[f"rollout.{k}={v}" for k, v in rollout.items()],
        ],
    )


def test_a_draining_rollout_worker_reports_not_serving():
    worker = services.make_worker(_tiny_cfg(**{"health.port": 0}), "w0")
    port = worker.health.start()
    try:
        assert _check(port, ROLLOUT_HEALTH) == "NOT_SERVING"
        worker.health.set_serving(True)  # what the worker does once a verified policy is live
        assert _check(port, ROLLOUT_HEALTH) == "SERVING"
        worker.request_stop()  # the SIGTERM handler
        assert worker.stop.is_set() and _check(port, ROLLOUT_HEALTH) == "NOT_SERVING"
    finally:
        worker.health.stop()


def test_a_rollout_worker_with_missing_tls_files_fails_at_start(tmp_path):
    with pytest.raises(ValueError, match="tls.ca=.*is not a file"):
        services.make_worker(_tiny_cfg(**{"tls.ca": str(tmp_path / "missing-ca.pem")}), "w0")
