"""The optimizer step: pack a step's groups, recompute their log-probs, take the GRPO update.

    batch = step.recompute(groups, weights_version=v)   no grad: prox (current weights), at_version
    row = step.optimize(batch, version=v)               `minibatches` updates; the step's metrics row

`prox`: the recompute under the current weights (the PPO proximal policy). `at_version`: each
token's log-prob under the version that sampled it (the quantization part of the mismatch), from
rows recomputed under each older version's retained packed tensors (trainer/versions.py: their
chunks layer by layer, each weight's operand built once), each token picking its own; tokens of a
version no longer held are left out. Staleness is per token (trainer version - the token's); a
sample's is its oldest token's. Every forward takes at most trainer.microbatch_tokens padded tokens
(gradients accumulated over a minibatch's chunks). Routing replay: every forward routes completion
tokens to the rollout's recorded experts (`Batch.routes`), and the recompute counts how often the
trainer's router would have picked the same ones (`route_agreement`).
The pure parts (`staleness_stats`, `token_stats`, `route_agreement`, `lr_at`) are tested by hand
(tests/unit/test_step.py).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch

from broker.codec import Trajectory

from . import grpo
from .config import TrainerConfig
from .sequences import pack, scatter_routes, scatter_rows
from .versions import RetainedVersions, per_token
from .warmstart import lr_factor


@dataclass
class Batch:
    """One step's samples packed into rows [B, T] (see trainer.sequences.pack), with the step's
    per-sample data and the trainer's recomputed log-probs."""

    tokens: torch.Tensor
    targets: torch.Tensor
    attn: torch.Tensor
    mask: torch.Tensor  # completion tokens
    behav: torch.Tensor  # the rollouts' behavior log-probs
    rewards: torch.Tensor  # [B]
    adv: torch.Tensor  # [B] group-normalized advantages
    versions: torch.Tensor  # [B] the version of each sample's oldest token
    prox: torch.Tensor  # current weights (proximal policy)
    at_version: torch.Tensor  # each token under its own version
    started: float  # perf_counter at the start of the step
    known: torch.Tensor | None = None  # [B] bool: rows whose every token's version is held
    token_versions: torch.Tensor | None = None  # [B, T] long: the version that sampled each target (0 off the mask)
    token_known: torch.Tensor | None = None  # [B, T] bool: at_version valid (its version held)
    recompute_s: float = 0.0  # seconds the recompute took (older versions' forwards included)
    at_version_s: float = 0.0  # of which the older versions' forwards (trainer.versions)
    routes: torch.Tensor | None = None  # [B, T, MoE layers, k] long: replayed expert ids (-1: the router's)
    routing: dict | None = None  # under replay: route_agreement's counts over the step (tensors)


