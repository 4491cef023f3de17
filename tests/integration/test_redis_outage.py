"""A Redis restart must not kill a service. Every client from
`broker.streams.connect()` retries through an outage of up to `outage_s` seconds (commands,
pipelines, transactions, Lua scripts, a blocked XREADGROUP), logs one line when the outage starts
and one when it ends, and past the bound raises RedisOutage."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from restartable_redis import RestartableRedis  # tests/restartable_redis.py

from broker.codec import Trajectory
from broker.keys import Keys
from broker.outage import RedisOutage
from broker.registry import PolicyPointer, PolicyRegistry
from broker.streams import GroupConsumer, TrajectoryStream, add_entries, connect, stream_stats

pytestmark = pytest.mark.integration


def _traj(i: int) -> Trajectory:
    return Trajectory(
        sample_id=f"g/{i}", prompt_id="g", group_id="g", sample_index=i, group_size=2,
        prompt_tokens=np.array([1, 2], dtype=np.int32), completion_tokens=np.array([3], dtype=np.int32),
        behavior_logprobs=np.array([-0.5], dtype=np.float32), reward=1.0, policy_version=1,
        contract_fingerprint="f" * 64, worker_id="w", created_at=0.0,
    )  # fmt: skip


async def _restart(server: RestartableRedis, down_s: float) -> None:
    await asyncio.to_thread(server.stop, kill=True)
    await asyncio.sleep(down_s)
    await asyncio.to_thread(server.start)


@pytest.mark.parametrize("down_s", [0.3, 3.0])
async def test_every_kind_of_call_survives_a_restart(tmp_path, down_s):
    with RestartableRedis(tmp_path, appendfsync="always") as server:
        lines: list[str] = []
        r = connect(server.url, outage_s=30, log=lines.append)
        keys = Keys(run_id="outage")
        try:
            await r.set("a", "1")
            stream = TrajectoryStream(r, keys, consumer="trainer")
            await stream.setup()
            await stream.add([_traj(0)])
            registry = PolicyRegistry(r, keys)
            await registry.publish(PolicyPointer(version=1, address="h:1", contract_fingerprint="f" * 64))
            reader = GroupConsumer(r, stream="s", group="g", consumer="c", deadletter=keys.deadletter)
            await reader.ensure_group()
            assert await reader.read(block_ms=10) == []

            # A read blocked in XREADGROUP when the server goes away, and a burst of other calls.
            blocked = asyncio.create_task(reader.read(block_ms=20_000))
            await asyncio.sleep(0.1)
            await _restart(server, down_s)
            assert await r.get("a") == b"1"  # AOF (always) kept it
            await add_entries(r, "s", [b"x"])
            got = await asyncio.wait_for(blocked, 30)
            assert [e.fields[b"d"] for e in got] == [b"x"]
            # Lua scripts (EVAL: no script cache to lose), pipelines and transactions.
            (rec,) = await stream.read(block_ms=10)
            assert await stream.commit([rec]) == 1
            assert await registry.publish(PolicyPointer(version=2, address="h:1", contract_fingerprint="f" * 64))
            assert (await registry.latest()).version == 2
        finally:
            await r.aclose()
        outage_lines = [ln for ln in lines if "unreachable" in ln or "back after" in ln]
        assert len(outage_lines) == 2, lines  # one outage: one line when it starts, one when it ends
        assert "unreachable" in outage_lines[0] and "back after" in outage_lines[1]


async def test_past_the_bound_a_clear_error(tmp_path):
    with RestartableRedis(tmp_path, appendfsync=None) as server:
        r = connect(server.url, outage_s=1.0, log=lambda s: None)
        try:
            await r.set("a", "1")
            await asyncio.to_thread(server.stop, kill=True)
            t0 = time.monotonic()
            with pytest.raises(RedisOutage, match=r"unreachable for .*redis_outage_s=1"):
                await r.get("a")
            assert time.monotonic() - t0 >= 1.0
        finally:
            await r.aclose()


async def test_backlog_is_counted_after_a_restart_forgets_the_lag(tmp_path):
    """Redis 7.0 reloading from AOF forgets a group's entries-read, so XINFO GROUPS says
    lag None; stream_stats then counts the undelivered entries itself (the trainer's backlog bound)."""
    with RestartableRedis(tmp_path, appendfsync="always") as server:
        r = connect(server.url, outage_s=30, log=lambda s: None)
        try:
            reader = GroupConsumer(r, stream="s", group="g", consumer="c", deadletter="dl")
            await reader.ensure_group()
            await add_entries(r, "s", [b"%d" % i for i in range(10)])
            got = await reader.read(count=4, block_ms=10)
            await reader.ack([e.id for e in got[:1]])
            before = (await stream_stats(r, "s"))["groups"]["g"]
            assert (before["lag"], before["pending"]) == (6, 3)
            await _restart(server, 0.1)
            raw = (await r.xinfo_groups("s"))[0]
            after = (await stream_stats(r, "s"))["groups"]["g"]
            assert (after["lag"], after["pending"]) == (6, 3), (raw, after)
        finally:
            await r.aclose()
