"""trainer.collector on a real Redis: a step's groups collected with the stale, foreign and invalid
samples dropped under their own reasons, and committed (dead letters, idempotency keys) afterwards."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from broker.codec import PromptGroup, Trajectory, sample_id_for
from broker.keys import Keys
from broker.streams import StreamConfig, TrajectoryStream, connect, read_deadletter
from trainer.collector import Collector
from trainer.ledger import PromptLedger
from trainer.state import State
from trainer.validation import TrajectoryRules

pytestmark = pytest.mark.integration

FP = "f" * 64
RULES = TrajectoryRules(group_size=2, vocab_size=16, max_seq_len=16, max_completion_tokens=4, max_abs_reward=10.0)


def make_prompt(i: int) -> PromptGroup:
    return PromptGroup(prompt_id=f"p{i}", group_id=f"p{i}", prompt_tokens=np.array([1, i], np.int32), n_samples=2)


def sample(i: int, index: int, *, version: int = 3, fingerprint: str = FP, prompt=None) -> Trajectory:
    group = f"p{i}"
    return Trajectory(
        sample_id=sample_id_for(group, index), prompt_id=group, group_id=group, sample_index=index, group_size=2,
        prompt_tokens=np.array(prompt or [1, i], np.int32), completion_tokens=np.array([3, 4], np.int32),
        behavior_logprobs=np.array([-0.5, -0.25], np.float32), reward=float(index), policy_version=version,
        contract_fingerprint=fingerprint, worker_id="w", created_at=0.0,
    )  # fmt: skip


async def test_a_step_is_collected_drops_keep_their_reasons_and_commit_follows(redis_url, run_id):
    keys = Keys(run_id=run_id)
    async with connect(redis_url) as r:
        stream = TrajectoryStream(r, keys, consumer="trainer", config=StreamConfig(block_ms=50))
        await stream.setup()
        state = State(version=3)
        ledger = PromptLedger(state, make_prompt)
        ledger.feed(4)
        lines: list[str] = []
        collector = Collector(
            stream, ledger, rules=RULES, fingerprint=FP, max_staleness=1, groups_per_step=1, timeout_s=5.0,
            log=lines.append,
        )  # fmt: skip
        worker = TrajectoryStream(r, keys)
        await worker.add([
            sample(1, 0, version=1),  # staleness 2 > 1: dropped as stale, its group settled as dropped
            sample(2, 0, fingerprint="e" * 64),  # another contract
            sample(3, 0, prompt=[1, 9]),  # not the prompt fed as p3
            sample(0, 1), sample(0, 0),  # p0 complete
            sample(3, 1),  # half of p3: held for a later step
        ])  # fmt: skip
        feeds = []

        async def feed():
            feeds.append(1)

        groups = await collector.collect(feed=feed, stop=asyncio.Event())
        assert [[t.sample_id for t in g] for g in groups] == [["p0/0", "p0/1"]]  # sorted by sample_index
        assert feeds, "feed runs after every read"
        assert (state.dropped_stale, state.dropped_fingerprint, state.invalid) == (1, 1, 1)
        assert sorted(sid for _, sid in state.pending_commit) == ["p0/0", "p0/1", "p1/0"]
        assert state.dropped_unaudited == ["p1"] and sorted(state.outstanding) == ["p2", "p3"]
        assert collector.held_groups() == {"p3"} and len(collector.held_ids()) == 1
        assert len(list(collector.uncommitted_ids())) == 3 + 2  # consumed, and refused (not yet dead-lettered)
        assert len(lines) == 1 and "differ from the prompt fed as 'p3'" in lines[0]

        await collector.commit()
        assert state.pending_commit == []
        reasons = sorted(d.reason for d in await read_deadletter(r, keys))
        assert len(reasons) == 2
        assert reasons[0].startswith("contract fingerprint eeeeeeeeeeee != trainer's ffffffffffff")
        assert reasons[1].startswith("invalid: prompt_tokens")

        # A sample of a group already used, under a new entry: a duplicate, consumed; a stop ends the collect.
        await worker.add([sample(0, 1)])
        await r.delete(*[k async for k in r.scan_iter(keys.prefix + "seen:*")])  # Redis forgot what was used
        stop = asyncio.Event()

        async def feed_then_stop():
            stop.set()

        assert await collector.collect(feed=feed_then_stop, stop=stop) is None
        assert state.duplicates == 1 and [sid for _, sid in state.pending_commit] == ["p0/1"]
        assert collector.counters()["duplicates"] == 1
