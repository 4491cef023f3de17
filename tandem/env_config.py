"""What a pod's environment adds to a run config, and the Redis URL's secrets kept apart from it.

A deployment (Kubernetes Secrets, ConfigMaps, mounted files) provides per pod the variables of
ENV_KEYS, each one config key; `env_overrides` turns them into `key=value` overrides, applied after
the YAML file and before command-line overrides. The Redis password and TLS files come apart from
the URL (TANDEM_REDIS_PASSWORD, TANDEM_REDIS_CA_FILE, TANDEM_REDIS_CERT_FILE, TANDEM_REDIS_KEY_FILE),
so that the URL can live in a ConfigMap and only the password in a Secret; they are merged into
TANDEM_REDIS_URL, which they therefore require. `redact_url` is what of a URL may reach disk or logs.
"""

from __future__ import annotations

import json
import os
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

# What a deployment provides per pod, through the environment (Kubernetes: Secrets, ConfigMaps,
# mounted files): variable -> config key. Applied after the YAML file, before command-line overrides.
# The commands themselves read TANDEM_CONFIG, TANDEM_RUN_DIR and TANDEM_WORKER_ID.
ENV_KEYS = {
    "TANDEM_RUN_ID": "run_id",
    "TANDEM_REDIS_URL": "redis_url",  # plus TANDEM_REDIS_PASSWORD / TANDEM_REDIS_CA_FILE, merged in
    "TANDEM_RUN_SECRET_FILE": "run_secret_file",  # a mounted Secret (or TANDEM_RUN_SECRET, read directly)
    "TANDEM_TRAINER_TLS_CERT": "trainer.tls.cert",
    "TANDEM_TRAINER_TLS_KEY": "trainer.tls.key",
    "TANDEM_TRAINER_TLS_CLIENT_CA": "trainer.tls.client_ca",
    "TANDEM_ROLLOUT_TLS_CA": "rollout.tls.ca",
    "TANDEM_ROLLOUT_TLS_CERT": "rollout.tls.cert",
    "TANDEM_ROLLOUT_TLS_KEY": "rollout.tls.key",
    "TANDEM_ROLLOUT_TLS_SERVER_NAME": "rollout.tls.server_name",
    "TANDEM_TRAINER_HEALTH_HOST": "trainer.health.host",  # the pod IP (downward API status.podIP)
    "TANDEM_ROLLOUT_HEALTH_HOST": "rollout.health.host",
    "TANDEM_TRAINER_METRICS_HOST": "trainer.metrics_host",  # the pod IP, where Prometheus scrapes
    "TANDEM_ROLLOUT_METRICS_HOST": "rollout.metrics_host",
    "TANDEM_ROLLOUT_RELAY_ADVERTISE": "rollout.relay_advertise",  # "$(POD_IP):PORT": where peers dial its relay
    "TANDEM_ROLLOUT_RELAY_SERVER_NAME": "rollout.relay_server_name",  # with TLS: the workers' certificate name
}
REDIS_URL_PARTS = ("TANDEM_REDIS_PASSWORD", "TANDEM_REDIS_CA_FILE", "TANDEM_REDIS_CERT_FILE", "TANDEM_REDIS_KEY_FILE")


def env_overrides(environ: dict | None = None) -> list[str]:
    """`key=value` overrides from the environment (`os.environ` by default), per ENV_KEYS.

    The Redis password comes apart from the URL, so that the URL can live in a ConfigMap and only
    the password in a Secret: TANDEM_REDIS_PASSWORD (and TANDEM_REDIS_CA_FILE, the CA of a
    rediss:// server) are merged into TANDEM_REDIS_URL, which they therefore require.
    """
    env = os.environ if environ is None else environ
    out = []
    for name, key in ENV_KEYS.items():
        value = env.get(name, "")
        if name == "TANDEM_REDIS_URL":
            if not value and any(env.get(n) for n in REDIS_URL_PARTS):
                raise ValueError(f"{' / '.join(n for n in REDIS_URL_PARTS if env.get(n))} set without TANDEM_REDIS_URL")
            value = value and redis_url_with(
                value,
                password=env.get("TANDEM_REDIS_PASSWORD", ""),
                ca_file=env.get("TANDEM_REDIS_CA_FILE", ""),
                cert_file=env.get("TANDEM_REDIS_CERT_FILE", ""),
                key_file=env.get("TANDEM_REDIS_KEY_FILE", ""),
            )
        if value:
            out.append(f"{key}={json.dumps(value)}")  # a JSON string is a YAML string: "2024" stays text
    return out


def redis_url_with(url: str, *, password: str = "", ca_file: str = "", cert_file: str = "", key_file: str = "") -> str:
    """`url` with `password` as its password (replacing any; the user name is kept), `ca_file` as the
    CA that verifies a rediss:// server (redis-py's `ssl_ca_certs` URL parameter), and `cert_file` +
    `key_file` as the client certificate a server with `tls-auth-clients yes` requires."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"TANDEM_REDIS_URL has scheme {parts.scheme!r}: want redis://, rediss:// or unix://")
    netloc, query = parts.netloc, parts.query
    if password:
        userinfo, at, hostport = netloc.rpartition("@")
        user = userinfo.partition(":")[0] if at else ""
        netloc = f"{user}:{quote(password, safe='')}@{hostport}"
    if ca_file:
        if parts.scheme != "rediss":
            raise ValueError(
                f"TANDEM_REDIS_CA_FILE={ca_file!r} needs a rediss:// TANDEM_REDIS_URL, not {parts.scheme}://"
            )
        query = "&".join(q for q in (query, urlencode({"ssl_ca_certs": ca_file})) if q)
    if cert_file or key_file:
        if parts.scheme != "rediss" or not (cert_file and key_file):
            raise ValueError(
                f"TANDEM_REDIS_CERT_FILE={cert_file!r}, TANDEM_REDIS_KEY_FILE={key_file!r}: set both, "
                f"with a rediss:// TANDEM_REDIS_URL (not {parts.scheme}://)"
            )
        query = "&".join(q for q in (query, urlencode({"ssl_certfile": cert_file, "ssl_keyfile": key_file})) if q)
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***`: what may be written to disk or logs."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return url
    user = userinfo.partition(":")[0]
    return urlunsplit((parts.scheme, f"{user}:***@{hostport}", parts.path, parts.query, parts.fragment))
