"""Write the Hugging Face folder that configs/gpu-h200.yaml trains (its `model.checkpoint`).

    python3 bench/make_e2e_model.py --config configs/gpu-h200.yaml [--layers 6] [--warmstart-steps 30]

The model is a preset's widths (default Qwen3-30B-A3B: 4.36B parameters at 6 layers) cut to
`--layers`, RANDOM INIT (no weights can be downloaded on the GPU machine; say so wherever its
numbers are quoted), then `--warmstart-steps` supervised steps on the run config's task (its
reference answers, trainer/warmstart.py, bf16 autocast on CUDA; AdamW, `--warmstart-warmup` steps of
linear warmup to `--warmstart-lr`, then cosine decay to 0 by default) so that GRPO has some reward signal,
saved in bf16 with policy.checkpoint.save_hf. The folder gets `tandem_e2e.json` with these
arguments: a second call with the same arguments reuses the folder instead of writing it again.

The warm start is supervised on the task's own rows: prompt -> reference answer + <eos>, the
completion the task's verifier rewards (rollout/jsonl_task.py: the last number of the completion
decoded up to the first <eos>; a completion without <eos> gets 0). After it the script evaluates
what the RL run starts from: `--eval-prompts` of the run's own prompts (task.prompt(0..n-1), what
the trainer feeds first), one sampled completion each at the run's temperature under the run's
recipe (QAT: the operands the rollouts compute with), at most the task's max_new_tokens, scored by
the task; and the same greedily. The fraction ending in <eos>, the mean reward and the mean length
go into `tandem_e2e.json` ("eval") and the log. Then a self-check (`decode_check`, in the log and
`tandem_e2e.json` "decode_check"): teacher-forced vs prefill + KV-cache decode log-probs of 8 reference answers, on
the MoE's default path and its loop over experts, which must agree, and the answer loss per variant
(a warm-start loss far below the answer loss afterwards means the forward trained is not the one
saved). A fixture for system measurements, not a model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from pathlib import Path

import torch

from policy import qat
from policy.checkpoint import save_hf
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout.engine import generate
from rollout.tasks import make_task
from tandem import config as run_config
from trainer.sequences import pack
from trainer.warmstart import warm_start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/gpu-h200.yaml", help="run config: its task, seed and checkpoint path")
    ap.add_argument("--out", help="folder to write (default: the config's model.checkpoint)")
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--override", action="append", default=[], metavar="FIELD=INT",
                    help="a ModelConfig field (e.g. dim=128 for a CPU dry run); repeatable")  # fmt: skip
    ap.add_argument("--warmstart-steps", type=int, default=120)
    ap.add_argument("--warmstart-batch", type=int, default=64)
    ap.add_argument("--warmstart-lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--warmstart-warmup", type=int, default=12, help="linear warmup steps")
    ap.add_argument("--warmstart-schedule", choices=("cosine", "constant"), default="cosine",
                    help="after the warmup: cosine decay to 0, or constant (the fixture before: 5e-4, no warmup)")  # fmt: skip
    ap.add_argument(
        "--eval-prompts", type=int, default=64, help="prompts of the evaluation after the warm start (0: none)"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    cfg = run_config.load(args.config, [])
    out = Path(args.out or cfg.model.checkpoint)
    if not str(out):
        print(f"make_e2e_model: {args.config} names no model.checkpoint; pass --out", file=sys.stderr)
        return 2
    fields = {}
    for item in args.override:
        key, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            print(f"make_e2e_model: --override {item!r} is not FIELD=INT", file=sys.stderr)
            return 2
        fields[key] = int(value)
    # The run's max_seq_len (the one field a run may set beside a checkpoint), so the evaluation fits
    # the run's task.max_new_tokens.
    if "max_seq_len" in cfg.model.overrides:
        fields.setdefault("max_seq_len", int(cfg.model.overrides["max_seq_len"]))
    model_config = ModelConfig.preset(args.preset, n_layers=args.layers, **fields)
    task = make_task(cfg.task, seed=cfg.loop.seed)
    if task.tokenizer.vocab_size > model_config.vocab_size:
        print(f"make_e2e_model: the tokenizer has {task.tokenizer.vocab_size} tokens, the model "
              f"{model_config.vocab_size}", file=sys.stderr)  # fmt: skip
        return 2
    recipe = {k: v for k, v in vars(args).items() if k not in ("config", "out", "device", "eval_prompts")}
    recipe.update(model=model_config.to_dict(), task=cfg.task.path, seed=cfg.loop.seed, init="random")
    recipe = json.loads(json.dumps(recipe))  # as it reads back (tuples become lists)
    marker = out / "tandem_e2e.json"
    if marker.is_file() and json.loads(marker.read_text()).get("args") == recipe:
        print(f"[make_e2e_model] {out} is up to date ({model_config.num_parameters() / 1e9:.2f}B parameters)")
        return 0

    t0 = time.perf_counter()
    device = torch.device(args.device)
    with device:
        model = Transformer(model_config, seed=cfg.loop.seed)
    print(f"[make_e2e_model] {args.preset} x{args.layers} layers, {model_config.num_parameters() / 1e9:.2f}B "
          f"parameters, random init on {device} ({time.perf_counter() - t0:.1f}s)", flush=True)  # fmt: skip
    if args.warmstart_steps:
        rng = random.Random(cfg.loop.seed + 17)

        def example():
            p = task.example(rng)
            return p.tokens, p.reference

        losses = warm_start(
            model,
            example,
            steps=args.warmstart_steps,
            batch=args.warmstart_batch,
            lr=args.warmstart_lr,
            pad_id=task.tokenizer.pad_id,
            warmup=args.warmstart_warmup,
            kind=args.warmstart_schedule,
            autocast_dtype=torch.bfloat16 if device.type == "cuda" else None,
            log=lambda s: print(f"[make_e2e_model] {s}", flush=True),
        )
    model.zero_grad(set_to_none=True)  # the warm start's last gradients (17 GB at 4B parameters)
    t_eval = time.perf_counter()
    scores = evaluate(model, task, cfg, n=args.eval_prompts) if args.eval_prompts else None
    if scores:
        print(f"[make_e2e_model] eval over {args.eval_prompts} of the run's prompts ({cfg.recipe}, max "
              f"{task.max_new_tokens} new tokens): " + "; ".join(
                  f"{k} reward {v['reward_mean']:.3f}, ended with eos {v['eos_frac']:.2f}, mean length {v['mean_len']:.1f}"
                  for k, v in scores.items() if isinstance(v, dict)) + f"; probability outside the tokenizer's "
              f"vocabulary {scores['outside_vocab_mass']:.3f} ({time.perf_counter() - t_eval:.1f}s)", flush=True)  # fmt: skip
    check = None
    if args.eval_prompts:
        t_check = time.perf_counter()
        check = decode_check(model, task, cfg, n=min(8, args.eval_prompts))
        print(f"[make_e2e_model] decode check over {check['prompts']} reference answers ({cfg.recipe}; teacher-forced "
              f"vs prefill + KV-cache decode log-probs, which must agree): " + "; ".join(
                  f"{k} max |d| {v['max_abs_dlogp']:.3f}, mean {v['mean_abs_dlogp']:.4f}, <eos> log-prob "
                  f"{v['eos_logp_teacher']:.3f} vs {v['eos_logp_decode']:.3f}, answer loss {v['answer_loss_teacher']:.3f}"
                  for k, v in check.items() if isinstance(v, dict)) + f" ({time.perf_counter() - t_check:.1f}s)",
              flush=True)  # fmt: skip
    t1 = time.perf_counter()
    marker.unlink(missing_ok=True)  # a folder half rewritten is never taken as up to date
    save_hf(out, model_config, model.named_parameters(), metadata={"tandem_init": "random + warm start"})
    final_loss = round(losses[-1], 4) if args.warmstart_steps else None
    marker.write_text(
        json.dumps(
            {"args": recipe, "warmstart_final_loss": final_loss, "eval": scores, "decode_check": check}, indent=2
        )
        + "\n"
    )
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"[make_e2e_model] wrote {out}: {size / 1e9:.2f} GB of bf16 safetensors in {time.perf_counter() - t1:.1f}s")
    return 0


@torch.no_grad()
def evaluate(model: Transformer, task, cfg, *, n: int) -> dict:
    """What the RL run starts from, over its first `n` prompts (max_new_tokens of the task):
    sampled       one completion per prompt at the run's temperature under the run's recipe (QAT:
                  the operands its rollouts compute with): reward_mean, eos_frac (ended with <eos>
                  before max_new_tokens), mean_len
    greedy        the same at temperature 0
    sampled_bf16  sampled under the bf16 recipe (what the warm start trained: the difference to
                  `sampled` is the recipe's quantization)
    outside_vocab_mass  mean probability (run's recipe, teacher-forced on the reference answers)
                  on token ids the tokenizer never produces (ids >= its vocab_size: the model's
                  151,936-token vocabulary is kept), which a temperature-1 sample can draw."""
    device = model.lm_head.weight.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    saved = model.quant_hook
    prompts = [task.prompt(i) for i in range(n)]
    tok = task.tokenizer
    out, hooks = {}, {}  # one QAT hook per recipe: its cache is filled once
    try:
        for name, recipe, temperature in (
            ("sampled", cfg.recipe, cfg.loop.temperature),
            ("greedy", cfg.recipe, 0.0),
            ("sampled_bf16", "bf16", cfg.loop.temperature),
        ):
            if recipe not in hooks:
                hooks[recipe] = qat.apply_qat(model, Recipe.load(recipe))
            model.quant_hook = hooks[recipe]
            with autocast:
                gen = generate(
                    model,
                    [p.tokens for p in prompts],
                    max_new_tokens=task.max_new_tokens,
                    temperature=temperature,
                    seeds=list(range(n)),
                    eos_id=tok.eos_id,
                    pad_id=tok.pad_id,
                )
            rewards = [task.score(gen.tokens[i, : gen.lengths[i]].tolist(), p.fields) for i, p in enumerate(prompts)]
            out[name] = {
                "recipe": recipe,
                "temperature": temperature,
                "reward_mean": round(sum(rewards) / n, 4),
                "eos_frac": round(float(gen.stopped.float().mean()), 4),
                "mean_len": round(float(gen.lengths.float().mean()), 2),
            }
        model.quant_hook = hooks[cfg.recipe]
        tokens, targets, attn, mask = (
            t.to(device) for t in pack([p.tokens for p in prompts], [p.reference for p in prompts], tok.pad_id)
        )
        with autocast:
            logp = model(tokens, attention_mask=attn).float().log_softmax(-1)
        outside = logp[..., tok.vocab_size :].logsumexp(-1).exp()[mask > 0]
        out["outside_vocab_mass"] = round(float(outside.mean()), 4) if outside.numel() else 0.0
    finally:
        model.quant_hook = saved
    return out


@torch.no_grad()
def decode_check(model: Transformer, task, cfg, *, n: int) -> dict:
    """Teacher-forced vs generation-path log-probs of the reference answers (+ <eos>) of the run's
    first `n` prompts under the run's recipe: the warm start's forward (right-padded rows,
    trainer.sequences.pack) against generate's (left-padded prefill, then the KV-cache decode fed
    the same tokens: rollout.engine.forced_logprobs). They must agree up to bf16 noise; a gap says
    generation computes another function than the one trained. Variants, to tell where a gap comes
    from: `plain` (the warm start's forward, without the recipe's QAT hook), `grouped` (MoE.grouped True: the grouped GEMM, the default on CUDA bf16), `loop` (MoE.grouped
    False: a loop over experts) and `loop_math_sdpa` (the loop, and attention by SDPA's math kernel).
    Each: max and mean |d log-prob| over the answer tokens, and the mean <eos> log-prob both ways."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from policy.model import MoE
    from rollout.engine import forced_logprobs

    device = model.lm_head.weight.device
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    prompts = [task.prompt(i) for i in range(n)]
    answers = [p.reference for p in prompts]
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    saved_hook, saved_grouped = model.quant_hook, [m.grouped for m in moes]
    out: dict = {"prompts": n, "recipe": cfg.recipe}
    try:
        run_hook = qat.apply_qat(model, Recipe.load(cfg.recipe))
        for name, hook, grouped, math_only in (
            ("plain", saved_hook, None, False),  # the warm start's own forward: no QAT hook
            ("grouped", run_hook, True, False),
            ("loop", run_hook, False, False),
            ("loop_math_sdpa", run_hook, False, True),
        ):
            model.quant_hook = hook
            for m in moes:
                m.grouped = grouped
            kernels = sdpa_kernel([SDPBackend.MATH]) if math_only else contextlib.nullcontext()
            with autocast, kernels:
                decoded = forced_logprobs(model, [p.tokens for p in prompts], answers, pad_id=task.tokenizer.pad_id)
                tokens, targets, attn, mask = (
                    t.to(device) for t in pack([p.tokens for p in prompts], answers, task.tokenizer.pad_id)
                )
                lp = model.token_logprobs(tokens, targets, attention_mask=attn).cpu()
            mask = mask.cpu()
            teacher = [lp[b][mask[b] > 0] for b in range(n)]
            diffs = torch.cat([(decoded[b, : len(a)] - teacher[b]).abs() for b, a in enumerate(answers)])
            out[name] = {
                "max_abs_dlogp": round(float(diffs.max()), 4),
                "mean_abs_dlogp": round(float(diffs.mean()), 4),
                "eos_logp_teacher": round(sum(float(t[-1]) for t in teacher) / n, 4),
                "answer_loss_teacher": round(-float(torch.cat(teacher).mean()), 4),
                "eos_logp_decode": round(sum(float(decoded[b, len(a) - 1]) for b, a in enumerate(answers)) / n, 4),
            }
    finally:
        model.quant_hook = saved_hook
        for m, g in zip(moes, saved_grouped):
            m.grouped = g
    return out


if __name__ == "__main__":
    sys.exit(main())
