"""The rollout worker's configuration: one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    temperature: float = 1.0
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    reclaim_idle_s: float = 20.0  # prompt entries idle this long in a dead worker are claimed
    fetch_timeout_s: float = 60.0
    read_block_ms: int = 500
    # TLS to the trainer's policy gRPC (PEM paths; "" = plaintext): the CA that signed the trainer's
    # certificate, plus a client certificate and key where the trainer requires them (mTLS).
    grpc_tls_ca: str = ""
    grpc_tls_cert: str = ""
    grpc_tls_key: str = ""
    grpc_tls_server_name: str = ""  # checked against the trainer's certificate instead of the dialed host
    # grpc.health.v1 for Kubernetes probes: SERVING once a verified policy is loaded, NOT_SERVING
    # before and while draining. -1 = off, 0 = a free port, else that port; on health_host (a pod: its
    # IP, TANDEM_ROLLOUT_HEALTH_HOST from the downward API).
    health_port: int = -1
    health_host: str = "127.0.0.1"
    max_policy_bytes: int = 64 << 30  # a manifest declaring more tensor bytes than this is refused

    def __post_init__(self):
        errors = []
        if not self.temperature > 0:
            errors.append(f"temperature={self.temperature} (must be > 0: behavior log-probs need sampling)")
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s:
            errors.append(f"heartbeat_s={self.heartbeat_s}, heartbeat_ttl_s={self.heartbeat_ttl_s} (need 0 < s < ttl)")
        if self.reclaim_idle_s <= 0 or self.fetch_timeout_s <= 0 or self.read_block_ms <= 0:
            errors.append(
                f"reclaim_idle_s={self.reclaim_idle_s}, fetch_timeout_s={self.fetch_timeout_s}, "
                f"read_block_ms={self.read_block_ms} (must be > 0)"
            )
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            errors.append(
                f"grpc_tls_cert={self.grpc_tls_cert!r}, grpc_tls_key={self.grpc_tls_key!r} (set both or neither)"
            )
        if (self.grpc_tls_cert or self.grpc_tls_server_name) and not self.grpc_tls_ca:
            errors.append(
                f"grpc_tls_cert={self.grpc_tls_cert!r}, grpc_tls_server_name={self.grpc_tls_server_name!r} "
                "need grpc_tls_ca (TLS is on only with a CA)"
            )
        if not -1 <= self.health_port <= 65535:
            errors.append(f"health_port={self.health_port} (-1 = off, 0 = free, else a port)")
        if errors:
            raise ValueError("RolloutConfig: " + "; ".join(errors))

    def client_tls(self) -> dict:
        """The TLS keyword arguments of broker.policy_client.PolicyClientConfig (files checked there)."""
        return {
            "tls_root_ca_path": self.grpc_tls_ca or None,
            "tls_cert_chain_path": self.grpc_tls_cert or None,
            "tls_private_key_path": self.grpc_tls_key or None,
            "tls_server_name": self.grpc_tls_server_name or None,
        }
