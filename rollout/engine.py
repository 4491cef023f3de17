"""The rollout engine: sampling continuations from the policy model with a KV cache (the CPU reference,
and exact mode's engine on CUDA: it runs on the model's device).

`generate(model, prompts, *, n_samples, max_new_tokens, ...) -> Generation` is the API every engine
implements (this CPU one, and `rollout.packed_engine` beside it); its docstring defines it.

Split as gpt-fast's generate.py: `prefill` (the prompts through the model once, filling the cache),
`decode_one_token` (one token per row) and `sample` (logits -> token and its log-prob), so that a
decode step can be captured or compiled on its own. Each prompt is prefilled once and its KV cache
is copied into the rows of its n samples (as nanochat's `Engine.generate` does).

Sampling is Gumbel-max with per-row exponential noise, argmax(logp - log E) with E ~ Exp(1) drawn
from the row's own generator over the whole vocabulary at every step: the same draw whatever the
batch, so per-row seeding is exact. Routing replay (`record_routes`): each row also records, per
generated token, the expert ids every MoE layer picked in the forward whose logits sampled it (the
prefill's last position for the first token, the decode step of the previous token after).
Simplified: the model's forward runs as is (weights dequantized once per version by the worker); the
packed engine uses the packed-weight matmuls of `rollout.kernels`.
Exact mode (`model.exact`, loop.exact): the forward's ops are `policy.exact`'s and `sample`'s
log-probs are `exact.scaled_log_softmax`, the trainer's formula, so they equal its recompute."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from policy import exact as exact_ops
from policy.model import KVCache, Transformer

__all__ = [
    "Generation",
    "decode_one_token",
    "forced_logprobs",
    "generate",
    "log_probs",
    "prefill",
    "row_generators",
    "sample",
]


@dataclass
class Generation:
    """Result of `generate`. Row r produced `lengths[r]` tokens: tokens[r, :lengths[r]] (the stop
    token included), with the sampling policy's log-probs in logprobs[r, :lengths[r]]; the rest is
    pad_id / 0. `stopped[r]` is True when the row ended on a stop token, False at max_new_tokens."""

    tokens: Tensor  # [R, N] long
    logprobs: Tensor  # [R, N] fp32
    lengths: Tensor  # [R] long
    stopped: Tensor  # [R] bool
    routes: Tensor | None = None  # [R, N, n MoE layers, k] long (record_routes), 0 past a row's end

    def completions(self) -> list[list[int]]:
        return [self.tokens[b, :n].tolist() for b, n in enumerate(self.lengths.tolist())]

    def completion_logprobs(self) -> list[list[float]]:
        return [self.logprobs[b, :n].tolist() for b, n in enumerate(self.lengths.tolist())]


def row_generators(rows: int, generator: torch.Generator | None, seeds: Sequence[int] | None) -> list:
    """One CPU generator per output row, seeded by `seeds[r]` or by seeds drawn from `generator`."""
    if seeds is not None:
        seeds = list(seeds)
        if len(seeds) != rows:
            raise ValueError(f"seeds has {len(seeds)} entries for {rows} rows (prompts x n_samples)")
        row_seeds = [int(s) for s in seeds]
    else:
        row_seeds = torch.randint(0, 2**62, (rows,), generator=generator).tolist()
    return [torch.Generator().manual_seed(s) for s in row_seeds]


def prefill(model: Transformer, tokens: Tensor, mask: Tensor, cache: KVCache, *, routes: bool = False):
    """Left-padded prompts [B, L] (mask True = real token) into an empty cache -> last logits [B, V]
    fp32; routes: (logits, the last position's expert ids [B, n MoE layers, k])."""
    if not routes:
        return model(tokens, attention_mask=mask, cache=cache, last_only=True)[:, -1].float()
    logits, ids = model(tokens, attention_mask=mask, cache=cache, last_only=True, return_routes=True)
    return logits[:, -1].float(), ids[:, -1]


def decode_one_token(model: Transformer, tokens: Tensor, alive: Tensor, cache: KVCache, *, routes: bool = False):
    """One new token per row [B] (rows with alive False are padding nobody attends to) -> logits [B, V]
    fp32; routes: (logits, expert ids [B, n MoE layers, k])."""
    if not routes:
        return model(tokens[:, None], attention_mask=alive[:, None], cache=cache)[:, -1].float()
    logits, ids = model(tokens[:, None], attention_mask=alive[:, None], cache=cache, return_routes=True)
    return logits[:, -1].float(), ids[:, -1]


def log_probs(logits: Tensor, temperature: float, *, exact: bool = False) -> Tensor:
    """log_softmax(logits / T) [B, V] (the logits as they are at temperature 0); exact:
    `policy.exact.scaled_log_softmax`, the trainer's formula in exact mode."""
    if exact:
        return exact_ops.scaled_log_softmax(logits, temperature if temperature > 0 else 1.0)
    return (logits / temperature).log_softmax(dim=-1) if temperature > 0 else logits.log_softmax(dim=-1)


def sample(logits: Tensor, temperature: float, gens: list | None, *, exact: bool = False) -> tuple[Tensor, Tensor]:
    """(next token [B], its log-prob [B]) from logits [B, V] fp32.

    temperature > 0: logp = log_softmax(logits / T), next = argmax(logp - log E_b), E_b ~ Exp(1)
    per vocabulary entry from row b's generator (Gumbel-max: next ~ Categorical(exp(logp))).
    temperature 0: next = argmax(logits), logp = log_softmax(logits). exact: log_softmax is
    `policy.exact.scaled_log_softmax` (what the trainer's exact log-probs compute)."""
    logp = log_probs(logits, temperature, exact=exact)
    if temperature > 0:
        noise = torch.stack([torch.empty(logits.shape[-1]).exponential_(generator=g) for g in gens])
        nxt = (logp - noise.to(logits.device).clamp_min(1e-30).log()).argmax(dim=-1)
    else:
        nxt = logits.argmax(dim=-1)
    return nxt, logp.gather(-1, nxt[:, None]).squeeze(-1)


def _repeat_rows(cache: KVCache, n: int) -> None:
    """Share each prompt's cache with its n samples: row b becomes rows b*n .. b*n + n-1."""
    if n == 1:
        return
    cache.layers = [(k.repeat_interleave(n, dim=0), v.repeat_interleave(n, dim=0)) for k, v in cache.layers]
    cache.key_valid = cache.key_valid.repeat_interleave(n, dim=0)
    cache.next_pos = cache.next_pos.repeat_interleave(n, dim=0)


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    L = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), L, dtype=torch.bool)
    for b, p in enumerate(prompts):
        tokens[b, L - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        mask[b, L - len(p) :] = True
    return tokens, mask


@torch.no_grad()
def check_request(prompts: Sequence, *, n_samples: int, max_new_tokens: int, temperature: float) -> list[int]:
    """The checks every engine makes on a request (one line naming what is wrong); the prompt lengths."""
    if len(prompts) == 0:
        raise ValueError("no prompts")
    if n_samples < 1:
        raise ValueError(f"n_samples={n_samples} must be >= 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if not temperature >= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature={temperature} must be finite and >= 0")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError(f"empty prompt(s) at index {[b for b, n in enumerate(lens) if n == 0]}")
    return lens


def generate(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    n_samples: int = 1,
    max_new_tokens: int,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    seeds: Sequence[int] | None = None,
    eos_id: int | None = None,
    stop_ids: Sequence[int] = (),
    pad_id: int = 0,
    record_routes: bool = False,
) -> Generation:
    """Sample n_samples continuations of each prompt: the API every engine implements.

    model           a `policy.model.Transformer` holding the policy version's effective weights
                    (and its activation-quantization hook, installed by `policy.qat`)
    prompts         B prompts, each a non-empty sequence of token ids (lengths may differ)
    n_samples       samples per prompt; row b * n_samples + i of the result is sample i of prompt b
    seeds           one int per output row (B * n_samples): row r draws all its randomness from a
                    generator seeded by seeds[r], so a row's sample depends only on its prompt and
                    its seed, never on the other rows, the padding or the batch size (up to last-bit
                    float differences between batch shapes). Without seeds, the per-row seeds are
                    drawn from `generator` (or torch's global generator).
    max_new_tokens  at most this many new tokens per row (>= 1); prompt + new must fit max_seq_len
    temperature     sampling temperature (> 0), or 0 for greedy
    eos_id/stop_ids a row stops after producing one of these (the stop token is included)
    pad_id          what fills a row after it stopped
    record_routes   also return each token's expert ids per MoE layer (routing replay)

    Generation: tokens [R, N] long, logprobs [R, N] fp32, lengths [R] long, stopped [R] bool, on
    the CPU, with R = B * n_samples and N = max_new_tokens. Row r produced tokens[r, :lengths[r]];
    logprobs are the behavior log-probs, log_softmax(logits / temperature) of each sampled token
    (temperature 0: greedy, log-probs at temperature 1)."""
    cfg = model.cfg
    B = len(prompts)
    L = max(check_request(prompts, n_samples=n_samples, max_new_tokens=max_new_tokens, temperature=temperature))
    if L + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"longest prompt {L} + max_new_tokens {max_new_tokens} > max_seq_len {cfg.max_seq_len}")
    stop = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    tokens, mask = _checked_tokens(cfg, prompts, stop, pad_id)
    R = B * n_samples
    gens = row_generators(R, generator, seeds) if temperature > 0 else None

    device = model.lm_head.weight.device
    cache = KVCache(cfg, B, L + max_new_tokens, dtype=model.lm_head.weight.dtype, device=device)
    logits, ids = prefill(model, tokens.to(device), mask.to(device), cache, routes=True)
    _repeat_rows(cache, n_samples)
    logits = logits.repeat_interleave(n_samples, dim=0)
    ids = ids.repeat_interleave(n_samples, dim=0) if record_routes else None
    stop_t = torch.tensor(sorted(stop), dtype=torch.long, device=device)
    return _decode(model, cache, (logits, ids), max_new_tokens, temperature, gens, stop_t, pad_id)


