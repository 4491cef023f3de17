"""The fan-out tree over which a version reaches the rollout pool (relays: broker.relay).

With each version the trainer names the pool's members in order; member i (0-based) fetches from
member i // F - 1, the first F from the trainer itself, so the trainer sends F copies of a version
whatever the pool's size and a member sits about log_F(N) hops deep. A member's sources are its
ancestors, nearest first, then the trainer (TRAINER): a dead, slow or wrong relay sends the fetch
on to the next one. A member not named (it joined since the publish) is seeded from a peer, not the
trainer: a stable pick of a named member (the sha256 of its id), then that member's sources.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

TRAINER = ""  # the trainer's place in a list of sources


def sources(members: Sequence[str], degree: int, member: str) -> list[str]:
    """Where `member` fetches a version from, in order: its ancestors in the tree of `degree`
    over `members` (nearest first), then TRAINER. A member not in `members`: `stranger_pick`'s
    member, then that member's own sources."""
    if degree < 1:
        raise ValueError(f"fan-out degree {degree} (want >= 1)")
    if member not in members:
        if not members:
            return [TRAINER]
        seed = stranger_pick(members, member)
        return [seed, *sources(members, degree, seed)]
    chain, i = [], list(members).index(member)
    while (i := i // degree - 1) >= 0:
        chain.append(members[i])
    return [*chain, TRAINER]


def stranger_pick(members: Sequence[str], member: str) -> str:
    """The named member a stranger (`member` not in `members`) is seeded from: the same one for the
    same id and tree, spread over the tree by the sha256 of the id."""
    h = int.from_bytes(hashlib.sha256(member.encode()).digest()[:8], "big")
    return members[h % len(members)]


def trainer_children(members: Sequence[str], degree: int) -> list[str]:
    """The members that fetch from the trainer itself: its egress is len() copies a version."""
    return list(members[:degree])
