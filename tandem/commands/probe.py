"""`tandem probe --model PRESET --recipe RECIPE`: train/rollout mismatch of a recipe, measured.

Runs three forwards over the same tokens: BF16 (the `bf16` recipe), QAT (trainer side) and the
model with weights loaded from the packed quantized tensors plus per-token activation quantization
(rollout side), and prints mean |Δ log-prob| of the target tokens and KL over the vocabulary for
each pair. The QAT and packed forwards use bitwise-identical weights, so their row should be zero.

Without --weights the model is randomly initialized (seeded); its near-uniform predictions make the
absolute numbers small, so compare recipes against each other. --weights takes a torch file with a
canonical-name state dict (or {"model": state_dict}), read with weights_only=True, for a model of
the --model preset. --run-dir takes what a run trained: the model config and recipe from the run's
config.yaml and the weights from its newest checkpoint (or that of --version V). Tokens are sampled
from the BF16 model itself (what a rollout would score), unless --random-tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from policy.model import PRESETS, ModelConfig, Transformer
from policy.qat import probe_mismatch
from policy.recipe import BUILTINS, Recipe
from rollout.engine import generate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help=f"model preset: {', '.join(PRESETS)} (default tiny)")
    p.add_argument(
        "--recipe",
        action="append",
        help=f"built-in ({', '.join(BUILTINS)}) or YAML file; repeatable (default: every built-in)",
    )
    p.add_argument("--weights", metavar="FILE", help="canonical-name state dict (torch file) for --model")
    p.add_argument("--run-dir", metavar="DIR", help="a run folder: its model, recipe and checkpoint weights")
    p.add_argument("--version", type=int, help="with --run-dir: the checkpoint of this policy version (default newest)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--random-tokens", action="store_true", help="score uniform random tokens")
    p.add_argument("--json", action="store_true")


def _run_model(args) -> tuple[Transformer, Recipe, str]:
    """The model of a run folder with the weights of its newest checkpoint (or of --version)."""
    from pathlib import Path

    from tandem import config, services
    from trainer.checkpoints import checkpoint_of_version

    run_dir = Path(args.run_dir)
    _, model_config, recipe = services.task_and_model(config.load(run_dir / "config.yaml"))
    _, ck = checkpoint_of_version(run_dir / "checkpoints", args.version)
    model = Transformer(model_config, seed=args.seed)
    model.load_weights(ck["model"])
    what = f"run {run_dir.name} step {ck['state']['step']} version {ck['weights_version']}"
    return model.eval(), recipe, what


def _model(args) -> Transformer:
    cfg = ModelConfig.preset(args.model)
    if cfg.num_parameters() > 2e9:
        raise ValueError(
            f"--model {args.model} has {cfg.num_parameters():,} parameters; the CPU probe is meant for models up to ~2B"
        )
    model = Transformer(cfg, seed=args.seed)
    if args.weights:
        state = torch.load(args.weights, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
            state = state["model"]
        model.load_weights(state)
    return model.eval()


def main(args) -> int:
    if args.batch < 1 or args.seq_len < 2:
        print(f"tandem probe: need --batch >= 1 and --seq-len >= 2, got {args.batch}, {args.seq_len}", file=sys.stderr)
        return 2
    if args.run_dir and args.weights:
        print("tandem probe: --run-dir and --weights exclude each other", file=sys.stderr)
        return 2
    if args.version is not None and not args.run_dir:
        print("tandem probe: --version needs --run-dir", file=sys.stderr)
        return 2
    try:
        if args.run_dir:
            model, run_recipe, source = _run_model(args)
            recipes = [Recipe.load(r) for r in args.recipe] if args.recipe else [run_recipe]
        else:
            recipes = [Recipe.load(r) for r in (args.recipe or BUILTINS)]
            model = _model(args)
            source = "weights " + args.weights if args.weights else f"random init seed {args.seed}"
    except ValueError as e:
        hint = " (a run's checkpoint? use --run-dir RUN_FOLDER)" if args.weights and "bad shapes" in str(e) else ""
        print(f"tandem probe: {e}{hint}", file=sys.stderr)
        return 2
    cfg = model.cfg
    g = torch.Generator().manual_seed(args.seed)
    if args.random_tokens:
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len), generator=g)
    else:
        prompts = torch.randint(0, cfg.vocab_size, (args.batch, 4), generator=g).tolist()
        gen = generate(model, prompts, max_new_tokens=args.seq_len - 4, generator=g)
        tokens = torch.cat([torch.tensor(prompts), gen.tokens], dim=1)

    results = []
    for recipe in recipes:
        t0 = time.perf_counter()
        res = probe_mismatch(model, recipe, tokens)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        results.append(res)
    if args.json:
        print(
            json.dumps(
                {"model": args.model, "weights": source, "tokens": results[0]["tokens"], "results": results},
                indent=1,
            )
        )
        return 0
    print(
        f"model {'of the run' if args.run_dir else args.model} ({cfg.num_parameters():,} params, {source}), "
        f"{results[0]['tokens']} scored tokens"
    )
    print(f"{'recipe':<12}{'pair':<14}{'mean|Δlogp|':>13}{'max|Δlogp|':>12}{'KL':>12}")
    for res in results:
        for pair, m in res["pairs"].items():
            print(
                f"{res['recipe']:<12}{pair:<14}{m['mean_abs_dlogp']:>13.3e}{m['max_abs_dlogp']:>12.3e}{m['kl']:>12.3e}"
            )
        print(
            f"{'':<12}QAT vs packed weights bitwise equal: {res['weights_bitwise_equal']}, "
            f"log-probs bitwise equal: {res['logits_bitwise_equal']} ({res['seconds']} s)"
        )
    return 0