def _checked_tokens(cfg, prompts: Sequence[Sequence[int]], stop: set, pad_id: int) -> tuple[Tensor, Tensor]:
    """The left-padded prompts and their mask; ValueError for a token id outside the vocabulary."""
    for t in stop | {pad_id}:
        if not 0 <= t < cfg.vocab_size:
            raise ValueError(f"token id {t} (stop/eos/pad) outside vocab of size {cfg.vocab_size}")
    tokens, mask = _left_pad(prompts, pad_id)
    if tokens.min() < 0 or tokens.max() >= cfg.vocab_size:
        raise ValueError(f"prompt token ids must be in [0, vocab_size={cfg.vocab_size})")
    return tokens, mask


def _decode(model, cache: KVCache, first: tuple, max_new_tokens: int, temperature: float, gens, stop_t, pad_id):
    """Sample from the prefilled rows' (logits [R, V], expert ids or None), then decode one token per
    step until every row stopped or max_new_tokens; the Generation on the CPU."""
    logits, ids = first
    R, device = logits.shape[0], logits.device
    out_routes = (
        None if ids is None else torch.zeros(R, max_new_tokens, *ids.shape[1:], dtype=torch.long, device=device)
    )
    out_tokens = torch.full((R, max_new_tokens), pad_id, dtype=torch.long, device=device)
    out_logp = torch.zeros(R, max_new_tokens, dtype=torch.float32, device=device)
    alive = torch.ones(R, dtype=torch.bool, device=device)
    stopped = torch.zeros(R, dtype=torch.bool, device=device)
    lengths = torch.zeros(R, dtype=torch.long, device=device)
    for step in range(max_new_tokens):
        nxt, lp = sample(logits, temperature, gens, exact=model.exact)
        out_tokens[:, step] = torch.where(alive, nxt, pad_id)
        out_logp[:, step] = torch.where(alive, lp, 0.0)
        if out_routes is not None:
            out_routes[:, step] = torch.where(alive[:, None, None], ids, 0)
        lengths += alive.long()
        hit = alive & torch.isin(nxt, stop_t)
        stopped |= hit
        alive &= ~hit
        if not alive.any() or step == max_new_tokens - 1:
            break
        # Finished rows keep stepping in lockstep, as padding nobody attends to.
        fed = torch.where(alive, nxt, pad_id)
        if out_routes is None:
            logits = decode_one_token(model, fed, alive, cache)
        else:
            logits, ids = decode_one_token(model, fed, alive, cache, routes=True)
    routes = None if out_routes is None else out_routes.cpu()
    return Generation(out_tokens.cpu(), out_logp.cpu(), lengths.cpu(), stopped.cpu(), routes)


