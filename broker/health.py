"""A plaintext `grpc.health.v1` endpoint for Kubernetes probes, on a port of its own.

    health = HealthServer(port=8081, service=ROLLOUT_HEALTH)   # port -1: does nothing at all
    health.start()                  # NOT_SERVING
    health.set_serving(True)        # once a policy is there; False again while draining
    health.stop()

Why a separate server: kubelet's gRPC probes speak plaintext only, while the trainer's policy port
may require TLS or client certificates, and a rollout worker has no gRPC server at all. It runs on
gRPC's own threads, so probes are answered while the owner's event loop is busy (a rollout worker
generating a group). The status is one bit, reported for the whole server ("") and for `service`.

Binding: `host` (loopback by default; in a pod its IP, where kubelet probes), port 0 = a free port.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from policy.fields import is_int

TRAINER_HEALTH = "tandem.trainer"  # the trainer's health service name (SERVING: a policy is published)
ROLLOUT_HEALTH = "tandem.rollout"  # a rollout worker's (SERVING: a verified policy is loaded)

_STATUS = {True: health_pb2.HealthCheckResponse.SERVING, False: health_pb2.HealthCheckResponse.NOT_SERVING}


class HealthServer:
    def __init__(self, *, port: int, service: str, host: str = "127.0.0.1"):
        if not is_int(port, -1, 65535):
            raise ValueError(f"HealthServer: port={port!r} (want -1 = off, 0 = free, or a port)")
        if not service:
            raise ValueError("HealthServer: service must be a non-empty name")
        self.enabled = port >= 0
        self.host = host
        self.port = port
        self.service = service
        self.serving = False
        self._server: grpc.Server | None = None
        self._servicer: health.HealthServicer | None = None

    def start(self) -> int | None:
        """Start answering (NOT_SERVING); return the bound port, or None when disabled."""
        if not self.enabled:
            return None
        if self._server is not None:
            raise RuntimeError("HealthServer already started")
        # Two threads answer Check calls; a Watch holds one, so watchers beyond that wait in line.
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
            options=[("grpc.so_reuseport", 0)],
        )
        self._servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        port = server.add_insecure_port(f"{self.host}:{self.port}")
        if not port:
            raise OSError(f"HealthServer: could not bind {self.host}:{self.port}")
        self._publish()
        server.start()
        self._server, self.port = server, port
        return port

    def set_serving(self, serving: bool) -> None:
        self.serving = bool(serving)
        self._publish()

    def _publish(self) -> None:
        if self._servicer is not None:
            for name in ("", self.service):
                self._servicer.set(name, _STATUS[self.serving])

    def stop(self, grace_s: float = 1.0) -> None:
        if self._server is not None:
            self.set_serving(False)
            self._server.stop(grace_s).wait(grace_s + 5)
            self._server = None


@dataclass(frozen=True, kw_only=True)
class HealthConfig:
    """The `health:` section of the trainer and of a rollout worker."""

    port: int = -1
    """Plaintext grpc.health.v1 for Kubernetes probes: -1 = off, 0 = a free port, else that port."""
    host: str = "127.0.0.1"
    """Address the probe port binds: loopback by default; in a pod its IP (the downward API's
    status.podIP, through TANDEM_TRAINER_HEALTH_HOST / TANDEM_ROLLOUT_HEALTH_HOST)."""

    def __post_init__(self):
        if not is_int(self.port, -1, 65535):
            raise ValueError(f"health.port={self.port!r} (-1 = off, 0 = free, else a port)")
