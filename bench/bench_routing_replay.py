"""Routing replay on the CPU: router agreement and the rollout/trainer log-prob mismatch, replay off
against on, in the two situations where the trainer's forward differs from the rollout's.

- quant: the rollout computes with the published tensors (policy.qat.install_packed, what a CPU
  worker runs), the trainer with its QAT forward of the same masters (same operands, other
  accumulation order): the mismatch the Compute contract leaves.
- stale: the trainer's masters one Adam-like step ahead (every weight moved by +-lr, lr 1e-3),
  QAT forward: a sample one version behind.
Per setting, over the completion tokens of greedy-free samples (temperature 1): the fraction of
(token, MoE layer) pairs whose top-k set differs without replay, the fraction of tokens routed
differently in at least one layer, and the mean / median / max |logp_rollout - logp_trainer| with
replay off and on. One JSON line per setting.

    .venv/bin/python bench/bench_routing_replay.py [--model demo] [--recipe nvfp4_moe] [--samples 32]
"""

from __future__ import annotations

import argparse
import json

import torch

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.engine import generate
from trainer.sequences import pack, scatter_routes


def measure(rollout: Transformer, trainer: Transformer, prompts, *, n_samples: int, max_new: int) -> dict:
    """Router agreement and |Δlogp| (replay off / on) of `trainer` on `rollout`'s samples."""
    with torch.no_grad():
        seeds = list(range(len(prompts) * n_samples))
        gen = generate(rollout, prompts, n_samples=n_samples, max_new_tokens=max_new, seeds=seeds, record_routes=True)
        comps = gen.completions()
        tokens, targets, attn, mask = pack([prompts[r // n_samples] for r in range(len(comps))], comps, 0)
        layers, k = gen.routes.shape[2], gen.routes.shape[3]
        routes = scatter_routes(
            [gen.routes[r, :n].numpy() for r, n in enumerate(gen.lengths.tolist())], mask, layers, k
        )
        on = mask > 0
        behav = torch.cat([gen.logprobs[r, :n] for r, n in enumerate(gen.lengths.tolist())])
        free, used = trainer.token_logprobs(tokens, targets, attention_mask=attn, return_routes=True)
        replay = trainer.token_logprobs(tokens, targets, attention_mask=attn, routes=routes)
    differ = (used[on].sort(dim=-1).values != routes[on].sort(dim=-1).values).any(dim=-1)  # [tokens, layers]
    out = {"tokens": int(on.sum()), "router_pairs_differ": float(differ.double().mean())}
    out["tokens_routed_differently"] = float(differ.any(dim=-1).double().mean())
    for name, logp in (("off", free), ("on", replay)):
        d = (logp[on] - behav).abs().double()
        out[f"dlogp_{name}"] = {"mean": float(d.mean()), "p50": float(d.median()), "max": float(d.max())}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="demo")
    ap.add_argument("--recipe", default="nvfp4_moe")
    ap.add_argument("--samples", type=int, default=32, help="samples (8 prompts x samples / 8)")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-3)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = ModelConfig.preset(args.model)
    recipe = Recipe.load(args.recipe)
    master = Transformer(cfg, seed=1)
    plan = recipe.plan(master)
    rollout = Transformer(cfg, seed=None)
    qat.install_packed(rollout, plan, qat.quantize_weights(master, plan))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, cfg.vocab_size, (6 + i,), generator=g).tolist() for i in range(8)]
    n = max(1, args.samples // len(prompts))

    trainer = Transformer(cfg, seed=None)
    trainer.load_weights({k: v.detach().clone() for k, v in master.named_parameters()})
    qat.apply_qat(trainer, plan)
    print(
        json.dumps(
            {
                "setting": "quant",
                "recipe": args.recipe,
                **measure(rollout, trainer, prompts, n_samples=n, max_new=args.max_new),
            }
        )
    )

    stale = Transformer(cfg, seed=None)
    with torch.no_grad():
        stepped = {k: v - args.lr * torch.randn(v.shape, generator=g).sign() for k, v in master.named_parameters()}
    stale.load_weights(stepped)
    qat.apply_qat(stale, plan)
    row = measure(rollout, stale, prompts, n_samples=n, max_new=args.max_new)
    print(json.dumps({"setting": "stale", "recipe": args.recipe, "lr": args.lr, **row}))


if __name__ == "__main__":
    main()
