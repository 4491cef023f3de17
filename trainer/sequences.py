"""Pack (prompt, completion) token lists into right-padded next-token batches."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor


def pack(
    prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], pad_id: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """-> tokens [B, T], targets [B, T], attention_mask [B, T] bool, loss_mask [B, T] float.

    Row b holds prompt+completion[:-1] as input and prompt[1:]+completion as targets, so
    targets[b, t] is predicted from tokens[b, :t+1]; loss_mask is 1 exactly on the targets that
    are completion tokens (in order, so loss_mask rows line up with the behavior log-probs).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions)]
    T = max(len(s) for s in seqs) - 1
    B = len(seqs)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.bool)
    loss_mask = torch.zeros(B, T)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        n = len(s) - 1
        tokens[b, :n] = torch.tensor(s[:-1])
        targets[b, :n] = torch.tensor(s[1:])
        attn[b, :n] = True
        loss_mask[b, len(p) - 1 : n] = 1.0
    return tokens, targets, attn, loss_mask


def scatter_routes(routes: Sequence, loss_mask: Tensor, layers: int, k: int) -> Tensor:
    """Routing replay: each sample's per-completion-token expert ids [n, layers, k] (the rollout's
    `routed_experts`) at its loss_mask positions of [B, T, layers, k] long, -1 elsewhere (prompt
    positions and padding: the router's own choice). Completion token i's ids sit where its target
    is predicted, at the input position of the forward that sampled it."""
    out = torch.full((*loss_mask.shape, layers, k), -1, dtype=torch.long)
    for b, r in enumerate(routes):
        idx = loss_mask[b].nonzero().squeeze(-1)
        r = np.asarray(r)
        if r.shape != (len(idx), layers, k):
            raise ValueError(f"row {b}: routes of shape {r.shape} for {len(idx)} completion tokens x {layers} x {k}")
        out[b, idx] = torch.from_numpy(r.astype(np.int64))
    return out


def scatter_rows(values: Sequence[Sequence[float]], loss_mask: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Place per-completion-token values (e.g. behavior log-probs; token versions with dtype long)
    at the loss_mask positions, 0 elsewhere."""
    out = torch.zeros_like(loss_mask, dtype=dtype)
    for b, v in enumerate(values):
        idx = loss_mask[b].nonzero().squeeze(-1)
        if len(idx) != len(v):
            raise ValueError(f"row {b}: {len(v)} values for {len(idx)} completion tokens")
        out[b, idx] = torch.tensor(np.asarray(v), dtype=out.dtype)  # copies: codec arrays are read-only
    return out
