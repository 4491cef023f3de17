"""Admission: which trajectories a step trains on, as a pure function (no Redis, no clock, no I/O).

    admit(backlog, records, *, version, max_staleness, fingerprint, groups_per_step)
        -> Admission(train, drops, backlog)

A sample's staleness is that of its oldest token: version - oldest_version (the first token's
version; every token's under drain-on-swap, where a sample has one). With in-flight updates its
later tokens are newer, so bounding the oldest bounds every token.

Rules, in order:
1. A backlog group with a sample now too old (staleness > max_staleness) is dropped whole: "stale".
2. Each new record: a contract fingerprint other than the trainer's -> "fingerprint"; too old ->
   "stale"; else it joins its group (by group_id). A group is complete with group_size samples,
   then ordered by sample_index.
3. With at least `groups_per_step` complete groups, the first `groups_per_step` (in completion
   order, backlog first) are trained on; surplus complete groups stay in the backlog. Otherwise
   nothing is trained and everything stays.
Calling again with the returned backlog continues; with no records it re-applies rule 1. What the
trainer has consumed (to commit) is drops + trained groups. Modelled on torchtitan's RL batcher."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

STALE = "stale"
FINGERPRINT = "fingerprint"


@dataclass(frozen=True)
class Drop:
    record: Any
    reason: str  # STALE or FINGERPRINT


@dataclass(frozen=True)
class Backlog:
    """What admission holds between calls: incomplete groups by group_id, complete groups not yet trained."""

    incomplete: dict[str, tuple] = field(default_factory=dict)  # group_id -> records so far, arrival order
    complete: tuple[tuple, ...] = ()  # complete groups (sorted by sample_index), in completion order

    @property
    def num_records(self) -> int:
        return sum(len(g) for g in self.incomplete.values()) + sum(len(g) for g in self.complete)

    @property
    def group_ids(self) -> set[str]:
        """The groups some of whose samples are held."""
        return set(self.incomplete) | {g[0].trajectory.group_id for g in self.complete}


@dataclass(frozen=True)
class Admission:
    train: list[list[Any]]  # groups to train on now: [] or exactly groups_per_step groups
    drops: list[Drop]
    backlog: Backlog


def staleness(version: int, record) -> int:
    """Versions between `version` and the record's oldest token."""
    return version - record.trajectory.oldest_version


def admit(
    backlog: Backlog,
    records: Sequence[Any],
    *,
    version: int,
    max_staleness: int,
    fingerprint: str,
    groups_per_step: int,
) -> Admission:
    """Apply the rules of the module docstring; the inputs are not modified.

    `backlog`: what earlier calls carried over (incomplete groups, and complete groups not yet
    trained); `records`: the newly read records, anything with a `.trajectory` (a
    `broker.codec.Trajectory`; the trainer passes `broker.streams.TrajectoryRecord`s). Record
    validation (well-formed samples of this run) comes before admission and drops with its own
    reasons; the reasons here are `STALE` and `FINGERPRINT`."""
    if groups_per_step < 1 or max_staleness < 0:
        raise ValueError(f"admit: groups_per_step={groups_per_step} must be >= 1, max_staleness={max_staleness} >= 0")
    drops: list[Drop] = []

    def fresh(group) -> bool:
        if max(staleness(version, r) for r in group) > max_staleness:
            drops.extend(Drop(r, STALE) for r in group)
            return False
        return True

    complete = [list(g) for g in backlog.complete if fresh(g)]
    incomplete = {gid: list(g) for gid, g in backlog.incomplete.items() if fresh(g)}
    for rec in records:
        t = rec.trajectory
        if t.contract_fingerprint != fingerprint:
            drops.append(Drop(rec, FINGERPRINT))
            continue
        if staleness(version, rec) > max_staleness:
            drops.append(Drop(rec, STALE))
            continue
        group = incomplete.setdefault(t.group_id, [])
        group.append(rec)
        if len(group) == t.group_size:
            complete.append(sorted(incomplete.pop(t.group_id), key=lambda r: r.trajectory.sample_index))
    train, rest = (
        (complete[:groups_per_step], complete[groups_per_step:]) if len(complete) >= groups_per_step else ([], complete)
    )
    return Admission(
        train=train,
        drops=drops,
        backlog=Backlog(
            incomplete={g: tuple(r) for g, r in incomplete.items()}, complete=tuple(tuple(g) for g in rest)
        ),
    )
