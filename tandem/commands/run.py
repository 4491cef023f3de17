"""`tandem run CONFIG [--run-dir DIR] [key=value ...]`: the whole loop on one machine."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", default="demo.yaml", help="YAML run config (default: configs/demo.yaml)")
    p.add_argument("--run-dir", help="run folder (default: runs/<run_id>-<time>)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. trainer.max_steps=10 loop.max_staleness=0")
    p.add_argument(
        "--explain", metavar="KEY", help="print what a config key (or a section: all its keys) means, and exit"
    )


def main(args) -> int:
    import sys

    from tandem import config

    try:
        if args.explain is not None:
            print(config.explain(args.explain))
            return 0
        config.load(args.config, args.overrides)  # a bad config: one line, exit 2 (the launcher loads it again)
    except (ValueError, OSError) as e:
        print(f"tandem run: {e}", file=sys.stderr)
        return 2
    from tandem.launcher import run

    return run(args.config, args.run_dir, args.overrides)
