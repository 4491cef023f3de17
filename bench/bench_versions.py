"""The mismatch split's forward under an older version (trainer.versions.RetainedVersions): the
sampled rows in microbatch chunks, run one `token_logprobs` call per chunk (each call builds every
weight operand from the version's packed tensors again) against one call over all chunks, layer by
layer (each operand built once), in the same run, alternating, medians over repeats. Both give the
same log-probs bit for bit (checked). Ratio = per-chunk time / by-layer time.

    .venv/bin/python bench/bench_versions.py [--preset tiny --layers 4] [--recipe nvfp4_moe]
        [--rows 32 --row-len 1100 --microbatch-tokens 4096] [--repeats 3] [--device cuda]

On CUDA the defaults to use are the long workload's: `--preset qwen3-30b-a3b --layers 6 --rows 32
--row-len 1100` (configs/gpu-h200-long.yaml).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo: the device has no install
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_publish import timed  # noqa: E402

from policy import qat  # noqa: E402
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.recipe import Recipe  # noqa: E402
from trainer.versions import RetainedVersions  # noqa: E402


def _versions(cfg: ModelConfig, recipe: Recipe, device: str) -> RetainedVersions:
    """Version 1: a seeded model's QAT quantization, as the trainer retains it at a publish."""
    with torch.device(device):
        master = Transformer(cfg, seed=1)
    hook = qat.apply_qat(master, recipe)
    versions = RetainedVersions(cfg, hook.plan, keep=1)
    versions.add(1, hook.quantized_params(master), live=list(master.parameters()))
    return versions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--recipe", default="nvfp4_moe")
    ap.add_argument("--rows", type=int, default=12)
    ap.add_argument("--row-len", type=int, default=96)
    ap.add_argument("--microbatch-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig.preset(args.preset, n_layers=args.layers)
    versions = _versions(cfg, Recipe.load(args.recipe), args.device)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, cfg.vocab_size, (args.rows, args.row_len), generator=g).to(args.device)
    targets, attn = tokens.roll(-1, dims=1), torch.ones_like(tokens, dtype=torch.bool)
    chunks = torch.arange(args.rows, device=args.device).split(max(1, args.microbatch_tokens // args.row_len))
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    autocast = (
        torch.autocast("cuda", dtype=torch.bfloat16) if args.device == "cuda" else torch.autocast("cpu", enabled=False)
    )

    def per_chunk() -> torch.Tensor:
        return torch.cat([versions.token_logprobs(1, tokens[r], targets[r], attention_mask=attn[r]) for r in chunks])

    def by_layer() -> torch.Tensor:
        return versions.token_logprobs(1, tokens, targets, chunks=chunks, attention_mask=attn)

    print(
        f"[bench_versions] {args.preset} x{args.layers} layers ({cfg.num_parameters() / 1e9:.3f}B), {args.recipe}, "
        f"{args.rows} rows x {args.row_len} tokens in {len(chunks)} chunks, {args.device}",
        flush=True,
    )
    times: dict[str, list[float]] = {"per_chunk": [], "by_layer": []}
    builds: dict[str, int] = {}
    with autocast:
        for i in range(args.repeats + 1):  # the first round warms up, untimed
            a, ta = timed(sync, per_chunk)
            builds["per_chunk"] = versions.last_builds * len(chunks)
            b, tb = timed(sync, by_layer)
            builds["by_layer"] = versions.last_builds
            if not torch.equal(a.view(torch.int32), b.view(torch.int32)):
                raise SystemExit("[bench_versions] the two ways disagree: not bit for bit")
            if i:
                times["per_chunk"].append(ta)
                times["by_layer"].append(tb)
            print(f"[bench_versions] round {i}: per chunk {ta:.3f} s, by layer {tb:.3f} s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k in ("per_chunk", "by_layer"):
        print(f"{k:>10}: {med[k]:.4f} s median of {args.repeats}, {builds[k]} weight operand builds")
    print(f"per chunk / by layer = {med['per_chunk'] / med['by_layer']:.3f}x (same log-probs, bit for bit)")
    if args.device == "cuda":
        print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
