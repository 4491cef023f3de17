"""broker.streams against a real redis-server: delivery, crash recovery, janitor, dead letters,
idempotency."""

from __future__ import annotations

import asyncio
import sys
import time

import numpy as np
import pytest

from broker.codec import PromptGroup, Trajectory, decode_prompt_group, decode_trajectory, sample_id_for
from broker.keys import PROMPTS_GROUP, TRAJECTORIES_GROUP, Keys
from broker.streams import (
    DATA_FIELD,
    GroupConsumer,
    PromptQueue,
    StreamConfig,
    TrajectoryStream,
    add_entries,
    connect,
    read_deadletter,
    stream_stats,
)

QUIET = StreamConfig(janitor_every_s=0, block_ms=0)  # janitor only when a test calls it


def traj(group: str, index: int, n: int = 16, **kw) -> Trajectory:
    base = dict(
        sample_id=sample_id_for(group, index),
        prompt_id="p-" + group,
        group_id=group,
        sample_index=index,
        group_size=4,
        prompt_tokens=np.arange(8),
        completion_tokens=np.arange(n),
        behavior_logprobs=np.full(n, -0.5, np.float32),
        reward=float(index),
        policy_version=1,
        contract_fingerprint="fp",
        worker_id="w0",
        created_at=time.time(),
    )
    base.update(kw)
    return Trajectory(**base)


def prompt(i: int) -> PromptGroup:
    return PromptGroup(
        prompt_id=f"p{i}", group_id=f"g{i}", prompt_tokens=[1, 2, 3, i], n_samples=4, task={"answer": str(i)}
    )


def consumer(r, keys: Keys, name: str, config: StreamConfig = QUIET) -> GroupConsumer:
    return GroupConsumer(
        r, stream=keys.prompts, group=PROMPTS_GROUP, consumer=name, deadletter=keys.deadletter, config=config
    )


async def pending_count(r, stream: str, group: str) -> int:
    return int((await r.xpending(stream, group))["pending"])


