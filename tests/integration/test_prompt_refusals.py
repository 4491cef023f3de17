"""The prompts stream on a real Redis: with the run secret a worker's PromptQueue dead-letters an
unsigned, badly signed or undecodable prompt entry alone, with its reason, acks it (it never comes
back) and counts it; and a prompt reclaimed from dead consumers more than max_deliveries times is
dead-lettered, never handed to the next worker, while one reclaimed fewer times still is."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from broker.codec import PromptGroup, encode_prompt_group
from broker.keys import Keys
from broker.signing import PROMPT, TRAJECTORY, Signer
from broker.streams import DATA_FIELD, SIG_FIELD, PromptQueue, StreamConfig, connect, read_deadletter
from rollout.config import RolloutConfig
from rollout.worker import prompt_stream_config

pytestmark = pytest.mark.integration

SIGNER = Signer(b"k" * 32)
QUIET = StreamConfig(janitor_every_s=0, block_ms=10, read_count=16)


def _prompt(i: int) -> PromptGroup:
    return PromptGroup(
        prompt_id=f"p{i}", group_id=f"p{i}", prompt_tokens=np.array([1, 4, 5], dtype=np.int32), n_samples=4,
        task={"answer": "9"},
    )  # fmt: skip


async def test_worker_queue_refuses_unsigned_forged_and_garbage_prompts_alone(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        worker = PromptQueue(r, keys, consumer="w0", config=QUIET, signer=SIGNER)
        await worker.setup()
        trainer = PromptQueue(r, keys, signer=SIGNER)
        await trainer.add([_prompt(0)])  # the trainer, with the secret
        await PromptQueue(r, keys).add([_prompt(1)])  # anyone who can write Redis
        payload = encode_prompt_group(_prompt(2))
        await r.xadd(keys.prompts, {DATA_FIELD: payload, SIG_FIELD: Signer(b"x" * 32).sign(PROMPT, payload)})
        # A trajectory's tag over the same bytes: the domain keeps it from verifying as a prompt.
        await r.xadd(keys.prompts, {DATA_FIELD: payload, SIG_FIELD: SIGNER.sign(TRAJECTORY, payload)})
        await r.xadd(keys.prompts, {DATA_FIELD: b"\x93not msgpack", SIG_FIELD: SIGNER.sign(PROMPT, b"\x93not msgpack")})
        await trainer.add([_prompt(3)])

        got = await worker.read()
        assert [rec.group.group_id for rec in got] == ["p0", "p3"]
        assert (worker.counters.unsigned, worker.counters.malformed) == (3, 1)
        reasons = [d.reason for d in await read_deadletter(r, keys)]
        assert len(reasons) == 4, reasons
        assert reasons[0].startswith("unsigned") and reasons[3].startswith("decode")
        assert all(x.startswith("bad signature") for x in reasons[1:3]), reasons
        # Acked with their dead letter: only the two good prompts are pending, nothing comes back.
        assert (await r.xpending(keys.prompts, "rollout"))["pending"] == 2
        await worker.ack(got)
        assert await PromptQueue(r, keys, consumer="w1", config=QUIET, signer=SIGNER).read() == []
        assert len(await read_deadletter(r, keys)) == 4


async def test_a_prompt_reclaimed_too_often_is_dead_lettered_not_handed_on(redis_url, run_id):
    """The worker's prompt stream (rollout.max_prompt_deliveries=3): delivered to w0 and reclaimed by
    w1 and w2, each of which died holding it, the prompt still reaches w2; the janitor of w3, which
    would be its 4th holder, dead-letters it instead."""
    keys = Keys(run_id=run_id)
    cfg = dataclasses.replace(prompt_stream_config(RolloutConfig(reclaim_idle_s=0.001)), janitor_every_s=0)
    async with connect(redis_url) as r:
        queues = [PromptQueue(r, keys, consumer=f"w{i}", config=cfg, signer=SIGNER) for i in range(4)]
        await queues[0].setup()
        await PromptQueue(r, keys, signer=SIGNER).add([_prompt(7)])
        assert [rec.deliveries for rec in await queues[0].read()] == [1]  # then w0 is SIGKILLed
        for n, q in ((2, queues[1]), (3, queues[2])):  # each reclaims it from the dead one before it
            await asyncio.sleep(0.01)  # idle past claim_idle_ms
            report = await q.janitor()
            assert report.claimed == 1 and report.dead_lettered == 0
            assert [(rec.group.group_id, rec.deliveries) for rec in await q.read()] == [("p7", n)]
        await asyncio.sleep(0.01)
        report = await queues[3].janitor()
        assert (report.claimed, report.dead_lettered) == (0, 1)
        assert await queues[3].read() == [] and queues[3].counters.dead_lettered == 1
        [dead] = await read_deadletter(r, keys)
        assert dead.reason == "delivered 4 times (max_deliveries=3)" and dead.consumer == "w3"
        assert (await r.xpending(keys.prompts, "rollout"))["pending"] == 0