@torch.no_grad()
def forced_logprobs(
    model: Transformer, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, pad_id: int = 0
) -> Tensor:
    """[B, N] fp32 log p(completions[b][t] | prompt b, completions[b][:t]) through generate's own path
    (left-padded `prefill`, then `decode_one_token` with the KV cache, fed the given tokens instead of
    samples), N the longest completion, 0 past a row's end. The teacher-forced forward
    (`model.token_logprobs` on trainer.sequences.pack's rows) must give the same values up to
    accumulation order: what the trainer learns is what generation computes."""
    if len(prompts) != len(completions) or not all(len(c) for c in completions):
        raise ValueError("forced_logprobs: one non-empty completion per prompt")
    L = max(check_request(prompts, n_samples=1, max_new_tokens=1, temperature=1.0))
    n = max(len(c) for c in completions)
    device = model.lm_head.weight.device
    tokens, mask = _left_pad(prompts, pad_id)
    forced = torch.full((len(prompts), n), pad_id, dtype=torch.long)
    for b, c in enumerate(completions):
        forced[b, : len(c)] = torch.as_tensor(list(c), dtype=torch.long)
    forced = forced.to(device)
    lengths = torch.tensor([len(c) for c in completions], device=device)
    cache = KVCache(model.cfg, len(prompts), L + n, dtype=model.lm_head.weight.dtype, device=device)
    logits = prefill(model, tokens.to(device), mask.to(device), cache)
    out = torch.zeros(len(prompts), n, dtype=torch.float32, device=device)
    for t in range(n):
        alive = t < lengths
        lp = log_probs(logits, 0.0, exact=model.exact).gather(-1, forced[:, t : t + 1]).squeeze(-1)
        out[:, t] = torch.where(alive, lp, 0.0)
        if t < n - 1:
            logits = decode_one_token(model, forced[:, t], alive & (t + 1 < lengths), cache)
    return out.cpu()