class GRPOStep:
    def __init__(
        self,
        cfg: TrainerConfig,
        backend,
        versions: RetainedVersions,
        *,
        pad_id: int,
        temperature: float,
        device: torch.device,
        max_staleness: int,
        replay_routes: tuple[int, int] | None = None,
    ):
        """temperature: the rollouts' sampling temperature (the log-probs must match it);
        max_staleness: the run's bound (loop.max_staleness), which the per-token metrics check;
        replay_routes: (MoE layers, k) under loop.routing_replay (every sample carries routed_experts)."""
        self.cfg, self.backend, self.versions = cfg, backend, versions
        self.replay_routes = replay_routes
        self.max_staleness = max_staleness
        self.pad_id, self.temperature, self.device = pad_id, temperature, device
        self.autocast = backend.autocast()

    def recompute(self, groups: list[list[Trajectory]], *, weights_version: int | None) -> Batch:
        """Pack the groups into one batch with advantages and recompute its log-probs (module doc);
        weights_version: the version the current weights are (None: moved since its publish)."""
        t0 = time.perf_counter()
        samples = [t for g in groups for t in g]
        tokens, targets, attn, mask = pack(
            [t.prompt_tokens.tolist() for t in samples], [t.completion_tokens.tolist() for t in samples], self.pad_id
        )
        behav = scatter_rows([t.behavior_logprobs for t in samples], mask)
        rewards = torch.tensor([t.reward for t in samples], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, self.cfg.group_size)
        versions = torch.tensor([t.oldest_version for t in samples])
        tv = scatter_rows([t.token_versions.astype(np.int64) for t in samples], mask, dtype=torch.long)
        routes = None
        if self.replay_routes is not None:
            routes = scatter_routes([t.routed_experts for t in samples], mask, *self.replay_routes).to(self.device)
        routing = Counter()

        def prox_forward(r):
            kw = dict(attention_mask=attn[r], temperature=self.temperature)
            if routes is None:
                return self.backend.token_logprobs(tokens[r], targets[r], **kw)
            logp, own = self.backend.token_logprobs(tokens[r], targets[r], routes=routes[r], router_own=True, **kw)
            routing.update(route_agreement(own, routes[r], mask[r]))
            return logp

        rows_of = {  # version -> the rows holding a token of it (on the host: no device sync)
            v: ((tv == v) & (mask > 0)).any(dim=1).nonzero().squeeze(-1).to(self.device)
            for v in sorted({int(v) for t in samples for v in np.unique(t.token_versions)})
        }
        tokens, targets, attn, mask, behav, rewards, adv, tv = (
            t.to(self.device) for t in (tokens, targets, attn, mask, behav, rewards, adv, tv)
        )
        with torch.no_grad(), self.autocast:
            prox = self._logprobs(prox_forward, torch.arange(len(samples), device=self.device), tokens.shape[1])
            self._sync()
            t1 = time.perf_counter()
            by_version, sampled = {}, split_rows(len(samples), self.cfg.mismatch_split_rows).to(self.device)
            for v, rows in rows_of.items():
                if v == weights_version:
                    by_version[v] = (rows, prox[rows])  # the current weights are version v: prox
                    continue
                rows = rows[torch.isin(rows, sampled)]  # an older version's forward: the sampled rows only
                if len(rows) and v in self.versions:
                    by_version[v] = (rows, self.versions.token_logprobs(
                        v, tokens, targets, chunks=self._chunks(rows, tokens.shape[1]), attention_mask=attn,
                        temperature=self.temperature, routes=routes,
                    ))  # fmt: skip
            at_version, token_known = per_token(tv, by_version, prox)
        self._sync()
        t2 = time.perf_counter()
        on_mask = mask > 0
        known = (token_known | ~on_mask).all(dim=1).cpu()
        return Batch(
            tokens, targets, attn, mask, behav, rewards, adv, versions, prox, at_version, t0, known=known,
            token_versions=tv, token_known=token_known & on_mask, recompute_s=t2 - t0, at_version_s=t2 - t1,
            routes=routes, routing=dict(routing) if routes is not None else None,
        )  # fmt: skip

    def _sync(self) -> None:
        """Wait for the trainer's own queued device work (recompute_s is device time, not launch
        time): its current stream only, not the whole device, whose side streams may hold an
        in-flight publish's copies to the host (broker.frames.fill) that this step need not wait for."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _logprobs(self, forward, rows: torch.Tensor, row_len: int) -> torch.Tensor:
        """forward(rows) -> [len(rows), T] log-probs, run in chunks of trainer.microbatch_tokens."""
        return torch.cat([forward(r) for r in self._chunks(rows, row_len)])

    def _chunks(self, rows: torch.Tensor, row_len: int) -> tuple[torch.Tensor, ...]:
        """`rows` in chunks of at most trainer.microbatch_tokens padded tokens (one row at least)."""
        if not self.cfg.microbatch_tokens:
            return (rows,)
        return rows.split(max(1, self.cfg.microbatch_tokens // row_len))

    def optimize(self, b: Batch, *, version: int) -> dict:
        """The GRPO update over `minibatches` shuffled minibatches at trainer version `version`;
        returns the step's metrics row."""
        cfg = self.cfg
        n_tokens = int(b.mask.sum())
        grad_norms, stats = [], Counter()
        for minibatch in torch.randperm(len(b.rewards)).chunk(cfg.minibatches):
            self.backend.zero_grad()
            for rows in self._chunks(minibatch.to(self.device), b.tokens.shape[1]):
                replay = {} if b.routes is None else {"routes": b.routes[rows]}
                with self.autocast:
                    logp = self.backend.token_logprobs(
                        b.tokens[rows], b.targets[rows], attention_mask=b.attn[rows], temperature=self.temperature,
                        **replay,
                    )  # fmt: skip
                loss, s = grpo.policy_loss(
                    logp, b.prox[rows], b.behav[rows], b.adv[rows], b.mask[rows],
                    clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap, n_tokens=n_tokens,
                )  # fmt: skip
                (loss * cfg.minibatches).backward()  # n_tokens is the step's: rescale to a minibatch's
                n = float(b.mask[rows].sum())
                stats.update({k: v * n for k, v in s.items()} | {"tokens": n})
            grad_norms.append(self.backend.step())
        return {
            "reward_mean": float(b.rewards.mean()),
            **staleness_stats(version, b.versions.tolist()),
            **token_stats(version, b.token_versions, b.mask, max_staleness=self.max_staleness),
            **grpo.mismatch_metrics(
                b.prox,
                b.behav,
                b.at_version,
                b.mask,
                version_known=b.token_known,
                stale_kv=stale_kv(b.token_versions, b.mask),
            ),
            **({} if b.routing is None else routing_metrics(b.routing)),
            "grad_norm": sum(grad_norms) / len(grad_norms),
            "clip_frac": stats["clip_frac"] / max(stats["tokens"], 1.0),
            "tis_frac": stats["tis_frac"] / max(stats["tokens"], 1.0),
            "samples": len(b.rewards),
            "completion_tokens": n_tokens,
            "step_time_s": time.perf_counter() - b.started,
            "recompute_s": b.recompute_s,
            "at_version_s": b.at_version_s,
        }


