"""trainer.publisher: one publish in flight, announced after it is servable, failures raised later."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from trainer.publisher import Publisher, PublishError


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_the_step_continues_while_prepare_runs_and_announce_follows_it():
    events: list[str] = []
    gate = threading.Event()

    def prepare():
        events.append("prepare start")
        assert gate.wait(30)
        events.append("prepare done")

    async def announce():
        events.append("announce")

    async def main():
        p = Publisher(log=events.append)
        assert await p.idle() == 0.0  # nothing in flight
        p.start(1, prepare, announce)
        await asyncio.sleep(0)  # the step's next awaits (collecting) let the task run
        while "prepare start" not in events:
            await asyncio.sleep(0.01)
        events.append("next step")  # training goes on: prepare is still blocked
        assert p.in_flight == 1 and p.published == 0
        threading.Timer(0.2, gate.set).start()
        blocked = await p.idle()  # back-pressure: the next publish waits for this one
        assert blocked >= 0.15
        assert p.in_flight is None and p.published == 1
        return blocked

    run(main())
    assert events == ["prepare start", "next step", "prepare done", "announce"]


def test_announce_wait_counts_the_time_a_servable_version_waits_for_the_event_loop():
    prepared = threading.Event()

    async def announce():
        pass

    async def main():
        p = Publisher(log=lambda _: None)
        p.start(1, prepared.set, announce)
        await asyncio.sleep(0)
        assert prepared.wait(30)
        time.sleep(0.3)  # the loop's thread busy (a step computed on it): the announce cannot start
        await p.idle()
        return p.announce_wait_s

    assert run(main()) >= 0.25


def test_a_second_start_without_idle_is_refused():
    async def main():
        p = Publisher(log=lambda _: None)

        async def announce():
            pass

        p.start(1, lambda: None, announce)
        with pytest.raises(RuntimeError, match="not awaited"):
            p.start(2, lambda: None, announce)
        await p.idle()

    run(main())


@pytest.mark.parametrize("where", ["prepare", "announce"])
def test_a_failed_publish_is_logged_at_once_and_raised_by_the_next_idle(where):
    logged: list[str] = []
    announced = []

    def prepare():
        if where == "prepare":
            raise OSError("disk on fire")

    async def announce():
        if where == "announce":
            raise ConnectionError("redis gone")
        announced.append(1)

    async def main():
        p = Publisher(log=logged.append)
        p.start(7, prepare, announce)
        deadline = time.monotonic() + 30
        while not logged and time.monotonic() < deadline:  # logged when it happens, not when awaited
            await asyncio.sleep(0.01)
        assert len(logged) == 1 and "version 7 failed" in logged[0]
        with pytest.raises(PublishError, match="version 7 failed") as e:
            await p.idle()
        assert isinstance(e.value.__cause__, (OSError, ConnectionError))
        assert await p.idle() == 0.0  # raised once, then the publisher is free again
        assert p.published == 0

    run(main())
    assert not announced  # a prepare that failed is never announced


def test_settle_waits_for_the_publish_and_swallows_its_failure():
    done = []

    def prepare():
        time.sleep(0.1)
        done.append(1)
        raise ValueError("bad")

    async def main():
        p = Publisher(log=lambda _: None)

        async def announce():
            pass

        p.start(1, prepare, announce)
        await p.settle()
        assert done and p.in_flight is None

    run(main())
