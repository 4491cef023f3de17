"""trainer.feeder on a real Redis: prompts fed up to the bound, fed again after Redis lost them
(the nonce gone), adopted from a previous process, and settled when the workers dead-letter them."""

from __future__ import annotations

import numpy as np
import pytest

from broker.codec import PromptGroup
from broker.keys import Keys
from broker.streams import PromptQueue, StreamConfig, TrajectoryStream, connect
from trainer.collector import Collector
from trainer.feeder import PromptFeeder
from trainer.ledger import PromptLedger
from trainer.state import State
from trainer.validation import TrajectoryRules

pytestmark = pytest.mark.integration

RULES = TrajectoryRules(group_size=2, vocab_size=16, max_seq_len=16, max_completion_tokens=4, max_abs_reward=10.0)


def make_prompt(i: int) -> PromptGroup:
    return PromptGroup(prompt_id=f"p{i}", group_id=f"p{i}", prompt_tokens=np.array([1, i], np.int32), n_samples=2)


def _feeder(r, keys, state: State, lost: list, lines: list) -> PromptFeeder:
    prompts = PromptQueue(r, keys)
    stream = TrajectoryStream(r, keys, consumer="trainer", config=StreamConfig(block_ms=50))
    ledger = PromptLedger(state, make_prompt)
    collector = Collector(
        stream, ledger, rules=RULES, fingerprint="f" * 64, max_staleness=1, groups_per_step=1, timeout_s=5.0
    )

    async def on_lost():
        lost.append(1)

    return PromptFeeder(
        r, keys, prompts, stream, ledger, collector, target=3, group_size=2, max_staleness=2,
        on_lost=on_lost, log=lines.append,
    )  # fmt: skip


async def test_feeding_to_the_bound_and_again_after_redis_lost_everything(redis_url, run_id):
    keys, state, lost, lines = Keys(run_id=run_id), State(version=5), [], []
    async with connect(redis_url) as r:
        feeder = _feeder(r, keys, state, lost, lines)
        await feeder.prompts.setup()
        await feeder.stream.setup()
        await feeder.reconcile()
        await feeder.feed()
        await feeder.feed()  # 3 queued already: nothing more
        assert state.prompt_seq == 3 and sorted(state.outstanding) == ["p0", "p1", "p2"]
        assert await r.xlen(keys.prompts) == 3 and await r.get(keys.prefix + "prompt_seq") == b"3"
        # A worker takes one and dead-letters it (a prompt it cannot run): settled as dropped.
        worker = PromptQueue(r, keys, consumer="w0")
        [taken] = await worker.read(count=1, block_ms=10)
        assert taken.group.min_version == 4  # fed at version 5, max_staleness 2: start under 4 or later
        await worker.dead_letter(taken, "cannot run")
        await feeder.settle_dead_lettered()
        assert state.prompts_dead_lettered == 1 and state.dropped_unaudited == [taken.group.group_id]
        assert taken.group.group_id not in state.outstanding
        await feeder.feed()  # room for one more
        assert state.prompt_seq == 4 and len(state.outstanding) == 3
        # Redis loses the run's keys: the next feed notices (the nonce is gone) and feeds the outstanding
        # again, each with the min_version of now.
        await r.delete(*[k async for k in r.scan_iter(keys.prefix + "*")])
        state.version = 8
        await feeder.feed()
        assert state.refed == 3 and lost == [1] and state.prompt_seq == 4
        assert await r.xlen(keys.prompts) == 3
        await worker.setup()
        assert {p.group.min_version for p in await worker.read(count=3, block_ms=10)} == {7}
        assert any(line.startswith("Redis lost its data (this trainer's nonce is gone)") for line in lines)


async def test_a_restart_adopts_the_prompts_fed_after_its_checkpoint(redis_url, run_id):
    keys, lost, lines = Keys(run_id=run_id), [], []
    async with connect(redis_url) as r:
        first = _feeder(r, keys, State(), lost, lines)
        await first.prompts.setup()
        await first.stream.setup()
        await first.reconcile()
        await first.feed()
        # The checkpoint said prompt_seq 1 (p0 outstanding); Redis says 3: p1 and p2 were fed since.
        state = State(prompt_seq=1, outstanding={"p0": 0})
        await _feeder(r, keys, state, lost, lines).reconcile()
        assert state.prompt_seq == 3 and sorted(state.outstanding) == ["p0", "p1", "p2"] and state.refed == 0
        # Behind the checkpoint (Redis lost the last writes): everything outstanding is fed again.
        await r.set(keys.prefix + "prompt_seq", 2)
        behind = State(prompt_seq=3, outstanding={"p1": 1, "p2": 2})
        await _feeder(r, keys, behind, lost, lines).reconcile()
        assert behind.refed == 2 and lost == [1]
