"""broker.streams when Redis lost a stream or its consumer group (a restart without its data, a
failover to an empty replica, FLUSHALL), against a real redis-server: every consumer call makes the
group again and carries on, none raises NOGROUP to the service loop; the registry and heartbeats
start over empty."""

from __future__ import annotations

import asyncio
import time

from test_streams import QUIET, prompt, traj

from broker.keys import PROMPTS_GROUP, TRAJECTORIES_GROUP, Keys
from broker.registry import Heartbeats, PolicyPointer, PolicyRegistry
from broker.streams import JanitorReport, PromptQueue, StreamConfig, TrajectoryStream, connect, read_deadletter


async def lose_everything(r, keys: Keys) -> None:
    """What a wipe does to one run: every key under its prefix gone (the shared server keeps other tests')."""
    names = [k async for k in r.scan_iter(match=keys.prefix.replace("{", "\\{").replace("}", "\\}") + "*")]
    assert names, "nothing to lose"
    await r.delete(*names)


async def test_a_worker_holding_a_prompt_rides_out_a_lost_stream(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        q = PromptQueue(r, keys, consumer="w1", config=StreamConfig(janitor_every_s=0.001, block_ms=0))
        await q.setup()
        await q.add([prompt(0)])
        [held] = await q.read()
        await lose_everything(r, keys)

        assert await q.keep_alive([held]) == []  # XPENDING / XCLAIM: NOGROUP, answered "no longer yours"
        assert await q.janitor() == JanitorReport()  # XPENDING IDLE: NOGROUP
        stats = await q.stats()
        assert stats["length"] == 0 and stats["groups"][PROMPTS_GROUP]["pending"] == 0  # the group made again
        # Its trajectories still land, and the lost prompt's XACK in the same transaction finds nothing.
        ids = await q.complete(held, [traj(held.group.group_id, i) for i in range(4)])
        assert len(ids) == 4 and await r.xlen(keys.trajectories) == 4
        await q.dead_letter(held, "a reason")  # XADD + XACK of an entry Redis no longer has
        assert [d.reason for d in await read_deadletter(r, keys)] == ["a reason"]

        # A prompt fed again after the loss is read in the very call that found the group gone.
        await r.xgroup_destroy(keys.prompts, PROMPTS_GROUP)
        await q.add([prompt(1)])
        [again] = await q.read()
        assert again.group.group_id == "g1" and again.deliveries == 1
        assert q.counters.regrouped == 2  # keep_alive found it gone, then read()


async def test_the_trainer_side_rides_out_a_lost_stream(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        ts = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        await ts.setup()
        await ts.add([traj("g0", i) for i in range(4)])
        got = await ts.read(block_ms=0)
        assert len(got) == 4
        await lose_everything(r, keys)

        # Entries added before anyone made the group again (a worker's XADD re-creates the stream
        # without it) are delivered: the group is made from id 0.
        await ts.add([traj("g1", i) for i in range(4)])
        assert await ts.stats() == {"length": 4, "groups": {}}  # the trainer must not read this as "empty"
        fresh = await ts.read(block_ms=0)
        assert sorted(x.trajectory.sample_id for x in fresh) == [f"g1/{i}" for i in range(4)]
        assert (await ts.stats())["groups"][TRAJECTORIES_GROUP]["pending"] == 4

        # Committing what was read before the loss (its XACK inside the Lua script finds nothing) and
        # after it; keep-alive and janitor answer without NOGROUP.
        assert await ts.commit(got) == 4
        await r.xgroup_destroy(keys.trajectories, TRAJECTORIES_GROUP)
        assert await ts.keep_alive(fresh) == []
        assert await ts.janitor() == JanitorReport()
        assert await ts.commit(fresh) == 4
        await ts.dead_letter(fresh[0], "refused")
        assert ts.counters.regrouped >= 2


async def test_a_read_blocked_while_redis_deletes_its_stream_reads_on(redis_url, run_id):
    """Redis answers a blocked XREADGROUP whose stream is deleted with UNBLOCKED, not NOGROUP."""
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r, connect(redis_url) as other:
        q = PromptQueue(r, keys, consumer="w1", config=StreamConfig(janitor_every_s=0, block_ms=20_000))
        await q.setup()
        reading = asyncio.create_task(q.read())
        deadline = time.monotonic() + 20
        while not any(c.get("cmd") == "xreadgroup" and "b" in c.get("flags", "") for c in await other.client_list()):
            assert time.monotonic() < deadline and not reading.done(), "the read never blocked"
            await asyncio.sleep(0.01)
        await other.delete(keys.prompts)
        await PromptQueue(other, keys).add([prompt(1)])  # fed again: the same read returns it
        [got] = await asyncio.wait_for(reading, 20)
        assert got.group.group_id == "g1" and q.counters.regrouped == 1


async def test_the_registry_and_heartbeats_after_redis_lost_everything(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        registry, beats = PolicyRegistry(r, keys), Heartbeats(r, keys)
        pointer = PolicyPointer(version=3, address="127.0.0.1:1", contract_fingerprint="fp")
        assert await registry.publish(pointer)
        await beats.beat("w1", ttl_s=30, role="rollout")
        await lose_everything(r, keys)
        assert await registry.latest() is None and await beats.live() == {}
        assert await registry.publish(pointer)  # the trainer points at its version again
        assert (await registry.latest()).version == 3 and registry.refused == 0
