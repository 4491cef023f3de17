"""Feeding prompts: keep about `target` prompt groups queued or in flight, and notice when Redis
lost what was fed (the rules: trainer.feeding; the bookkeeping: trainer.ledger).

1. At start (`reconcile`) this incarnation's random nonce is written; prompts the previous process
   fed after its checkpoint, and still marked in Redis, are adopted; if Redis's prompt_seq marker is
   missing or behind, every outstanding group is fed again.
2. Before every feed the markers are read; a loss (trainer.feeding rule 1) feeds every outstanding
   group again under a new nonce and points policy:latest anew (it may be gone too).
3. Fed groups the workers dead-lettered (a prompt they cannot run) are settled as dropped, counted,
   never fed again, unless some of their samples are held (a worker cut off from Redis finished
   the group after all).
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable

from broker.codec import CodecError, decode_prompt_group
from broker.keys import Keys
from broker.streams import DATA_FIELD, DeadLetter, PromptQueue, TrajectoryStream, read_deadletter

from . import feeding
from .collector import Collector
from .ledger import PromptLedger


class PromptFeeder:
    def __init__(
        self,
        redis,
        keys: Keys,
        prompts: PromptQueue,
        stream: TrajectoryStream,
        ledger: PromptLedger,
        collector: Collector,
        *,
        target: int,
        group_size: int,
        max_staleness: int,
        on_lost: Callable[[], Awaitable[None]],
        log: Callable[[str], None] = print,
    ):
        """target: the groups to keep queued; max_staleness: loop.max_staleness (each group's
        min_version, trainer.feeding rule 4); on_lost: called after Redis lost its data (rule 2)."""
        self.redis, self.keys, self.prompts, self.stream = redis, keys, prompts, stream
        self.ledger, self.collector, self.state = ledger, collector, ledger.state
        self.target, self.group_size, self.max_staleness = target, group_size, max_staleness
        self.on_lost, self.log = on_lost, log
        self._seq_key = keys.prefix + "prompt_seq"  # Redis's copy of State.prompt_seq: gone = Redis lost data
        self._nonce_key = keys.prefix + "trainer_nonce"  # this incarnation's mark: no retried write restores it
        self._nonce = secrets.token_hex(16)
        self._lost_ids: set[str] = set()  # stream ids read before Redis last lost its data
        self._deadletter_from = "-"  # the dead-letter stream is read from here on

    async def reconcile(self) -> None:
        """Rule 1."""
        await self.redis.set(self._nonce_key, self._nonce)
        raw = await self.redis.get(self._seq_key)
        marker = None if raw is None else int(raw)
        if marker is not None and marker >= self.state.prompt_seq:
            self.ledger.adopt(marker)
        elif self.state.prompt_seq > 0:
            await self._refeed(f"prompt_seq in Redis is {marker}, the checkpoint's {self.state.prompt_seq}")

    async def feed(self) -> None:
        """Rule 2, then feed up to `target` queued groups (trainer.feeding rules 2-3)."""
        seen = await self.redis.mget([self._nonce_key, self._seq_key])
        lost = feeding.redis_lost(*seen, nonce=self._nonce, prompt_seq=self.state.prompt_seq)
        if lost is not None:
            await self._refeed(lost)
        queued = feeding.queued_groups(
            _group_backlog(await self.prompts.stats(), self.prompts.group),
            _group_backlog(await self.stream.stats(), self.stream.group),
            consumed=sum(sid not in self._lost_ids for sid in self.collector.uncommitted_ids()),
            group_size=self.group_size,
            outstanding=len(self.state.outstanding),
        )
        want = self.target - queued
        if want > 0:
            await self.prompts.add(self.ledger.feed(want, min_version=self._min_version()))
            await self.redis.set(self._seq_key, self.state.prompt_seq)
            self.ledger.overflow(20 * self.target + 100)

    def _min_version(self) -> int:
        return feeding.min_start_version(self.state.version, max_staleness=self.max_staleness)

    async def _refeed(self, why: str) -> None:
        """A new nonce (a later loss is seen again), every outstanding group fed again (also those whose
        samples are held: a copy completes whatever is missing, the rest are dropped as duplicates), and
        the samples read so far no longer counted as Redis's."""
        self._nonce = secrets.token_hex(16)
        await self.redis.set(self._nonce_key, self._nonce)
        self._lost_ids = {*self.collector.uncommitted_ids(), *self.collector.held_ids()}
        groups = self.ledger.outstanding_groups(min_version=self._min_version())
        await self.prompts.add(groups)
        await self.redis.set(self._seq_key, self.state.prompt_seq)
        self.state.refed += len(groups)
        self.log(f"Redis lost its data ({why}): fed the {len(groups)} outstanding groups again")
        await self.on_lost()

    async def settle_dead_lettered(self) -> None:
        """Rule 3."""
        held = self.collector.held_groups()
        while True:
            dead = await read_deadletter(self.redis, self.keys, count=256, start=self._deadletter_from)
            if not dead:
                return
            self._deadletter_from = "(" + dead[-1].id
            for d in dead:
                group_id = self._fed_group_of(d)
                if group_id is not None and group_id not in held:
                    self.ledger.settle(group_id, dropped=True)
                    self.state.prompts_dead_lettered += 1
                    self.log(f"prompt {group_id!r} dead-lettered by {d.consumer[:40]!r} ({d.reason[:200]}): dropped")
            if len(dead) < 256:
                return

    def _fed_group_of(self, dead: DeadLetter) -> str | None:
        """The outstanding group a dead letter holds: the very prompt fed under its group id (a
        refused forgery borrowing the id leaves the real prompt outstanding); else None."""
        if dead.source != self.keys.prompts:
            return None
        try:
            group = decode_prompt_group(dead.fields.get(DATA_FIELD))
        except CodecError:
            return None  # not a prompt of ours
        return group.group_id if self.ledger.fed_as(group) else None


def _group_backlog(stats: dict, group: str) -> int | None:
    """Entries of `group` not yet acked: never delivered (lag) plus delivered and pending; None where
    Redis has no such group (it lost it)."""
    g = stats["groups"].get(group)
    return None if g is None else g["lag"] + g["pending"]
