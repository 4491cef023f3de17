"""Where a rollout worker fetches a version from, in order: a pure rule (no I/O).

Rules:
1. The pointer's tree first (broker.fanout, signed with the pointer): this worker's relay
   ancestors, nearest first; a worker the pointer does not name (joined since) starts at a peer.
2. The trainer last, always: `rollout.policy_address` where configured, else the pointer's address
   (VersionSwap.source; a trainer source distrusted for the version is refused by the swap itself).
3. Left out: a relay that served other content for this (version, digest) (`distrusted`, entries
   (version, source, content digest)), this worker's own relay, and a source named twice.
A wrong relay address costs a fetch attempt, never a version: every source's bytes are checked
against the signed content digest.
"""

from __future__ import annotations

from collections.abc import Collection

from broker.registry import PolicyPointer


def fetch_sources(
    pointer: PolicyPointer,
    member: str,
    *,
    policy_address: str = "",
    distrusted: Collection[tuple[int, str, str]] = (),
    own_address: str = "",
) -> list[str]:
    """The addresses `member` asks for `pointer`'s version, in order; the last is the trainer's."""
    trainer = policy_address or pointer.address
    relays = pointer.sources(member)[:-1] if pointer.fanout else []
    out: list[str] = []
    for address in relays:
        if address in (trainer, own_address) or address in out:
            continue
        if (pointer.version, address, pointer.content_digest) in distrusted:
            continue
        out.append(address)
    return [*out, trainer]
