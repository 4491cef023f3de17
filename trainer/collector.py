"""Collecting a step's trajectory groups from the trajectories stream, and committing them later.

1. `collect` reads until `groups_per_step` complete, admissible groups are held (the rules:
   trainer.admission); before admission sees a record, trainer.validation checks it against the
   prompt fed under its group id (trainer.ledger). Every record consumed (trained, or dropped as
   stale) joins State.pending_commit; trained and dropped groups are settled in the ledger.
2. A refused sample (wrong fingerprint, invalid) is counted at once and dead-lettered with its
   reason at the next commit (so a crash recounts it once); it never takes its sample id from a
   genuine copy. A sample of a group already settled is a duplicate: counted and committed.
3. `commit` (after a checkpoint that includes them): dead-letter the refused samples, then mark
   every pending sample used (idempotency keys + XACK).
4. A stop request ends `collect` with None; no complete group for `timeout_s`: TimeoutError.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Iterator

from broker.codec import Trajectory
from broker.streams import TrajectoryRecord, TrajectoryStream

from . import admission
from .ledger import PromptLedger
from .validation import TrajectoryRules, check_trajectory

COUNTERS = ("duplicates", "malformed", "invalid", "dead_lettered", "unsigned", "refed", "prompts_dead_lettered")


class Collector:
    def __init__(
        self,
        stream: TrajectoryStream,
        ledger: PromptLedger,
        *,
        rules: TrajectoryRules,
        fingerprint: str,
        max_staleness: int,
        groups_per_step: int,
        timeout_s: float,
        log: Callable[[str], None] = print,
    ):
        """fingerprint: the contract fingerprint accepted from the rollouts."""
        self.stream, self.ledger, self.state, self.rules = stream, ledger, ledger.state, rules
        self.fingerprint, self.max_staleness, self.groups_per_step = fingerprint, max_staleness, groups_per_step
        self.timeout_s, self.log = timeout_s, log
        self._backlog = admission.Backlog()  # incomplete groups and surplus complete ones, between steps
        self._rejected: list[tuple[TrajectoryRecord, str]] = []  # dead-lettered at the next commit
        self._consumed: list[TrajectoryRecord] = []  # consumed by the collect in progress

    def held_groups(self) -> set[str]:
        """Groups some of whose samples are held for a later step."""
        return self._backlog.group_ids

    def held_ids(self) -> list[str]:
        """Stream ids of the samples held for a later step."""
        return [r.stream_id for g in (*self._backlog.incomplete.values(), *self._backlog.complete) for r in g]

    def uncommitted_ids(self) -> Iterator[str]:
        """Stream ids of the samples consumed or refused and not yet committed (Redis still lists them)."""
        yield from (sid for sid, _ in self.state.pending_commit)
        yield from (r.stream_id for r in self._consumed)
        yield from (r.stream_id for r, _ in self._rejected)

    async def collect(
        self, *, feed: Callable[[], Awaitable[None]], stop: asyncio.Event
    ) -> list[list[Trajectory]] | None:
        """Rules 1, 2 and 4; `feed` runs after every read."""
        consumed = self._consumed = []
        deadline = time.monotonic() + self.timeout_s
        records: list[TrajectoryRecord] | None = None  # first pass: the backlog alone, at this version
        while True:
            decision = admission.admit(
                self._backlog,
                records or [],
                version=self.state.version,
                max_staleness=self.max_staleness,
                fingerprint=self.fingerprint,
                groups_per_step=self.groups_per_step,
            )
            self._backlog = decision.backlog
            self._drop(decision.drops, consumed)
            if records is not None:
                await feed()
            if decision.train or stop.is_set():
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"no complete trajectory group for {self.timeout_s}s: are rollout workers running?")
            records = await self.stream.read(admit=functools.partial(self._admissible, consumed=consumed))
        consumed += [r for g in decision.train for r in g]
        self.state.pending_commit += [(r.stream_id, r.trajectory.sample_id) for r in consumed]
        self._consumed = []
        for g in decision.train:
            self.ledger.settle(g[0].trajectory.group_id, dropped=False)
        return [[r.trajectory for r in g] for g in decision.train] or None

    def _drop(self, drops: list[admission.Drop], consumed: list[TrajectoryRecord]) -> None:
        held = self._backlog.group_ids
        for drop in drops:
            t = drop.record.trajectory
            if drop.reason == admission.FINGERPRINT:
                self.state.dropped_fingerprint += 1
                self._reject(
                    drop.record,
                    f"contract fingerprint {t.contract_fingerprint[:12]} != trainer's {self.fingerprint[:12]}",
                )
            else:
                self.state.dropped_stale += 1
                consumed.append(drop.record)
                if t.group_id not in held:
                    self.ledger.settle(t.group_id, dropped=True)

    def _admissible(self, rec: TrajectoryRecord, consumed: list) -> bool:
        """Whether admission may see `rec` (called by the stream's read on every decoded record, before
        it marks any sample id held): rule 2. Samples admission drops (another contract, too stale)
        pass, to be counted under their own reason."""
        t = rec.trajectory
        stale = admission.staleness(self.state.version, rec) > self.max_staleness
        if t.contract_fingerprint != self.fingerprint or stale:
            return True
        fed = self.ledger.fed_prompt(t.group_id)
        if fed is None and self.ledger.settled_recently(t.group_id):
            # Already used or dropped, and Redis forgot its idempotency key (lost writes).
            self.state.duplicates += 1
            consumed.append(rec)
            return False
        reason = check_trajectory(t, self.rules, version=self.state.version, fed_prompt=fed)
        if reason is None:
            return True
        self.state.invalid += 1
        self._reject(rec, f"invalid: {reason}")
        if self.state.invalid <= 10 or self.state.invalid % 1000 == 0:  # a flood is not a log flood
            self.log(f"refused sample {t.sample_id[:80]!r} from {t.worker_id[:40]!r} (#{self.state.invalid}): {reason}")
        return False

    def _reject(self, rec: TrajectoryRecord, reason: str) -> None:
        """Dead-lettered at the next commit (not marked used: its sample id may come again, for real)."""
        self._rejected.append((rec, reason))
        self.stream.forget(rec)

    async def commit(self) -> None:
        """Rule 3."""
        for rec, reason in self._rejected:
            await self.stream.dead_letter(rec, reason)
        self._rejected = []
        await self.stream.commit_ids([tuple(p) for p in self.state.pending_commit])
        self.state.pending_commit = []

    def counters(self) -> dict:
        """Run totals of everything refused or dropped (the stream's counts moved into the State)."""
        c, s = self.stream.counters, self.state
        for name in ("duplicates", "malformed", "dead_lettered", "unsigned"):
            setattr(s, name, getattr(s, name) + getattr(c, name))
            setattr(c, name, 0)
        return {k: getattr(s, k) for k in COUNTERS}
