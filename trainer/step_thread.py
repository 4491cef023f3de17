"""The thread the trainer's GRPO steps run on, so that its event loop stays free while a step
computes: a version whose background publish ends mid-step is announced then (trainer.publisher),
not when the step returns, and the loop's Redis work goes on.

    steps = StepThread(device)
    row = await steps.run(fn, *args, **kwargs)   # fn on the step thread; its result
    steps.close()                                 # after the step in flight, if any

One thread, always the same: steps never overlap, and torch's per-thread state is set once there
(the CUDA current device: the caller's).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

import torch


class StepThread:
    def __init__(self, device: torch.device):
        init, args = None, ()
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            init, args = torch.cuda.set_device, (index,)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tandem-step", initializer=init, initargs=args)

    async def run(self, fn, /, *args, **kwargs):
        """`fn(*args, **kwargs)` on the step thread; the event loop runs other tasks meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._pool.shutdown(wait=True)