async def test_pending_entries_are_read_before_new_ones(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        q = PromptQueue(r, keys)
        await q.setup()
        first = await q.add([prompt(i) for i in range(3)])
        c = consumer(r, keys, "w1")
        got = await c.read(count=2)
        assert [e.id for e in got] == first[:2] and all(e.deliveries == 1 for e in got)
        later = await q.add([prompt(i) for i in range(3, 5)])

        # "restart": a new object with the same consumer name reads its PEL first
        c2 = consumer(r, keys, "w1")
        again = await c2.read(count=10)
        assert [e.id for e in again] == first[:2]
        assert all(e.deliveries == 2 for e in again)
        assert decode_prompt_group(again[0].fields[DATA_FIELD]).prompt_id == "p0"
        new = await c2.read(count=10)
        assert [e.id for e in new] == [first[2]] + later and all(e.deliveries == 1 for e in new)
        assert await c2.read(count=10) == []
        assert await c2.ack([e.id for e in again + new]) == 5
        assert await pending_count(r, keys.prompts, PROMPTS_GROUP) == 0


async def test_ack_only_after_side_effect_crash_leaves_entry_pending(redis_url, run_id):
    keys = Keys(run_id=run_id)
    done: list[str] = []

    def side_effect(entry, fail: bool) -> None:
        if fail:
            raise RuntimeError("worker crashed mid-way")
        done.append(entry.id)

    async with connect(redis_url) as r:
        [sid] = await PromptQueue(r, keys).add([prompt(0)])
        c = consumer(r, keys, "w1")
        [e] = await c.read()
        with pytest.raises(RuntimeError):
            side_effect(e, fail=True)
            await c.ack([e.id])  # never reached
        assert await pending_count(r, keys.prompts, PROMPTS_GROUP) == 1

        c2 = consumer(r, keys, "w1")  # the restarted worker
        [e2] = await c2.read()
        assert (e2.id, e2.deliveries) == (sid, 2)
        side_effect(e2, fail=False)
        await c2.ack([e2.id])
        assert done == [sid]
        assert await pending_count(r, keys.prompts, PROMPTS_GROUP) == 0
        assert await c2.read() == []


CHILD = r"""
import asyncio, sys
from broker.keys import Keys
from broker.streams import StreamConfig, TrajectoryStream, connect, run_async

async def main(url, run_id):
    async with connect(url) as r:
        ts = TrajectoryStream(r, Keys(run_id=run_id), consumer="victim", config=StreamConfig(janitor_every_s=0))
        recs = await ts.read(count=4, block_ms=0)
        print(" ".join(x.stream_id for x in recs), flush=True)
        await asyncio.sleep(60)  # "training" on them until SIGKILL

run_async(main(sys.argv[1], sys.argv[2]))
"""


async def test_killed_consumer_entries_are_reclaimed_and_processed_once(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        producer = TrajectoryStream(r, keys)
        await producer.setup()
        ids = await producer.add([traj("g", i % 4, group_id="g" + str(i // 4), sample_id=f"s{i}") for i in range(10)])

        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", CHILD, redis_url, run_id, stdout=asyncio.subprocess.PIPE
        )
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
        finally:
            proc.kill()  # SIGKILL: no cleanup, no ack
            await proc.wait()
        victim_ids = line.decode().split()
        assert victim_ids == ids[:4]
        assert await pending_count(r, keys.trajectories, TRAJECTORIES_GROUP) == 4

        cfg = StreamConfig(claim_idle_ms=300, janitor_every_s=0.1, block_ms=100)
        trainer = TrajectoryStream(r, keys, consumer="survivor", config=cfg)
        seen: list[str] = []
        deliveries: dict[str, int] = {}
        deadline = time.monotonic() + 15
        while len(seen) < 10 and time.monotonic() < deadline:
            recs = await trainer.read()
            seen += [x.trajectory.sample_id for x in recs]
            deliveries.update({x.stream_id: x.deliveries for x in recs})
            await trainer.commit(recs)
        assert sorted(seen) == sorted(f"s{i}" for i in range(10))  # each exactly once
        assert [deliveries[i] for i in victim_ids] == [2, 2, 2, 2]  # reclaimed ones
        assert await pending_count(r, keys.trajectories, TRAJECTORIES_GROUP) == 0
        assert await trainer.read(block_ms=0) == []
        assert trainer.counters.duplicates == 0


async def test_entry_delivered_too_often_is_dead_lettered_by_the_janitor(redis_url, run_id):
    keys = Keys(run_id=run_id)
    cfg = StreamConfig(janitor_every_s=0, block_ms=0, claim_idle_ms=30, max_deliveries=3)
    async with connect(redis_url) as r:
        [sid] = await PromptQueue(r, keys).add([prompt(7)])
        a, b = consumer(r, keys, "a", cfg), consumer(r, keys, "b", cfg)
        assert [e.deliveries for e in await a.read()] == [1]
        for holder, expected in ((b, 2), (a, 3)):
            await asyncio.sleep(0.05)
            report = await holder.janitor()
            assert report.claimed == 1
            [e] = await holder.read()  # then "crashes" while processing: never acked
            assert (e.id, e.deliveries) == (sid, expected)
            holder._held.clear()  # forget it, as a dead process would
        await asyncio.sleep(0.05)
        report = await b.janitor()
        assert (report.claimed, report.dead_lettered) == (0, 1)
        assert await b.read() == []
        assert await pending_count(r, keys.prompts, PROMPTS_GROUP) == 0
        [dl] = await read_deadletter(r, keys)
        assert (dl.source, dl.source_id, dl.group, dl.deliveries) == (keys.prompts, sid, PROMPTS_GROUP, 4)
        assert "delivered 4 times" in dl.reason and "max_deliveries=3" in dl.reason
        assert decode_prompt_group(dl.fields[DATA_FIELD]).prompt_id == "p7"


async def test_poison_entry_in_a_restart_loop_is_dead_lettered(redis_url, run_id):
    keys = Keys(run_id=run_id)
    cfg = StreamConfig(janitor_every_s=0, block_ms=0, max_deliveries=2)
    async with connect(redis_url) as r:
        [sid] = await PromptQueue(r, keys).add([prompt(1)])
        for expected in (1, 2):  # each incarnation reads it and crashes
            [e] = await consumer(r, keys, "w", cfg).read()
            assert e.deliveries == expected
        assert await consumer(r, keys, "w", cfg).read() == []  # third delivery refused
        [dl] = await read_deadletter(r, keys)
        assert dl.source_id == sid and dl.deliveries == 3


async def test_janitor_leaves_entries_this_process_still_holds(redis_url, run_id):
    keys = Keys(run_id=run_id)
    cfg = StreamConfig(janitor_every_s=0, block_ms=0, claim_idle_ms=100)
    async with connect(redis_url) as r:
        await PromptQueue(r, keys).add([prompt(0)])
        a, b = consumer(r, keys, "a", cfg), consumer(r, keys, "b", cfg)
        [e] = await a.read()
        for _ in range(3):  # a renews its lease; neither a nor b takes the entry
            await asyncio.sleep(0.06)
            assert await a.keep_alive([e.id]) == [e.id]
            assert (await a.janitor()).claimed == 0
            assert (await b.janitor()).claimed == 0
        await asyncio.sleep(0.15)  # a stops renewing (e.g. it hangs): b takes over
        assert (await b.janitor()).claimed == 1
        [e2] = await b.read()
        assert (e2.id, e2.deliveries) == (e.id, 2)
        assert await a.keep_alive([e.id]) == []  # no longer a's
        await b.ack([e2.id])


async def test_trajectory_delivered_twice_is_counted_once(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        ts = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        t = traj("g1", 0)
        await ts.add([t, t])  # e.g. a worker retried its XADD
        recs = await ts.read()
        assert [x.trajectory.sample_id for x in recs] == [t.sample_id]
        assert ts.counters.duplicates == 1
        assert await ts.commit(recs) == 1

        await ts.add([t])  # e.g. the prompt was regenerated after a worker crash
        assert await ts.read() == []
        assert ts.counters.duplicates == 2
        assert await pending_count(r, keys.trajectories, TRAJECTORIES_GROUP) == 0


async def test_an_invalid_copy_read_with_the_real_sample_never_makes_it_a_duplicate(redis_url, run_id):
    """The caller's validation (`admit`) sees every record before any sample id is marked held: a
    forged copy of a genuine sample id ahead of it in the same batch is refused alone."""
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        ts = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        forged = [traj("g1", i, reward=1e300) for i in range(2)]
        real = [traj("g1", i) for i in range(2)]
        await ts.add([forged[0], forged[1], real[0], real[1], real[0]])  # one batch; the last: a re-sent copy
        refused = []

        def admit(rec) -> bool:
            if abs(rec.trajectory.reward) > 10:
                refused.append(rec.stream_id)
                return False
            return True

        recs = await ts.read(admit=admit)
        assert [x.trajectory.sample_id for x in recs] == [t.sample_id for t in real]
        assert [x.trajectory.reward for x in recs] == [0.0, 1.0] and len(refused) == 2
        assert ts.counters.duplicates == 1  # the re-sent copy only
        assert await ts.commit(recs) == 2


async def test_trainer_crash_between_checkpoint_and_commit_loses_and_repeats_nothing(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        ts = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        await ts.add([traj("g1", i) for i in range(4)])
        step1 = await ts.read(count=2)
        checkpoint = [(x.stream_id, x.trajectory.sample_id) for x in step1]  # saved with the step
        # crash before commit. Restart from the checkpoint: commit what it used, then read.
        ts2 = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        assert await ts2.commit_ids(checkpoint) == 2
        rest = await ts2.read()
        assert sorted(x.trajectory.sample_index for x in rest) == [2, 3]
        # crash before the next checkpoint: the uncommitted samples come back, still fresh
        ts3 = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        again = await ts3.read()
        assert sorted(x.trajectory.sample_index for x in again) == [2, 3]
        assert all(x.deliveries == 2 for x in again)
        await ts3.commit(again)
        assert await pending_count(r, keys.trajectories, TRAJECTORIES_GROUP) == 0


async def test_malformed_entries_are_dead_lettered_and_the_consumer_goes_on(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        ts = TrajectoryStream(r, keys, consumer="trainer", config=QUIET)
        await ts.setup()
        from broker.codec import encode_prompt_group

        bad = [
            await r.xadd(keys.trajectories, {DATA_FIELD: b"\x93garbage"}),
            await r.xadd(keys.trajectories, {b"other": b"1"}),
            await r.xadd(keys.trajectories, {DATA_FIELD: encode_prompt_group(prompt(0))}),
        ]
        [good] = await ts.add([traj("g", 0)])
        recs = await ts.read()
        assert [x.stream_id for x in recs] == [good]
        assert ts.counters.malformed == 3
        dls = await read_deadletter(r, keys)
        assert [d.source_id for d in dls] == [i.decode() for i in bad]
        assert all(d.reason.startswith("decode: ") for d in dls)
        assert "message" in dls[0].reason and "kind" in dls[2].reason
        assert dls[1].fields == {b"other": b"1"}
        await ts.commit(recs)
        [later] = await ts.add([traj("g", 1)])
        assert [x.stream_id for x in await ts.read()] == [later]


async def test_prompt_complete_adds_trajectories_and_acks_atomically(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        q = PromptQueue(r, keys, consumer="w1", config=QUIET)
        await q.setup()
        await q.add([prompt(3)])
        [rec] = await q.read()
        assert rec.group.task == {"answer": "3"} and rec.group.n_samples == 4
        trajs = [traj(rec.group.group_id, i) for i in range(rec.group.n_samples)]
        ids = await q.complete(rec, trajs)
        assert len(ids) == 4
        assert await pending_count(r, keys.prompts, PROMPTS_GROUP) == 0
        stored = await r.xrange(keys.trajectories)
        assert [decode_trajectory(f[DATA_FIELD]).sample_id for _, f in stored] == [t.sample_id for t in trajs]


async def test_janitor_trims_only_what_every_group_acked(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        ids = await add_entries(r, keys.prompts, [b"x"] * 6)
        c = consumer(r, keys, "w")
        got = await c.read(count=4)
        await c.ack([got[0].id, got[1].id, got[3].id])  # entry 2 still pending, 4 and 5 unread
        report = await c.janitor()
        assert report.trimmed == 2
        assert [i.decode() for i, _ in await r.xrange(keys.prompts)] == ids[2:]
        stats = await stream_stats(r, keys.prompts)
        assert stats["length"] == 4
        assert stats["groups"][PROMPTS_GROUP]["pending"] == 1 and stats["groups"][PROMPTS_GROUP]["lag"] == 2


async def test_read_blocks_for_new_entries_and_times_out(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        q = PromptQueue(r, keys, consumer="w", config=StreamConfig(janitor_every_s=0, block_ms=200))
        t0 = time.monotonic()
        assert await q.read() == []
        assert 0.15 <= time.monotonic() - t0 < 2.0

        async def later():
            await asyncio.sleep(0.1)
            await q.add([prompt(9)])

        task = asyncio.create_task(later())
        got = await q.read(block_ms=5000)
        await task
        assert [x.group.prompt_id for x in got] == ["p9"]
        assert (await q.stats())["groups"][PROMPTS_GROUP]["pending"] == 1


def test_config_validation_names_every_bad_value():
    with pytest.raises(ValueError) as e:
        StreamConfig(read_count=0, block_ms=60_000, max_deliveries=0)
    msg = str(e.value)
    assert "read_count=0" in msg and "block_ms=60000" in msg and "max_deliveries=0" in msg
