"""Redis over TLS with client certificates: a real redis-server with `tls-auth-clients
yes`, certificates made by openssl from a dedicated CA; the URL the environment builds
(TANDEM_REDIS_URL + TANDEM_REDIS_CA_FILE + TANDEM_REDIS_CERT_FILE + TANDEM_REDIS_KEY_FILE) connects,
and the same URL without the client certificate is refused."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
from tls_certs import make_certs

from broker.local_redis import free_port
from broker.outage import RedisOutage
from broker.streams import connect
from tandem import config as run_config
from tandem import env_config

pytestmark = pytest.mark.integration


@pytest.fixture
def tls_redis(tmp_path):
    make_certs(tmp_path, ("server", "client"))
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--tls-cert-file", "server.crt", "--tls-key-file", "server.key",
         "--tls-ca-cert-file", "ca.crt", "--tls-auth-clients", "yes"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 30  # listening (a TCP accept; the TLS handshake is the test's)
    while True:
        assert proc.poll() is None, f"redis-server exited with {proc.returncode}"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline, f"redis-server not listening on {port} after 30 s"
            time.sleep(0.05)
    yield tmp_path, f"rediss://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


async def test_client_certificates_from_files(tls_redis):
    d, url = tls_redis
    env = {
        "TANDEM_REDIS_URL": url,
        "TANDEM_REDIS_CA_FILE": str(d / "ca.crt"),
        "TANDEM_REDIS_CERT_FILE": str(d / "client.crt"),
        "TANDEM_REDIS_KEY_FILE": str(d / "client.key"),
    }
    cfg = run_config.load(None, env_config.env_overrides(env))
    deadline = time.monotonic() + 10
    async with connect(cfg.redis_url, outage_s=10, log=lambda s: None) as r:
        assert await r.ping()
    assert time.monotonic() < deadline
    without_cert = env_config.redis_url_with(url, ca_file=str(d / "ca.crt"))
    async with connect(without_cert, outage_s=1, log=lambda s: None) as r:
        with pytest.raises(RedisOutage):
            await r.ping()


def test_client_certificates_need_rediss_and_both_files():
    with pytest.raises(ValueError, match="set both"):
        env_config.redis_url_with("rediss://h:1/0", cert_file="/c")
    with pytest.raises(ValueError, match="rediss://"):
        env_config.redis_url_with("redis://h:1/0", cert_file="/c", key_file="/k")