def split_rows(n_rows: int, k: int) -> torch.Tensor:
    """The rows whose tokens of an older version are recomputed under it for the mismatch split
    (trainer.mismatch_split_rows): k rows spread evenly over the batch (every (n // k)-th from the
    first), all of them when k is 0 or >= n_rows."""
    if not k or k >= n_rows:
        return torch.arange(n_rows)
    return torch.arange(0, n_rows, n_rows // k)[:k]


def route_agreement(own: torch.Tensor, replayed: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Counts over the completion tokens (mask [B, T]) of whether the trainer's router picked the
    replayed experts: own and replayed [B, T, MoE layers, k], compared as sets per (token, layer).
    pairs / pairs_agree: (token, MoE layer) pairs, and those whose sets are equal; tokens /
    tokens_agree: tokens, and those equal in every MoE layer. Tensors (summing needs no host sync)."""
    on = mask > 0
    same = (own.sort(dim=-1).values == replayed.sort(dim=-1).values).all(dim=-1)[on]  # [tokens, layers]
    return {
        "pairs": torch.tensor(same.numel()),
        "pairs_agree": same.sum(),
        "tokens": on.sum(),
        "tokens_agree": same.all(dim=-1).sum(),
    }


def routing_metrics(counts: dict) -> dict[str, float]:
    """router_agree_frac (of (token, MoE layer) pairs) and tokens_routed_as_rollout_frac (tokens
    agreeing in every MoE layer) from `route_agreement`'s counts summed over a step; 1.0 for none."""
    c = {k: float(v) for k, v in counts.items()}
    return {
        "router_agree_frac": c["pairs_agree"] / c["pairs"] if c.get("pairs") else 1.0,
        "tokens_routed_as_rollout_frac": c["tokens_agree"] / c["tokens"] if c.get("tokens") else 1.0,
    }


def stale_kv(token_versions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: completion tokens of a newer version than their sample's first token, which
    attend to KV an older version computed (the KV is kept across an in-flight swap)."""
    on = mask > 0
    first = torch.where(on, token_versions, torch.iinfo(torch.long).max).min(dim=1, keepdim=True).values
    return on & (token_versions > first)


def token_stats(version: int, token_versions: torch.Tensor, mask: torch.Tensor, *, max_staleness: int) -> dict:
    """Per-token staleness (version - the token's version) over the completion tokens of [B, T]:
    token_staleness_mean; tokens_over_max_staleness_frac (admission bounds a sample's oldest token,
    so this is 0); samples_multi_version (samples whose tokens span > 1 version); tokens_on_stale_kv."""
    on = mask > 0
    staleness = (version - token_versions)[on].double()
    spans = (
        torch.where(on, token_versions, 0).max(dim=1).values
        > torch.where(on, token_versions, torch.iinfo(torch.long).max).min(dim=1).values
    )
    return {
        "token_staleness_mean": float(staleness.mean()) if staleness.numel() else 0.0,
        "tokens_over_max_staleness_frac": float((staleness > max_staleness).double().mean())
        if staleness.numel()
        else 0.0,
        "samples_multi_version": int(spans.sum()),
        "tokens_on_stale_kv": int(stale_kv(token_versions, mask).sum()),
    }


def staleness_stats(version: int, sample_versions: list[int]) -> dict:
    """Staleness (version - the version of the sample's oldest token) of a step's samples: mean, max
    and a histogram."""
    staleness = [version - v for v in sample_versions]
    return {
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "staleness_hist": dict(Counter(str(s) for s in staleness)),
    }


def lr_at(cfg: TrainerConfig, step: int) -> float:
    """The learning rate of the step taken after `step` steps (a function of the step alone: a resume
    continues the schedule exactly)."""
    s = cfg.lr_schedule
    return cfg.lr * lr_factor(step, steps=cfg.max_steps, warmup=s.warmup_steps, kind=s.kind, min_ratio=s.min_lr_ratio)
