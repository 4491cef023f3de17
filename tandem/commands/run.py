"""`tandem run CONFIG [--run-dir DIR [--accept-changes]] [key=value ...]`: the whole loop on one machine."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", default="demo.yaml", help="YAML run config (default: configs/demo.yaml)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>-<time>); a run folder resumes that run")
    p.add_argument(
        "--accept-changes",
        action="store_true",
        help="resume --run-dir with settings other than its config.yaml's (the old one is kept in config-history/)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=10 loop.max_staleness=0")
    p.add_argument(
        "--explain", metavar="KEY", help="print what a config key (or a section: all its keys) means, and exit"
    )


def main(args) -> int:
    import os

    from tandem import config
    from tandem.launcher import run

    if args.explain is not None:
        print(config.explain(args.explain))
        return 0
    # A bad config is one line and exit 2 (tandem.cli), raised by the launcher before it starts anything.
    path, overrides = args.config, list(args.overrides)
    if "=" in path and not os.path.exists(path):  # `tandem run trainer.max_steps=1`: the demo config
        path, overrides = "demo.yaml", [path, *overrides]
    return run(path, args.run_dir, overrides, accept_changes=args.accept_changes)
