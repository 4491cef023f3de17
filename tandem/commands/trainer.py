"""`tandem trainer --config FILE [--run-dir DIR] [key=value ...]`: the trainer service alone (Kubernetes)."""

from __future__ import annotations

import os


def add_arguments(p) -> None:
    p.add_argument("--config", default=os.environ.get("TANDEM_CONFIG"), help="run config YAML ($TANDEM_CONFIG)")
    p.add_argument(
        "--run-dir",
        default=os.environ.get("TANDEM_RUN_DIR", "runs/trainer"),
        help="checkpoints and metrics ($TANDEM_RUN_DIR)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value")


def main(args) -> int:
    from tandem import config, env_config, services

    if not args.config:
        raise ValueError("no run config: pass --config FILE or set TANDEM_CONFIG")
    cfg = config.load(args.config, env_config.env_overrides() + args.overrides)
    services.check(cfg)
    return services.serve_trainer(cfg, args.run_dir)
