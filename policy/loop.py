"""The run-wide settings of the asynchronous loop, shared by the trainer and every rollout worker.

One frozen section (`loop:` in a run config) instead of keyword arguments threaded into each side:
both must agree on these for the samples to mean what the trainer assumes (torchtitan's
`AsyncLoopConfig` owns the staleness bound the same way). Not part of the policy-version contract
fingerprint: a rollout of another temperature is a configuration error, not a foreign policy.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.fields import is_int


@dataclass(frozen=True, kw_only=True)
class AsyncConfig:
    """The `loop:` section: settings the trainer and the rollouts must share."""

    max_staleness: int = 2
    """Samples more than this many versions behind the trainer are dropped by the trainer, and a
    rollout never starts a group with a policy already this far behind (0 = the synchronous loop)."""
    temperature: float = 1.0
    """The rollouts' sampling temperature; the trainer computes its log-probs at the same one (> 0)."""
    seed: int = 0
    """Seeds the model initialization, the task's prompts and the warm start."""
    inflight_updates: bool = False
    """True: a rollout worker installs a fetched version between two decode steps, and unfinished
    samples continue under it on the KV cache computed so far (each token records the version that
    sampled it; the trainer bounds the oldest token's staleness). False: drain-on-swap, no sample
    spans two versions (the exact alternative)."""

    exact: bool = False
    """True: exact mode. The rollout engine and the trainer (recompute and training forward) compute
    every log-prob with `policy.exact`'s batch-invariant ops, so a token's behavior log-prob equals
    the trainer's recompute at the version that sampled it bit for bit (`logp_abs_diff_quant` 0).
    CPU only for now (rollout.device and trainer.device 'cpu', trainer.backend 'torch': there are
    no exact GPU kernels yet), so a worker runs the CPU engine (rollout/engine.py), never the packed
    one; several times slower than the default (docs/benchmarks.md, "Exact mode")."""

    routing_replay: bool = False
    """True (MoE models): rollout routing replay (R3). Each trajectory carries, per completion token
    and MoE layer, the top-k expert ids the rollout's forward picked (`routed_experts`, uint8 for
    <= 256 experts: n_moe_layers * top_k bytes per token), and the trainer's recompute and training
    forward route those tokens to them (gate weights: the router's own softmax at those experts,
    renormalized, differentiable). Prompt tokens are routed by the trainer's router. Not with
    trainer.backend megatron."""

    def __post_init__(self):
        errors = []
        if not is_int(self.max_staleness, lo=0):
            errors.append(f"max_staleness={self.max_staleness!r} (must be an int >= 0)")
        if not isinstance(self.inflight_updates, bool):
            errors.append(f"inflight_updates={self.inflight_updates!r} (must be true or false)")
        if not isinstance(self.exact, bool):
            errors.append(f"exact={self.exact!r} (must be true or false)")
        if not isinstance(self.routing_replay, bool):
            errors.append(f"routing_replay={self.routing_replay!r} (must be true or false)")
        if not self.temperature > 0:
            errors.append(f"temperature={self.temperature} (must be > 0: behavior log-probs need sampling)")
        if errors:
            raise ValueError("AsyncConfig: " + "; ".join(errors))


def exact_refusal(rollout_device: str | None, trainer_device: str | None, trainer_backend: str | None) -> str | None:
    """The one-line reason `loop.exact` cannot run with these settings (None: it can). Exact mode is
    CPU only: no exact GPU kernels exist yet. A side that does not know the other's setting passes None."""
    bad = []
    if rollout_device is not None and rollout_device != "cpu":
        bad.append(f"rollout.device={rollout_device!r}")
    if trainer_device is not None and trainer_device != "cpu":
        bad.append(f"trainer.device={trainer_device!r}")
    if trainer_backend is not None and trainer_backend != "torch":
        bad.append(f"trainer.backend={trainer_backend!r}")
    if not bad:
        return None
    return (
        f"loop.exact=true with {', '.join(bad)}: exact mode runs on the CPU only for now (rollout.device "
        "and trainer.device 'cpu', trainer.backend 'torch'; no exact GPU kernels yet)"
    )
