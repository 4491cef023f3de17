"""The trainer's configuration: one frozen dataclass, validated with messages naming each field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    # RL step
    max_steps: int = 100
    groups_per_step: int = 16  # prompt groups consumed per optimizer step
    group_size: int = 8  # samples per prompt (GRPO group)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minibatches: int = 2  # optimizer updates per step; the PPO clip acts from the second one on
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0  # truncated importance weight cap C on prox / behavior
    backward: str = "hp"  # QAT straight-through mode: "hp" or "dequant"
    # publishing (max_staleness is the run's, RunConfig.max_staleness, shared with the rollouts)
    publish_every: int = 1
    prompts_ahead: int = 0  # prompt groups queued or in flight; 0 = groups_per_step * max(1, max_staleness)
    # warm start: supervised steps on correct answers before RL, so the policy is sometimes right
    warmstart_steps: int = 150
    warmstart_batch: int = 64
    warmstart_lr: float = 3e-3
    # services
    grpc_host: str = "127.0.0.1"  # a pod binds "0.0.0.0"
    grpc_port: int = 0  # 0 = a free port (published in policy:latest)
    # host:port the rollouts dial, published in policy:latest; "" = the bound address. In a pod: the
    # Service's DNS name (a bound 0.0.0.0 is no address to dial).
    grpc_advertise: str = ""
    # TLS of the policy gRPC (PEM paths; "" = plaintext): certificate chain + key; a client CA as
    # well requires client certificates signed by it (mTLS).
    grpc_tls_cert: str = ""
    grpc_tls_key: str = ""
    grpc_tls_client_ca: str = ""
    # Plaintext grpc.health.v1 for Kubernetes probes (kubelet's gRPC probe cannot speak TLS): SERVING
    # once a policy is published. -1 = off, 0 = a free port, else that port; on health_host (a pod: its
    # IP, TANDEM_TRAINER_HEALTH_HOST from the downward API).
    health_port: int = -1
    health_host: str = "127.0.0.1"
    metrics_port: int = 0  # Prometheus; 0 = a free port, -1 = off
    collect_timeout_s: float = 300.0  # give up waiting for trajectories after this long
    max_abs_reward: float = 1e3  # samples with |reward| above this are refused (trainer.validation)

    def __post_init__(self):
        errors = []
        for name in ("max_steps", "groups_per_step", "group_size", "minibatches", "publish_every"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if self.group_size < 2:
            errors.append(f"group_size={self.group_size} (GRPO needs >= 2 samples per prompt)")
        if self.groups_per_step * self.group_size % self.minibatches:
            errors.append(
                f"minibatches={self.minibatches} must divide groups_per_step*group_size="
                f"{self.groups_per_step * self.group_size}"
            )
        if not (self.lr > 0 and self.warmstart_lr > 0):
            errors.append(f"lr={self.lr}, warmstart_lr={self.warmstart_lr} (must be > 0)")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            errors.append(f"clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.tis_cap < 1:
            errors.append(f"tis_cap={self.tis_cap} (must be >= 1)")
        if self.backward not in ("hp", "dequant"):
            errors.append(f"backward={self.backward!r} (hp or dequant)")
        if self.warmstart_steps < 0:
            errors.append(f"warmstart_steps={self.warmstart_steps} (must be >= 0)")
        if self.grpc_advertise:
            host, _, port = self.grpc_advertise.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                errors.append(f"grpc_advertise={self.grpc_advertise!r} (want host:port)")
            elif self.grpc_port == 0:
                errors.append(f"grpc_advertise={self.grpc_advertise!r} needs a fixed grpc_port (it is 0: a free port)")
        if bool(self.grpc_tls_cert) != bool(self.grpc_tls_key):
            errors.append(
                f"grpc_tls_cert={self.grpc_tls_cert!r}, grpc_tls_key={self.grpc_tls_key!r} (set both or neither)"
            )
        if self.grpc_tls_client_ca and not self.grpc_tls_cert:
            errors.append(f"grpc_tls_client_ca={self.grpc_tls_client_ca!r} (mTLS needs grpc_tls_cert and grpc_tls_key)")
        if not -1 <= self.health_port <= 65535:
            errors.append(f"health_port={self.health_port} (-1 = off, 0 = free, else a port)")
        if errors:
            raise ValueError("TrainerConfig: " + "; ".join(errors))

    def server_tls(self) -> dict:
        """The TLS keyword arguments of broker.policy_server.PolicyServerConfig (files checked there)."""
        return {
            "tls_cert_chain_path": self.grpc_tls_cert or None,
            "tls_private_key_path": self.grpc_tls_key or None,
            "tls_client_ca_path": self.grpc_tls_client_ca or None,
        }

    def queued_groups(self, max_staleness: int) -> int:
        """Groups are consumed first in, first out, and the groups being trained on still count as
        queued until their commit, so a group fed now is used about Q / groups_per_step - 1 steps
        later. Q = groups_per_step * max(1, max_staleness) keeps fast rollouts from producing samples
        that are already too stale, and with max_staleness=0 it is the synchronous loop."""
        return self.prompts_ahead or self.groups_per_step * max(1, max_staleness)
