"""Forward + backward of the torch and megatron-core trainer backends on the same model and batch.

Both hold the same bf16 weights; each step is logits -> cross-entropy -> backward (no optimizer),
plain bf16 and QAT (nvfp4_moe, int4_qat; hp backward). Prints, per backend and mode: ms/step,
tokens/s, peak GPU memory, and megatron's tokens/s relative to torch's in the same run.

    python3 bench/bench_megatron.py --preset small --layers 4 --batch 4 --seq 1024 [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import time

import torch
import torch.nn.functional as F

from policy.model import ModelConfig, Transformer
from policy.qat import apply_qat as torch_apply_qat
from policy.recipe import Recipe
from trainer import megatron_backend as mb


def _step(forward, tokens, vocab):
    logits = forward(tokens)
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    loss.backward()


def _time(forward, params, tokens, vocab, warmup, iters):
    for _ in range(warmup):
        _step(forward, tokens, vocab)
    for p in params:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        _step(forward, tokens, vocab)
        for p in params:
            p.grad = None
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters, torch.cuda.max_memory_allocated()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--modes", default="bf16,nvfp4_moe,int4_qat")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_megatron: needs a CUDA GPU", file=sys.stderr)
        return 2
    import torch.distributed as dist

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=300)
    )
    mb.init_parallel()
    cfg = ModelConfig.preset(args.preset, n_layers=args.layers, max_seq_len=max(args.seq, 1024))
    ref = Transformer(cfg, seed=0).to(device="cuda", dtype=torch.bfloat16)
    gpt = mb.build_gpt_model(cfg, dtype=torch.bfloat16, cpu_init=True).to("cuda")
    mb.load_canonical(gpt, cfg, dict(ref.named_parameters()))
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    n_tok = args.batch * args.seq
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}; {args.preset} x{args.layers} layers, {cfg.num_parameters() / 1e9:.2f}B params, {n_tok} tokens/step")
    results = []
    for mode in args.modes.split(","):
        row = {"mode": mode}
        for backend, model, forward in (
            ("torch", ref, ref),
            ("megatron", gpt, lambda t: mb.logits(gpt, t)),
        ):
            if mode != "bf16":
                if backend == "torch":
                    torch_apply_qat(ref, Recipe.load(mode))
                else:
                    mb.apply_qat(gpt, cfg, Recipe.load(mode))
            sec, peak = _time(forward, list(model.parameters()), tokens, cfg.vocab_size, args.warmup, args.iters)
            ref.quant_hook = None
            mb.remove_qat(gpt)
            row[backend] = {"ms": sec * 1e3, "tokens_per_s": n_tok / sec, "peak_gib": peak / 2**30}
            print(
                f"{mode:10s} {backend:9s} {sec * 1e3:8.1f} ms/step {n_tok / sec:10.0f} tok/s  peak {peak / 2**30:6.2f} GiB"
            )
        ratio = row["megatron"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
        row["megatron_over_torch"] = ratio
        print(f"{mode:10s} megatron/torch tokens/s = {ratio:.2f}x")
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "args": vars(args), "results": results}, f, indent=2)
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
