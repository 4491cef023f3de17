"""`tandem trainer` with one kill point, a test-only entry point of the fault scenarios:

    python tests/faults/kill_points.py POINT@STEP --config FILE --run-dir DIR [key=value ...]

runs the trainer service as `tandem trainer` does, with a Checkpointer that SIGKILLs the process at
POINT of step STEP:
    mid_checkpoint  the checkpoint's temporary file written and flushed, neither fsynced nor renamed
    before_commit   the checkpoint durable, the samples it includes not yet committed
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from tandem import config, env_config, services
from tandem.commands import trainer as trainer_command
from tandem.preflight import check_ports
from trainer.checkpoints import Checkpointer
from trainer.service import Trainer

POINTS = ("mid_checkpoint", "before_commit")


class KillingCheckpointer(Checkpointer):
    def __init__(self, base: Checkpointer, point: str, step: int):
        super().__init__(base.folder, keep=base.keep, log=base.log)
        self.point, self.step = point, step

    def serialize(self, content: dict, f) -> None:
        super().serialize(content, f)
        if self.point == "mid_checkpoint" and content["state"]["step"] == self.step:
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def save(self, step: int, content: dict) -> bool:
        written = super().save(step, content)
        if written and self.point == "before_commit" and step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
        return written


def main(argv: list[str]) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as `tandem` sets it
    p = argparse.ArgumentParser(prog="kill_points.py")
    p.add_argument("at", help="POINT@STEP, POINT one of " + ", ".join(POINTS))
    trainer_command.add_arguments(p)
    args = p.parse_args(argv)
    point, _, step = args.at.partition("@")
    if point not in POINTS or not step.isdigit():
        p.error(f"{args.at!r}: want POINT@STEP with POINT one of {', '.join(POINTS)}")
    cfg = config.load(args.config, env_config.env_overrides() + args.overrides)
    services.check(cfg)
    check_ports(cfg, "trainer")
    parts = services.trainer_parts(cfg, args.run_dir)
    parts = dataclasses.replace(parts, checkpointer=KillingCheckpointer(parts.checkpointer, point, int(step)))
    return services.serve(Trainer(cfg.trainer, parts, log=services.trainer_log))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
