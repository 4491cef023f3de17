"""Redis key names of one Tandem run: everything lives under `tandem:{run_id}:`.

The braces are literal. In Redis Cluster they make `{run_id}` the hash tag, so every key
of a run lands in one slot and the multi-key transactions of `broker.streams` (XADD to
the dead-letter stream + XACK, SET NX + XACK) stay legal there. On a single server they
are just characters.

run ids and worker ids are restricted to `[A-Za-z0-9_.-]` so that they can never contain
a brace (which would change the hash tag), a colon (which would change the layout) or a
glob character (heartbeat keys are addressed by name, but operators will SCAN by pattern).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

PROMPTS_GROUP = "rollout"
TRAJECTORIES_GROUP = "trainer"


def check_name(what: str, value: object) -> str:
    """Return `value` if it is a valid run/worker/scope name, else raise ValueError naming it."""
    if not isinstance(value, str) or _NAME.fullmatch(value) is None:
        raise ValueError(f"{what}={value!r}: want 1-64 characters from [A-Za-z0-9_.-]")
    return value


@dataclass(frozen=True, kw_only=True)
class Keys:
    run_id: str

    def __post_init__(self) -> None:
        check_name("run_id", self.run_id)

    @property
    def prefix(self) -> str:
        return f"tandem:{{{self.run_id}}}:"

    @property
    def prompts(self) -> str:
        """Stream of PromptGroup messages; consumer group `rollout`."""
        return self.prefix + "prompts"

    @property
    def trajectories(self) -> str:
        """Stream of Trajectory messages; consumer group `trainer`."""
        return self.prefix + "trajectories"

    @property
    def deadletter(self) -> str:
        """Stream of entries that could not be processed, with the reason."""
        return self.prefix + "deadletter"

    @property
    def policy_latest(self) -> str:
        """Hash: version, address, contract_fingerprint, published_at."""
        return self.prefix + "policy:latest"

    @property
    def announce(self) -> str:
        """Pub/sub channel: a message per newly published policy version."""
        return self.prefix + "policy:announce"

    @property
    def workers(self) -> str:
        """Set of worker ids that have sent a heartbeat (pruned when their key expired)."""
        return self.prefix + "workers"

    def heartbeat(self, worker_id: str) -> str:
        """String with a TTL; present while the worker is alive."""
        return self.prefix + "heartbeat:" + check_name("worker_id", worker_id)

    def idempotency(self, scope: str, item_id: str) -> str:
        """`SET NX EX` marker: `item_id` of kind `scope` was processed (e.g. scope "trainer")."""
        if not isinstance(item_id, str) or not 0 < len(item_id) <= 256:
            raise ValueError(f"item_id={item_id!r}: want a non-empty string of at most 256 characters")
        return self.prefix + "seen:" + check_name("scope", scope) + ":" + item_id
