"""On-device sampling with per-row seeds: a counter-based RNG keyed by (row seed, step, token id).

A row's b-th sample draws its noise from `uniform(seed_b, step, v)` for every vocabulary id v, a
pure function of those three integers (a hash, no generator state), so what a row samples depends
only on its logits, its seed and how many tokens it has generated: never on the batch, its position
in it, or the other rows. Sampling is Gumbel-max:

    z_v   = logit_v / T
    g_v   = -log(-log(u_v)),   u_v = ((hash(seed, step, v) >> 9) + 0.5) * 2^-23   in (0, 1), exact in fp32
    token = argmax_v (z_v + g_v)            (lowest v on ties)   ~ Categorical(softmax(z))
    logp  = z_token - logsumexp(z)          (fp32: the behavior log-prob)

T = 0 is greedy (log-prob at T = 1). top_k / top_p truncate first (`truncation_mask`), and logp is
then under the truncated, renormalized distribution; the same hash drives every path. The hash is
`mix32` (lowbias32) over the seed's halves, the step and the token id (`row_key`, `hash_uniform`)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MASK32", "hash_uniform", "mix32", "row_key", "sample", "sample_reference"]

MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_GOLDEN = 0x9E3779B9


def mix32(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding uint32 values: x ^= x>>16; x *= M1; x ^= x>>15; x *= M2; x ^= x>>16."""
    x = x ^ (x >> 16)
    x = (x * _M1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _M2) & MASK32
    return x ^ (x >> 16)


def row_key(seeds: Tensor, step: Tensor | int) -> Tensor:
    """One uint32 key per row from its int64 seed and the step (the row's token index)."""
    s = seeds.to(torch.int64)
    lo, hi = s & MASK32, (s >> 32) & MASK32
    k = mix32(lo ^ mix32(hi ^ _GOLDEN))
    step = step.to(torch.int64) if isinstance(step, Tensor) else torch.tensor(int(step), device=s.device)
    return mix32(k ^ (step & MASK32))


def hash_uniform(key: Tensor, vocab: int) -> Tensor:
    """u [B, V] fp32 in (0, 1) from row keys [B]: u = ((mix32(mix32(v ^ key) + key) >> 9) + 0.5) / 2^23 (23 bits + 0.5: exact in fp32, never 0 or 1)."""
    v = torch.arange(vocab, device=key.device, dtype=torch.int64)
    k = key.to(torch.int64)[:, None]
    r = mix32((mix32(v[None, :] ^ k) + k) & MASK32)
    return ((r >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def sample_reference(
    logits: Tensor, seeds: Tensor, step: Tensor | int, temperature: float, *, top_k: int = 0, top_p: float = 1.0
) -> tuple[Tensor, Tensor]:
    """(tokens [B] int64, logp [B] fp32) as the module docstring defines them; plain torch, any device,
    no host synchronization (CUDA-graph safe when `step` is a tensor).

    The hash is 32-bit integer arithmetic (Chris Wellons' `lowbias32` finalizer, four rounds over the
    seed's two halves, the step and the token id), here in int64 torch ops.
    `rollout.kernels.sampling_triton.sample` does the untruncated case in one Triton program per row
    (one pass over the vocabulary: online logsumexp and the Gumbel argmax together), the same
    arithmetic with libdevice's logf, which is what torch's CUDA log uses. With top_k > 0 and/or
    top_p < 1: the top_k largest z, then the smallest prefix of them, by descending probability,
    whose mass reaches top_p (the most likely token is always kept)."""
    z = logits.float()
    if temperature <= 0:
        return z.argmax(dim=-1), _gather_logp(z.log_softmax(dim=-1), z.argmax(dim=-1))
    if temperature != 1.0:
        z = z / temperature
    B, V = z.shape
    u = hash_uniform(row_key(seeds, step), V)
    g = -torch.log(-torch.log(u))
    if top_k <= 0 and top_p >= 1.0:
        tok = (z + g).argmax(dim=-1)
        return tok, _gather_logp(z.log_softmax(dim=-1), tok)
    keep = truncation_mask(z, top_k=top_k, top_p=top_p)
    zt = z.masked_fill(~keep, float("-inf"))
    tok = (zt + g).argmax(dim=-1)
    return tok, _gather_logp(zt.log_softmax(dim=-1), tok)


def truncation_mask(z: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """bool [B, V]: the tokens kept by top-k then top-p (nucleus) truncation of softmax(z)."""
    B, V = z.shape
    k = V if top_k <= 0 else min(top_k, V)
    vals, idx = z.topk(k, dim=-1)  # sorted descending
    keep_sorted = torch.ones_like(vals, dtype=torch.bool)
    if top_p < 1.0:
        p = vals.softmax(dim=-1) if k < V else (vals - z.logsumexp(-1, keepdim=True)).exp()
        before = p.cumsum(dim=-1) - p  # mass strictly before each token
        keep_sorted = before < top_p  # the first token (before = 0) is always kept
    keep = torch.zeros_like(z, dtype=torch.bool)
    return keep.scatter(1, idx, keep_sorted)


def _gather_logp(logp: Tensor, tok: Tensor) -> Tensor:
    return logp.gather(-1, tok[:, None]).squeeze(-1)


def sample(
    logits: Tensor,
    seeds: Tensor,
    step: Tensor,
    temperature: Tensor | float,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    nonfinite: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Dispatch: the fused Triton kernel on CUDA for untruncated sampling, `sample_reference` else.

    `step` is the token index: one for every row ([1] or an int) or one per row ([B]: rows that
    joined a continuous batch at different steps each count their own tokens).
    `temperature` may be a 1-element tensor (the Triton path reads it on the device, so one CUDA
    graph serves every temperature; <= 0 means greedy; the other paths read it once, a host sync).
    `nonfinite` (int32 [1]), when given, is set to 1 if any logit is NaN or infinite."""
    if logits.device.type == "cuda" and top_k <= 0 and top_p >= 1.0:
        from rollout.kernels import sampling_triton

        return sampling_triton.sample(logits, seeds, step, temperature, nonfinite)
    if nonfinite is not None:
        nonfinite.copy_(torch.maximum(nonfinite, (~torch.isfinite(logits).all()).to(torch.int32).view(1)))
    t = float(temperature.item()) if isinstance(temperature, Tensor) else float(temperature)
    return sample_reference(logits, seeds, step, t, top_k=top_k, top_p=top_p)
