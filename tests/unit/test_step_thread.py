"""trainer.step_thread: the trainer's steps run on one thread of their own while its event loop runs."""

from __future__ import annotations

import asyncio
import threading

import torch

from trainer.step_thread import StepThread


def test_the_event_loop_runs_while_a_step_computes():
    # The step waits for an event that only a coroutine on the loop sets (as the publisher's announce
    # runs mid-step): were the step run on the loop's thread, it would wait in vain.
    announced = threading.Event()

    def step(x):
        assert announced.wait(30), "the event loop did not run while the step computed"
        return x + 1, threading.current_thread()

    async def announce():
        announced.set()

    async def main():
        steps = StepThread(torch.device("cpu"))
        try:
            task = asyncio.create_task(announce())
            first = await steps.run(step, 1)
            await task
            announced.clear()
            asyncio.get_running_loop().call_later(0.05, announced.set)
            second = await steps.run(step, x=2)
        finally:
            steps.close()
        return first, second

    (one, t1), (three, t2) = asyncio.run(asyncio.wait_for(main(), 60))
    assert (one, three) == (2, 3)
    assert t1 is t2 and t1 is not threading.main_thread()  # one thread, always the same
