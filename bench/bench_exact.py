"""Exact mode's cost: the model engine's decode rate and the trainer's recompute time with
`loop.exact` off and on, in the same run, interleaved, medians over repeats, on the CPU or CUDA.

Engine: `rollout.engine.generate` on the published tensors (policy.qat.install_packed, what a worker
runs on the CPU, and in exact mode on CUDA: there the default-mode baseline is this same engine, not
the faster packed one), ragged prompts, every row decoding max_new tokens (no stop token). Recompute: the
trainer's QAT forward of the same masters (`Transformer.token_logprobs`, no grad) on the packed
samples. Ratio = exact time / default time (the slowdown); the target is <= 1.10. Also counts the
completion tokens whose exact-mode log-probs equal the recompute's bit for bit.

    .venv/bin/python bench/bench_exact.py [--model tiny] [--recipe nvfp4_moe] [--threads 1] [--repeats 3]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.engine import generate
from trainer.sequences import pack

TARGET = 1.10


def _models(cfg: ModelConfig, recipe: Recipe, exact: bool, device: str) -> tuple[Transformer, Transformer]:
    """(the rollout's model on the published tensors, the trainer's QAT model), one masters' seed."""
    with torch.device(device):
        master = Transformer(cfg, seed=1)
        rollout = Transformer(cfg, seed=None)
    hook = qat.apply_qat(master, recipe, exact=exact)
    qat.install_packed(rollout, hook.plan, qat.quantize_weights(master, hook.plan), exact=exact)
    return rollout, master


def _run(rollout: Transformer, master: Transformer, prompts: list, args) -> tuple[float, float, int, int]:
    """-> (generate seconds, recompute seconds, completion tokens, tokens equal to the recompute)."""
    seeds = list(range(len(prompts) * args.samples))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    with torch.no_grad():
        sync()
        t0 = time.perf_counter()
        gen = generate(rollout, prompts, n_samples=args.samples, max_new_tokens=args.max_new, seeds=seeds)
        sync()
        t1 = time.perf_counter()
        rows = [prompts[r // args.samples] for r in range(len(seeds))]
        tokens, targets, attn, mask = (t.to(args.device) for t in pack(rows, gen.completions(), 0))
        sync()
        t2 = time.perf_counter()
        logp = master.token_logprobs(tokens, targets, attention_mask=attn)
        sync()
        t3 = time.perf_counter()
    on = mask > 0
    behav = torch.cat([gen.logprobs[r, :n] for r, n in enumerate(gen.lengths.tolist())]).to(args.device)
    return t1 - t0, t3 - t2, int(on.sum()), int((logp[on] == behav).sum())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--recipe", default="nvfp4_moe")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=4, help="samples per prompt")
    ap.add_argument("--max-new", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg, recipe = ModelConfig.preset(args.model), Recipe.load(args.recipe)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, cfg.vocab_size, (8 + 4 * i,), generator=g).tolist() for i in range(args.prompts)]
    models = {mode: _models(cfg, recipe, mode, args.device) for mode in (False, True)}
    times = {mode: ([], []) for mode in models}
    counts = {}
    for _ in range(args.repeats):  # interleaved: load on the shared box hits both modes alike
        for mode, (rollout, master) in models.items():
            gen_s, rec_s, n, equal = _run(rollout, master, prompts, args)
            times[mode][0].append(gen_s)
            times[mode][1].append(rec_s)
            counts[mode] = (n, equal)
    _report(args, times, counts)


def _report(args, times: dict, counts: dict) -> None:
    n = counts[False][0]
    gen = {m: statistics.median(t[0]) for m, t in times.items()}
    rec = {m: statistics.median(t[1]) for m, t in times.items()}
    print(f"model {args.model}, recipe {args.recipe}, {args.device}, {args.prompts} prompts x {args.samples} samples x "
          f"{args.max_new} new tokens ({n} completion tokens), {args.threads} thread(s), median of {args.repeats}")  # fmt: skip
    print("| measure | exact off | exact on | slowdown (on time / off time) | target | |")
    print("|---|---|---|---|---|---|")
    engine, recompute = gen[True] / gen[False], rec[True] / rec[False]
    for name, off, on, ratio in (
        ("engine decode, tok/s", n / gen[False], n / gen[True], engine),
        ("trainer recompute, s", rec[False], rec[True], recompute),
    ):
        verdict = "met" if ratio <= TARGET else "missed"
        print(f"| {name} | {off:.3f} | {on:.3f} | {ratio:.3f} | <= {TARGET:.2f} | {verdict} |")
    for mode in (False, True):
        tokens, equal = counts[mode]
        print(f"exact {'on' if mode else 'off'}: {equal} of {tokens} completion tokens bitwise equal to the recompute")


if __name__ == "__main__":
    main()
