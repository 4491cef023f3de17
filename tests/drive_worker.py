"""Driving a RolloutWorker without Redis through the public methods its loop calls: `offer` a pointer,
`wait_fetch`, `submit` a group, `step` the batcher."""

from __future__ import annotations


async def load(worker, pointer) -> bool:
    """Offer `pointer` to an idle worker until its fetch ends: True once its version is live, False
    when it is refused, its fetch or install failed, or a failed fetch waits for its retry."""
    while not await worker.offer(pointer):
        pending = worker.swap.pending
        if pending is None or pending.pointer != pointer or pending.done:
            return False
        await worker.wait_fetch(120)
    return True


def rollout_group(worker, group) -> list:
    """One group alone, start to finish, under the live version: its trajectories."""
    worker.submit(group)
    while not (finished := worker.step()):
        pass
    (f,) = finished
    if f.error is not None:
        raise f.error
    return f.trajectories
