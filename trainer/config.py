"""The trainer's configuration: one frozen dataclass, validated with messages naming each field."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    # RL step
    max_steps: int = 40
    groups_per_step: int = 8  # prompt groups consumed per optimizer step
    group_size: int = 8  # samples per prompt (GRPO group)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    minibatches: int = 2  # optimizer updates per step; the PPO clip acts from the second one on
    clip_low: float = 0.2
    clip_high: float = 0.28
    tis_cap: float = 2.0  # truncated importance weight cap C on prox / behavior
    backward: str = "hp"  # QAT straight-through mode: "hp" or "dequant"
    # publishing (max_staleness is the run's, RunConfig.max_staleness, shared with the rollouts)
    publish_every: int = 1
    prompts_ahead: int = 0  # prompt groups queued or in flight; 0 = groups_per_step * (max_staleness + 1)
    # warm start: supervised steps on correct answers before RL, so the policy is sometimes right
    warmstart_steps: int = 600
    warmstart_batch: int = 64
    warmstart_lr: float = 3e-3
    # services
    grpc_host: str = "127.0.0.1"
    grpc_port: int = 0  # 0 = a free port (published in policy:latest)
    metrics_port: int = 0  # Prometheus; 0 = a free port, -1 = off
    checkpoint_every: int = 1
    collect_timeout_s: float = 300.0  # give up waiting for trajectories after this long

    def __post_init__(self):
        errors = []
        for name in ("max_steps", "groups_per_step", "group_size", "minibatches", "publish_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if self.group_size < 2:
            errors.append(f"group_size={self.group_size} (GRPO needs >= 2 samples per prompt)")
        if self.groups_per_step * self.group_size % self.minibatches:
            errors.append(f"minibatches={self.minibatches} must divide groups_per_step*group_size="
                          f"{self.groups_per_step * self.group_size}")
        if not (self.lr > 0 and self.warmstart_lr > 0):
            errors.append(f"lr={self.lr}, warmstart_lr={self.warmstart_lr} (must be > 0)")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            errors.append(f"clip_low={self.clip_low}, clip_high={self.clip_high}")
        if self.tis_cap < 1:
            errors.append(f"tis_cap={self.tis_cap} (must be >= 1)")
        if self.backward not in ("hp", "dequant"):
            errors.append(f"backward={self.backward!r} (hp or dequant)")
        if self.warmstart_steps < 0:
            errors.append(f"warmstart_steps={self.warmstart_steps} (must be >= 0)")
        if errors:
            raise ValueError("TrainerConfig: " + "; ".join(errors))

    def queued_groups(self, max_staleness: int) -> int:
        """Consumed first in, first out, a group queued behind Q others is used Q / groups_per_step
        steps later: this many keeps fast rollouts from producing samples that are already too stale
        (and with max_staleness=0 it is the synchronous loop: one step's groups, then wait)."""
        return self.prompts_ahead or self.groups_per_step * (max_staleness + 1)
