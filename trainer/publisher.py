"""Publishing off the training step: at most one version in flight, announced once servable.

    publisher = Publisher(log=print)
    blocked_s = await publisher.idle()          # back-pressure: the previous publish must be done
    publisher.start(version, prepare, announce)  # prepare() in a thread, then await announce()

Rules: `prepare` (a thread: frame the version into a pooled host buffer and install it in the
PolicyServer, broker.frames) runs while the trainer's next step computes; `announce` (a coroutine on
the trainer's event loop: point `policy:latest` at the version) runs only after `prepare` returned,
so the pointer never names a version that is not servable; `announce_wait_s` is how long a servable
version waited for the event loop (the trainer steps on a thread of its own, so about zero). `idle()`
waits for the publish in flight and returns how long it waited. A failed prepare or announce is
logged when it happens and raised as PublishError by the next `idle()` (at the latest before the
next publish and at shutdown).
The caller keeps the published tensors valid while `prepare` runs (broker.frames.stage clones parts
aliasing live parameters; QAT's cache replaces its parts at each optimizer step, never in place)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class PublishError(RuntimeError):
    """A publish that failed in the background (the message names the version; the cause is chained)."""


class Publisher:
    """The rules of the module docstring. The trainer logs `idle()`'s wait plus its own staging of
    the version as `publish_blocked_s`; on a PublishError it exits non-zero, and its restart
    republishes the checkpoint's version."""

    def __init__(self, *, log: Callable[[str], None] = print):
        self.log = log
        self._task: asyncio.Task | None = None
        self._version: int | None = None
        self.published = 0  # versions announced
        self.announce_wait_s = 0.0  # the last announce: seconds from `prepare` returning to its start

    @property
    def in_flight(self) -> int | None:
        """The version being published, or None."""
        return self._version if self._task is not None and not self._task.done() else None

    def start(self, version: int, prepare: Callable[[], None], announce: Callable[[], Awaitable[None]]) -> None:
        """Start publishing `version`; call `await idle()` first (one publish at a time)."""
        if self._task is not None:
            raise RuntimeError(f"publish of version {version} started while version {self._version}'s is not awaited")
        self._version = version
        self._task = asyncio.create_task(self._run(version, prepare, announce), name=f"publish-v{version}")

    async def _run(self, version: int, prepare: Callable[[], None], announce: Callable[[], Awaitable[None]]) -> None:
        try:
            ready = await asyncio.to_thread(_timed, prepare)
            self.announce_wait_s = time.perf_counter() - ready
            await announce()
        except Exception as e:
            self.log(f"publishing version {version} failed: {type(e).__name__}: {e}")
            raise
        self.published += 1

    async def settle(self) -> None:
        """On the way out after an error: let the publish in flight finish (its failure is logged, not raised)."""
        task, self._task = self._task, None
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    async def idle(self) -> float:
        """Wait until no publish is in flight; seconds waited. Raises PublishError if it failed."""
        task, version, self._task = self._task, self._version, None
        if task is None:
            return 0.0
        t0 = time.perf_counter()
        try:
            await task
        except Exception as e:
            raise PublishError(f"publishing policy version {version} failed: {type(e).__name__}: {e}") from e
        return time.perf_counter() - t0


def _timed(fn: Callable[[], None]) -> float:
    """Run `fn`; the perf_counter when it returned (read on its own thread)."""
    fn()
    return time.perf_counter()
