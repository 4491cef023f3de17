"""Policy model on CPU: forward, training step, QAT overhead per recipe, generation, MoE dispatch.

Baselines are measured in the same run: the plain (unquantized) model for QAT and rollout
overheads, and a dense "every expert on every token, then mask" MoE for the gathered dispatch.
Each variant is timed interleaved with its baseline (base, variant, base, variant, ...) and the
ratio is of the two medians, so load from other processes on a shared box hits both alike.

    .venv/bin/python bench/bench_model.py [--model tiny] [--batch 16] [--seq-len 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from policy.model import _PLAIN, ModelConfig, Transformer
from policy.qat import apply_qat, install_packed, quantize_weights, remove_qat
from policy.recipe import BUILTINS, Recipe
from rollout.engine import generate


def paired(base, variant, repeats: int, setup_base=lambda: None, setup_variant=lambda: None):
    """Medians (base seconds, variant seconds), measured alternately after one warm-up each."""
    times: tuple[list, list] = ([], [])
    for i in range(repeats + 1):
        for j, (setup, fn) in enumerate(((setup_base, base), (setup_variant, variant))):
            setup()
            t0 = time.perf_counter()
            fn()
            if i:
                times[j].append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def dense_moe(moe, x):
    """Baseline dispatch: run every expert on every token and weight by a mostly-zero gate matrix."""
    probs = F.linear(x, moe.gate.weight).softmax(-1)
    w, idx = probs.topk(moe.top_k, dim=-1)
    gates = torch.zeros_like(probs).scatter(1, idx, w / w.sum(-1, keepdim=True))
    out = torch.zeros_like(x)
    for e, ex in enumerate(moe.experts):
        g, u = F.linear(x, ex.gate_up_proj.weight).split(ex.ffn_dim, dim=-1)
        out += gates[:, e : e + 1] * F.linear(F.silu(g) * u, ex.down_proj.weight)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = ModelConfig.preset(args.model)
    model = Transformer(cfg, seed=0)
    toks = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    n_tok = toks.numel()
    print(
        f"model {args.model} ({cfg.num_parameters():,} params), batch {args.batch} x {args.seq_len} tokens, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )

    def fwd():
        with torch.no_grad():
            model(toks)

    def step():
        model.zero_grad(set_to_none=True)
        model.token_logprobs(toks, toks.roll(-1, 1)).mean().backward()

    print(
        f"\n{'path':<20}{'fwd ms':>9}{'(plain)':>9}{'ratio':>7}{'fwd+bwd ms':>12}{'(plain)':>9}{'ratio':>7}"
        f"{'refresh ms':>12}"
    )
    for name in BUILTINS:
        hook = apply_qat(model, Recipe.load(name))
        remove_qat(model)
        plain = lambda: remove_qat(model)  # noqa: E731
        qat = lambda: setattr(model, "quant_hook", hook)  # noqa: E731
        bf, qf = paired(fwd, fwd, args.repeats, plain, qat)
        bs, qs = paired(step, step, args.repeats, plain, qat)

        def refresh():
            hook.invalidate()
            hook.effective_weights(model)

        refresh_s = statistics.median([paired(refresh, refresh, 1)[0] for _ in range(args.repeats)])
        print(
            f"{'QAT ' + name:<20}{qf * 1e3:>9.1f}{bf * 1e3:>9.1f}{qf / bf:>7.2f}{qs * 1e3:>12.1f}"
            f"{bs * 1e3:>9.1f}{qs / bs:>7.2f}{refresh_s * 1e3:>12.1f}"
        )
    remove_qat(model)
    print("(refresh = fake-quantizing every weight again after an optimizer step; once per step)")

    prompts = torch.randint(0, cfg.vocab_size, (args.batch, 32), generator=torch.Generator().manual_seed(1)).tolist()
    prompts = [p[: 8 + (i * 7) % 25] for i, p in enumerate(prompts)]  # ragged: left padding in play
    rollout = Transformer(cfg, seed=0)
    r = Recipe.load("nvfp4_moe")
    install_packed(rollout, r, quantize_weights(model, r))

    def gen(m):
        return lambda: generate(m, prompts, max_new_tokens=args.new_tokens, seeds=range(len(prompts)))

    g_plain, g_roll = paired(gen(model), gen(rollout), max(1, args.repeats // 2))
    new = args.batch * args.new_tokens
    print(f"\ngenerate {args.batch} ragged prompts x {args.new_tokens} new tokens (KV cache):")
    print(f"  plain            {g_plain:.3f} s  {new / g_plain:,.0f} tok/s")
    print(
        f"  nvfp4_moe packed {g_roll:.3f} s  {new / g_roll:,.0f} tok/s  ratio {g_roll / g_plain:.2f} "
        f"(per-token nvfp4 activation quant)"
    )

    moe = model.model.layers[0].mlp
    x = torch.randn(n_tok, cfg.dim, generator=torch.Generator().manual_seed(2))
    shared = (lambda: moe.shared_expert(x, _PLAIN)) if moe.shared_expert is not None else (lambda: 0)
    with torch.no_grad():
        t_dense, t_gather = paired(lambda: dense_moe(moe, x) + shared(), lambda: moe(x, _PLAIN), args.repeats)
    print(
        f"\nMoE block, {n_tok} tokens, {cfg.n_experts} experts top-{cfg.top_k}: gathered dispatch "
        f"{t_gather * 1e3:.1f} ms vs dense all-experts {t_dense * 1e3:.1f} ms "
        f"(speed-up {t_dense / t_gather:.2f}x)"
    )


if __name__ == "__main__":
    main()
