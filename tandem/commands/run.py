"""`tandem run CONFIG [--run-dir DIR] [key=value ...]`: the whole loop on one machine."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", default="demo.yaml", help="YAML run config (default: configs/demo.yaml)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>-<time>)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=10 max_staleness=0")


def main(args) -> int:
    import os

    from tandem.launcher import run

    config, overrides = args.config, list(args.overrides)
    if "=" in config and not os.path.exists(config):  # `tandem run trainer.max_steps=1`: the demo config
        config, overrides = "demo.yaml", [config, *overrides]
    return run(config, args.run_dir, overrides)
