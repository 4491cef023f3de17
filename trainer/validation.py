"""Is a decoded trajectory fit to train on? A pure function of the sample and the run's rules.

`check_trajectory` is called on every record before it may join a group; a sample it rejects is
dead-lettered alone, with the reason, and counted, and never takes its group's other samples with it.
Rules, each with the reason string it returns (the first that fails):
    group_size         == the run's GRPO group size           (the advantage reshape [-1, n])
    sample_id          == sample_id_for(group_id, sample_index)  (the idempotency key names its slot)
    group_id           was fed by this trainer and not yet used  (`fed_prompt` is its prompt tokens)
    prompt_tokens      == the fed prompt's tokens             (nobody trains on a prompt we never fed)
    1 <= len(completion) <= max_completion_tokens,  len(prompt) + len(completion) <= max_seq_len
    0 <= token id < vocab_size                                (prompt and completion)
    behavior_logprobs  finite, in [min_logprob, 0]            (log-probabilities of sampled tokens)
    |reward|           <= max_abs_reward, finite
    1 <= policy_version <= the trainer's current version      (no sample from the future)
    token_versions     >= 1  (the codec checks the rest: non-decreasing, the last = policy_version)
    routed_experts     under routing replay (`routes`): present, [n, MoE layers, k], each token's k
                       ids distinct and < n_experts
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from broker.codec import Trajectory, sample_id_for


@dataclass(frozen=True, kw_only=True)
class TrajectoryRules:
    group_size: int  # samples per GRPO group (TrainerConfig.group_size)
    vocab_size: int  # token ids must be < this (the model's embedding rows)
    max_seq_len: int  # prompt + completion tokens (the model's context)
    max_completion_tokens: int  # the task's generation limit
    max_abs_reward: float  # rewards outside [-this, this] are rejected
    min_logprob: float = -1000.0  # behavior log-probs below this are rejected (exp() underflows long before)
    routes: tuple[int, int, int] | None = None  # (MoE layers, k, n_experts) under loop.routing_replay

    def __post_init__(self) -> None:
        errors = []
        for name in ("group_size", "vocab_size", "max_seq_len", "max_completion_tokens"):
            if getattr(self, name) < 1:
                errors.append(f"{name}={getattr(self, name)} (must be >= 1)")
        if not 0 < self.max_abs_reward < math.inf:
            errors.append(f"max_abs_reward={self.max_abs_reward} (must be finite and > 0)")
        if not -math.inf < self.min_logprob < 0:
            errors.append(f"min_logprob={self.min_logprob} (must be finite and < 0)")
        if errors:
            raise ValueError("TrajectoryRules: " + "; ".join(errors))


def check_trajectory(
    t: Trajectory, rules: TrajectoryRules, *, version: int, fed_prompt: np.ndarray | None
) -> str | None:
    """None when `t` may join its group; else one line saying what is wrong with it.

    `version` is the trainer's current policy version; `fed_prompt` the prompt tokens this trainer
    fed under `t.group_id` (None: it fed no such prompt, or that prompt was already used)."""
    if t.group_size != rules.group_size:
        return f"group_size={t.group_size}, the run's is {rules.group_size}"
    if not 0 <= t.sample_index < t.group_size:
        return f"sample_index={t.sample_index} outside [0, {t.group_size})"
    if t.sample_id != sample_id_for(t.group_id, t.sample_index):
        return f"sample_id={t.sample_id[:80]!r} does not name group {t.group_id[:80]!r} slot {t.sample_index}"
    if fed_prompt is None:
        return f"group {t.group_id[:80]!r} is no prompt this trainer fed (or it was already used)"
    n_prompt, n_completion = len(t.prompt_tokens), len(t.completion_tokens)
    if n_prompt != len(fed_prompt) or not np.array_equal(t.prompt_tokens, fed_prompt):
        return f"prompt_tokens ({n_prompt} tokens) differ from the prompt fed as {t.group_id[:80]!r}"
    if not 1 <= n_completion <= rules.max_completion_tokens:
        return f"{n_completion} completion tokens (want 1..{rules.max_completion_tokens})"
    if n_prompt + n_completion > rules.max_seq_len:
        return f"{n_prompt}+{n_completion} tokens > max_seq_len={rules.max_seq_len}"
    lo, hi = int(t.completion_tokens.min()), int(t.completion_tokens.max())
    if lo < 0 or hi >= rules.vocab_size:
        return f"completion token ids in [{lo}, {hi}], vocab is [0, {rules.vocab_size})"
    lp = np.asarray(t.behavior_logprobs, dtype=np.float64)
    if len(lp) != n_completion:
        return f"{len(lp)} behavior log-probs for {n_completion} completion tokens"
    if not np.isfinite(lp).all() or lp.max() > 0 or lp.min() < rules.min_logprob:
        return f"behavior log-probs in [{lp.min():.4g}, {lp.max():.4g}] (want finite, in [{rules.min_logprob:g}, 0])"
    if not (math.isfinite(t.reward) and abs(t.reward) <= rules.max_abs_reward):
        return f"reward={t.reward!r} (want finite, |reward| <= {rules.max_abs_reward:g})"
    if not 1 <= t.policy_version <= version:
        return f"policy_version={t.policy_version} (want 1..{version}, the trainer's current version)"
    if t.oldest_version < 1:
        return f"token_versions from {t.oldest_version} (want >= 1)"
    if rules.routes is not None:
        return _routes_refusal(t.routed_experts, n_completion, *rules.routes)
    return None


def _routes_refusal(r: np.ndarray | None, n: int, layers: int, k: int, n_experts: int) -> str | None:
    if r is None:
        return "no routed_experts (loop.routing_replay needs them: is the rollout's loop.routing_replay on?)"
    if r.shape != (n, layers, k):
        return f"routed_experts of shape {r.shape}, want ({n}, {layers}, {k}) (tokens, MoE layers, top_k)"
    if int(r.max()) >= n_experts:
        return f"routed_experts hold expert id {int(r.max())} (want < n_experts={n_experts})"
    if k > 1 and bool((np.diff(np.sort(r, axis=-1), axis=-1) == 0).any()):
        return "routed_experts repeat an expert within a token's top_k"
    return None
