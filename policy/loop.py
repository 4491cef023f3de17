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
    A worker then runs the model's engine (rollout/engine.py, fp32) on its device, never the packed
    engine; the trainer needs trainer.backend 'torch' and, on CUDA, trainer.dtype 'float32'. The same
    ops run on the CPU and on CUDA (elementwise IEEE fp32 arithmetic): several times slower than the
    default on the CPU, far slower on a GPU, where there are no exact kernels yet (docs/benchmarks.md,
    "Exact mode")."""

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


def exact_refusal(trainer_device: str, trainer_backend: str, trainer_dtype: str) -> str | None:
    """The one-line reason `loop.exact` cannot run with these trainer settings (None: it can). The
    rollout side runs anywhere: its exact forward is the model's, on rollout.device, in fp32."""
    bad = []
    if trainer_backend != "torch":
        bad.append(f"trainer.backend={trainer_backend!r}")
    if trainer_device.startswith("cuda") and trainer_dtype != "float32":
        bad.append(f"trainer.dtype={trainer_dtype!r} on {trainer_device}")
    if not bad:
        return None
    return (
        f"loop.exact=true with {', '.join(bad)}: exact mode needs trainer.backend 'torch' and, on CUDA, "
        "trainer.dtype 'float32' (both sides compute the exact forward in fp32)"
    )
