"""Writing a file so that a crash or a full disk never leaves it half written.

    write_atomically(path, lambda f: torch.save(obj, f))

Rules:
1. `write(f)` writes into `path` + ".tmp"; the file is flushed and fsynced, renamed over `path`, and
   the folder fsynced (the rename itself is durable). Until the rename, `path` keeps its old content.
2. A failed write (ENOSPC, EIO, a quota: any OSError) removes the temporary file and raises the
   OSError itself, also where the writer hides it: torch.save's zip writer reports a failed
   `write()` as a RuntimeError ("unexpected pos"), and the OSError it swallowed is raised instead.
A temporary file left by a process killed mid-write is the reader's to ignore or remove
(`stale_temporaries`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

SUFFIX = ".tmp"


class _KeepsErrors:
    """A file's write() that remembers the OSError a writer may turn into something else."""

    def __init__(self, f: BinaryIO):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` by rules 1-2 of the module docstring."""
    path = Path(path)
    tmp = path.with_name(path.name + SUFFIX)
    try:
        with open(tmp, "wb") as f:
            out = _KeepsErrors(f)
            try:
                write(out)
            except Exception:
                if out.error is None:
                    raise
                raise out.error from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stale_temporaries(folder: Path) -> list[Path]:
    """Temporary files in `folder` left by writes that were cut short."""
    return sorted(Path(folder).glob("*" + SUFFIX))
