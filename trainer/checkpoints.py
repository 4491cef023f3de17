"""The trainer's checkpoints: checkpoints/step-NNNNNN.pt in the run folder, the newest `keep` kept.

A checkpoint holds the fp32 master weights, the AdamW state (two more tensors per parameter), the
trainer.state.State, the contract fingerprint and the version its weights are: about 3x the model's
fp32 size. Rules:
1. `save` writes atomically (trainer.atomic): a crash leaves the previous checkpoint whole, and so
   does a write that fails (a full disk: any OSError), which is logged and answered False; the
   caller trains on and the next checkpoint tries again.
2. `load_latest` removes temporary files left by a write cut short, and refuses a checkpoint of
   another contract (model/recipe) with one line naming both fingerprints.
3. Only tensors and plain types are loaded (`weights_only`): nothing is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from .atomic import stale_temporaries, write_atomically


class Checkpointer:
    def __init__(self, folder: Path, *, keep: int, log: Callable[[str], None] = print):
        self.folder, self.keep, self.log = Path(folder), keep, log
        self.newest_step = -1  # the step of the newest checkpoint on disk (-1: none)

    def load_latest(self, fingerprint: str) -> tuple[Path, dict] | None:
        """(path, content) of the newest checkpoint, or None (rule 2)."""
        for tmp in stale_temporaries(self.folder):
            tmp.unlink(missing_ok=True)
        path = latest_checkpoint(self.folder)
        if path is None:
            return None
        ck = torch.load(path, map_location="cpu", weights_only=True)
        if ck["fingerprint"] != fingerprint:
            raise ValueError(
                f"checkpoint {path} has contract fingerprint {ck['fingerprint'][:12]}, "
                f"this run's is {fingerprint[:12]}: different model/recipe"
            )
        self.newest_step = ck["state"]["step"]
        return path, ck

    def save(self, step: int, content: dict) -> bool:
        """Write step-NNNNNN.pt (rule 1), then keep only the newest `keep`; False if not written."""
        path = self.folder / f"step-{step:06d}.pt"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            write_atomically(path, lambda f: self.serialize(content, f))
        except OSError as e:
            newest = latest_checkpoint(self.folder)
            self.log(
                f"checkpoint {path.name} not written ({e.strerror or e}); training on, the newest checkpoint is "
                f"{newest.name if newest else 'none'}; the next checkpoint tries again"
            )
            return False
        self.newest_step = step
        for old in checkpoints(self.folder)[: -self.keep]:
            old.unlink()
        return True

    def serialize(self, content: dict, f: BinaryIO) -> None:
        """The bytes of a checkpoint, written into the temporary file."""
        torch.save(content, f)


def checkpoints(folder: Path) -> list[Path]:
    """The trainer's checkpoint files in `folder`, oldest first (a run folder's `checkpoints/`)."""
    return sorted(Path(folder).glob("step-*.pt"))


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest checkpoint in `folder` (or a single `trainer.pt` of the first checkpoint format), or None."""
    found = checkpoints(folder)
    legacy = Path(folder) / "trainer.pt"
    return found[-1] if found else legacy if legacy.exists() else None


def checkpoint_of_version(folder: Path, version: int | None = None) -> tuple[Path, dict]:
    """(path, checkpoint) of the newest checkpoint in `folder` whose `model` holds exactly the
    weights of policy `version` (default: the newest such); ValueError listing what is kept."""
    found = checkpoints(folder) or [p for p in [latest_checkpoint(folder)] if p]
    kept = []
    for path in reversed(found):
        ck = torch.load(path, map_location="cpu", weights_only=True)  # tensors and plain types only
        held = {ck.get("weights_version", ck["state"]["version"]): ck["model"]}
        held.update({int(v): w for v, w in ck.get("snapshots", {}).items()})  # trainer.pt's format
        held.pop(None, None)
        kept += sorted(held)
        want = max(held, default=None) if version is None else version
        if want in held:
            return path, {**ck, "model": held[want], "weights_version": want}
    raise ValueError(
        f"no checkpoint in {folder} holds the weights of version {version if version is not None else 'any'}"
        f" (kept: {', '.join(str(v) for v in sorted(set(kept))) or 'none'})"
    )


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Keep the lines of steps <= max_step; a last line without its newline (a write cut short) is
    dropped. Rewritten in place: the MetricsSink already holds the file open for appending."""
    if path.exists():
        complete = path.read_text().split("\n")[:-1]  # what follows the last newline is incomplete
        keep = [ln for ln in complete if ln.strip() and json.loads(ln)["step"] <= max_step]
        path.write_text("".join(ln + "\n" for ln in keep))
