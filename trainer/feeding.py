"""Prompt feeding's rules, as pure functions: did Redis lose what the trainer fed, and how many
groups are queued (no Redis, no clock, no I/O; the trainer reads the inputs, tests/unit/test_feeding.py).

    redis_lost(nonce_seen, seq_seen, *, nonce, prompt_seq) -> why | None
    queued_groups(prompt_backlog, trajectory_backlog, *, consumed, group_size, outstanding) -> int
    min_start_version(version, *, max_staleness) -> int

1. Redis lost data when its copy of this trainer's incarnation nonce is not `nonce`, or its copy
   of the prompt sequence position is not `prompt_seq` (once anything was fed). The trainer then
   feeds every outstanding group again and writes a new nonce. Why both: `redis_lost`.
2. Queued groups, as Redis counts them: the prompts group's entries not acked (never delivered +
   pending at a worker) plus, in whole groups, the trajectories group's entries not acked that the
   trainer has not consumed or refused yet (`consumed`: those still in Redis).
3. Where Redis has no such group (None: it lost it and no consumer made it again yet), its count
   says nothing and an empty Redis must not read as room: every group fed and not settled
   (`outstanding`) counts as queued. The trainer feeds `queued_groups(...)` up to its bound.
4. A group fed while the trainer is at version P (its newest, perhaps still publishing in the
   background) is trained by version P + max(0, max_staleness - 1): the bound above keeps at most
   max(1, max_staleness) steps of groups queued (the default `trainer.prompts_ahead`), trained first
   in, first out. It carries `min_version` = P - min(1, max_staleness), the oldest version a rollout
   may start it under, so its oldest token is at most max_staleness old when trained. Without it a
   worker still on the version announced before P, or an older one, would generate a group only for
   it to be dropped as stale.
"""

from __future__ import annotations


def redis_lost(nonce_seen: bytes | None, seq_seen: bytes | None, *, nonce: str, prompt_seq: int) -> str | None:
    """One line saying what Redis lost (rule 1), or None when it still holds this trainer's markers.

    The nonce is random and written only when the trainer starts and after it handled a loss, so a
    write retried through an outage (broker.outage) cannot bring it back after a wipe; the
    prompt_seq SET after every feed can, so prompt_seq alone misses wipes. prompt_seq still catches
    a failover that lost only the last writes."""
    if nonce_seen is None or nonce_seen.decode(errors="replace") != nonce:
        return "this trainer's nonce is gone" if nonce_seen is None else "this trainer's nonce was replaced"
    if prompt_seq > 0 and (seq_seen is None or seq_seen != str(prompt_seq).encode()):
        return f"its prompt_seq is {seq_seen.decode(errors='replace') if seq_seen else None}, ours {prompt_seq}"
    return None


def queued_groups(
    prompt_backlog: int | None, trajectory_backlog: int | None, *, consumed: int, group_size: int, outstanding: int
) -> int:
    """Groups fed and not yet consumed (rules 2 and 3). Backlogs are a group's lag + pending entries,
    None where Redis has no such group."""
    if prompt_backlog is None or trajectory_backlog is None:
        return outstanding
    return prompt_backlog + max(0, trajectory_backlog - consumed) // group_size


def min_start_version(version: int, *, max_staleness: int) -> int:
    """Rule 4: the `min_version` of a group fed while the trainer is at `version`."""
    return max(0, version - min(1, max_staleness))
