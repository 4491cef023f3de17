"""The `tandem` command.

Each subcommand lives in its own module under `tandem.commands` and exposes
`add_arguments(parser)` and `main(args) -> int`. Modules are imported only when their
subcommand runs, so `tandem formats` does not pay for gRPC or Redis imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Keep sorted by the order a user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("tandem.commands.run", "run trainer + rollout workers (+ a private Redis) on this machine"),
    "trainer": ("tandem.commands.trainer", "start the trainer service"),
    "rollout": ("tandem.commands.rollout", "start one rollout worker"),
    "formats": ("tandem.commands.formats", "quantize a tensor with every format and print a table"),
    "inspect": ("tandem.commands.inspect", "print a policy manifest from a policy server (host:port) or a file"),
    "plan": ("tandem.commands.plan", "show the format and scope of every parameter under a recipe"),
    "probe": ("tandem.commands.probe", "measure BF16 / QAT / packed-weight log-prob mismatch for a recipe"),
    "import-hf": ("tandem.commands.import_hf", "plan a Hugging Face checkpoint under a recipe, without loading it"),
    "export": ("tandem.commands.export", "write a published version as a Hugging Face folder (hf, int4, fp8, nvfp4)"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = (argv if argv is not None else sys.argv[1:])[:1]
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
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
    return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
