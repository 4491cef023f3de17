"""The `tandem` command.

Each subcommand lives in its own module under `tandem.commands` and exposes
`add_arguments(parser)` and `main(args) -> int`. Modules are imported only when their
subcommand runs, so `tandem formats` does not pay for gRPC or Redis imports.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help). Keep sorted by the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("tandem.commands.run", "run trainer + rollout workers (+ a private Redis) on this machine"),
    "study": ("tandem.commands.study", "run a grid of runs (recipe x staleness x seed, ablations), one report"),
    "trainer": ("tandem.commands.trainer", "start the trainer service"),
    "rollout": ("tandem.commands.rollout", "start one rollout worker"),
    "formats": ("tandem.commands.formats", "quantize a tensor with every format and print a table"),
    "inspect": ("tandem.commands.inspect", "print a policy manifest from a policy server (host:port) or a file"),
    "plan": ("tandem.commands.plan", "show the format and scope of every parameter under a recipe"),
    "probe": ("tandem.commands.probe", "measure BF16 / QAT / packed-weight log-prob mismatch for a recipe"),
    "import-hf": ("tandem.commands.import_hf", "plan a Hugging Face checkpoint under a recipe, without loading it"),
    "export": (
        "tandem.commands.export",
        "write a published version as a Hugging Face folder (hf, compressed-tensors, fp8-block, nvfp4)",
    ),
}


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("tandem-rl")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    # gRPC's C core logs every failed TLS handshake at INFO: a misconfigured worker would grow both
    # sides' logs by a line per reconnect. Services log gRPC's errors only (the policy client names a
    # handshake's failure itself); a GRPC_VERBOSITY set by the user wins, and child processes inherit it.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tandem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = (argv if argv is not None else sys.argv[1:])[:1]
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        # Only the chosen subcommand's module is imported to add its arguments.
        if chosen == [name]:
            importlib.import_module(module).add_arguments(p)
    # key=value overrides may come before or after options (argparse stops a positional list at
    # the first option), so leftovers of that shape join `overrides` where the command takes them.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    # A person gets one line that names what was wrong (exit 2), never a traceback; a closed pipe
    # (`tandem plan ... --json | head`) ends the command quietly, as it does any Unix tool.
    try:
        rc = int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)
        sys.stdout.flush()
        return rc
    except (ValueError, OSError) as e:
        if isinstance(e, BrokenPipeError):
            return _broken_pipe()
        print(f"tandem {args.command}: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tandem {args.command}: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _broken_pipe() -> int:
    import os

    # Python would complain again when it flushes stdout at exit: point it at /dev/null.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 141  # 128 + SIGPIPE, what a tool killed by the closed pipe reports


if __name__ == "__main__":
    sys.exit(main())
