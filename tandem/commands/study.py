"""`tandem study CONFIG [--out DIR] [--jobs N] [key=value ...]`: a grid of runs and one report."""

from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("config", help="study YAML (e.g. configs/study/ablations.yaml)")
    p.add_argument("--out", help="study folder: one run folder per run + the report (default: runs/study-<name>)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time, each pinned to its share of the CPUs")
    p.add_argument(
        "--report-only", action="store_true", help="write the report from the run folders as they are; run nothing"
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="grid.KEY=[...] replaces a grid axis, runs=[a,b] keeps those named runs, other keys apply to every run",
    )


def main(args) -> int:
    import sys
    from pathlib import Path

    from tandem.study import load_study, run_study
    from tandem.study_report import write_report

    try:
        if args.jobs < 1:
            raise ValueError(f"--jobs {args.jobs} (must be >= 1)")
        study = load_study(args.config, args.overrides)
        out = Path(args.out or Path("runs") / f"study-{study.name}")
        if args.report_only:
            if not out.is_dir():
                raise ValueError(f"--report-only: no study folder {out}")
            print(f"[study] report {write_report(study, study.expand(), out)}")
            return 0
        rc = run_study(study, out, jobs=args.jobs)
        if rc != 130:  # interrupted: the next invocation finishes the runs and writes the report
            print(f"[study] report {write_report(study, study.expand(), out)}; summary {out / 'summary.csv'}")
        return rc
    except ValueError as e:
        print(f"tandem study: {e}", file=sys.stderr)
        return 2
