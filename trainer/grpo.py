"""GRPO with a decoupled PPO clip and truncated importance sampling (TIS), as pure functions.

For each completion token t of a sample drawn by the rollout (behavior policy b; token t sampled
by version v_t, one version per sample unless loop.inflight_updates):
    A        = (R - mean_group(R)) / (std_group(R) + eps)        group-normalized advantage
    r        = exp(logp_new - logp_prox)                           ratio to the proximal policy
    w        = min(exp(logp_prox - logp_behav), C)                 truncated importance weight
    loss_t   = -w * min(r A, clip(r, 1 - eps_lo, 1 + eps_hi) A)
The proximal policy is the trainer's own recompute at the start of the step, so the clip bounds
how far the step moves the trainer, while w corrects for the rollout being stale and quantized
(decoupled PPO). The loss is a mean over all completion tokens of the batch (token level).

Mismatch metrics, all means over completion tokens:
    logp_abs_diff       |logp_prox - logp_behav|          total train/rollout mismatch
    logp_abs_diff_quant |logp_v - logp_behav|             same weights (the token's version v), different path
    logp_abs_diff_stale |logp_prox - logp_v|              same path, version v -> current
    (tokens on KV of an older version, in-flight updates, are in neither: logp_abs_diff_stale_kv)
    kl_k3               E_b[r' - 1 - log r'], r' = p_prox / p_behav   (k3 estimator of KL(b || prox))
"""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """rewards [G * n] in group order -> advantages [G * n]; a group with equal rewards gets 0."""
    r = rewards.view(-1, group_size)
    a = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return a.reshape(-1)


def policy_loss(
    logp_new: Tensor,
    logp_prox: Tensor,
    logp_behav: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    tis_cap: float,
    n_tokens: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Token-level loss. All [B, T] except advantages [B]; mask is 1.0 on completion tokens.

    n_tokens: the denominator (the whole step's token count when the batch is split into
    minibatches, so every token weighs the same); defaults to this batch's.
    """
    n = float(n_tokens if n_tokens is not None else mask.sum().clamp(min=1))
    ratio = torch.exp(logp_new - logp_prox)
    w = torch.exp(logp_prox - logp_behav).clamp(max=tis_cap).detach()
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    loss = -(w * surrogate * mask).sum() / n
    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        stats = {
            "clip_frac": float((clipped * mask).sum() / mask.sum().clamp(min=1)),
            "tis_frac": float(
                ((torch.exp(logp_prox - logp_behav) > tis_cap).float() * mask).sum() / mask.sum().clamp(min=1)
            ),
        }
    return loss, stats


def masked_mean(x: Tensor, mask: Tensor) -> float:
    return float((x * mask).sum() / mask.sum().clamp(min=1))


def mismatch_metrics(
    logp_prox: Tensor,
    logp_behav: Tensor,
    logp_version: Tensor,
    mask: Tensor,
    version_known: Tensor | None = None,
    stale_kv: Tensor | None = None,
) -> dict[str, float]:
    """Train/rollout mismatch per completion token (masked means over [B, T]):

        logp_abs_diff        = mean |logp_prox - logp_behav|              (total)
        logp_abs_diff_quant  = mean |logp_version - logp_behav|           (quantization part)
        logp_abs_diff_stale  = mean |logp_prox - logp_version|            (staleness part)
        kl_k3                = mean (exp(d) - 1 - d),  d = logp_prox - logp_behav
        logp_abs_diff_quant_p50 / _p95: median and 95th percentile of |logp_version - logp_behav|
                                        over the tokens (the mean hides how rare large ones are)

    version_known [B] or [B, T] (bool): rows / tokens whose version's weights are known; the others
    (samples from before a restart) are left out of the two parts and the percentiles, which are
    absent from the result when no token is known (a mean over nothing is no number, never NaN).
    stale_kv [B, T] (bool): tokens sampled on KV an older version computed (in-flight updates keep
    it), whose |logp_version - logp_behav| is not quantization alone: left out of the split too, and
        logp_abs_diff_stale_kv = mean |logp_version - logp_behav| over them   (when there are any known)
    """
    d = logp_prox - logp_behav
    known = mask if version_known is None else version_known if version_known.dim() == 2 else version_known[:, None]
    known = mask * known.to(mask)  # its dtype and device
    split = known if stale_kv is None else known * (~stale_kv).to(mask)
    quant = (logp_version - logp_behav).abs()
    tokens = quant[split > 0]
    out = {"logp_abs_diff": masked_mean(d.abs(), mask), "kl_k3": masked_mean(torch.exp(d) - 1 - d, mask)}
    if stale_kv is not None and bool((known * stale_kv.to(mask)).sum() > 0):
        out["logp_abs_diff_stale_kv"] = masked_mean(quant, known * stale_kv.to(mask))
    if tokens.numel():
        out.update(
            logp_abs_diff_quant=masked_mean(quant, split),
            logp_abs_diff_stale=masked_mean((logp_prox - logp_version).abs(), split),
            logp_abs_diff_quant_p50=float(tokens.double().quantile(0.5)),
            logp_abs_diff_quant_p95=float(tokens.double().quantile(0.95)),
        )
    return out
