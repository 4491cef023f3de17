"""The rollout worker's configuration: one frozen dataclass, validated."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    temperature: float = 1.0
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    reclaim_idle_s: float = 20.0  # prompt entries idle this long in a dead worker are claimed
    fetch_timeout_s: float = 60.0
    read_block_ms: int = 500

    def __post_init__(self):
        errors = []
        if not self.temperature > 0:
            errors.append(f"temperature={self.temperature} (must be > 0: behavior log-probs need sampling)")
        if not 0 < self.heartbeat_s < self.heartbeat_ttl_s:
            errors.append(f"heartbeat_s={self.heartbeat_s}, heartbeat_ttl_s={self.heartbeat_ttl_s} (need 0 < s < ttl)")
        if self.reclaim_idle_s <= 0 or self.fetch_timeout_s <= 0 or self.read_block_ms <= 0:
            errors.append(f"reclaim_idle_s={self.reclaim_idle_s}, fetch_timeout_s={self.fetch_timeout_s}, "
                          f"read_block_ms={self.read_block_ms} (must be > 0)")
        if errors:
            raise ValueError("RolloutConfig: " + "; ".join(errors))
