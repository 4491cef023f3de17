"""`tandem rollout --config FILE --worker-id ID [key=value ...]`: one rollout worker (Kubernetes)."""

from __future__ import annotations

import os
import socket


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.environ.get("TANDEM_CONFIG"), help="run config YAML ($TANDEM_CONFIG)")
    p.add_argument(
        "--worker-id",
        default=os.environ.get("TANDEM_WORKER_ID") or socket.gethostname(),
        help="stable consumer name ($TANDEM_WORKER_ID, else the host name: a pod's name)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value")


def main(args) -> int:
    from rollout.packed_engine import resolve_device
    from tandem import config, env_config, services

    if not args.config:
        raise ValueError("no run config: pass --config FILE or set TANDEM_CONFIG")
    cfg = config.load(args.config, env_config.env_overrides() + args.overrides)
    services.check(cfg)
    resolve_device(cfg.rollout.device)  # e.g. rollout.device=cuda on a machine without CUDA
    return services.serve_rollout(cfg, args.worker_id)
