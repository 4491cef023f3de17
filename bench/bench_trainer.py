"""Trainer step and publish on one GPU: plain bf16 vs QAT (nvfp4_moe, int4_qat), same model, same batch.

    python bench/bench_trainer.py                          # Qwen3-30B-A3B widths, 6 layers (~4.4B), 8 x 1024 tokens
    python bench/bench_trainer.py --layers 2 --batch 2     # smaller
    python bench/bench_trainer.py --device cpu --preset tiny --batch 8 --seq 64   # CPU smoke run

Each configuration builds the same model (fp32 master weights, AdamW, bf16 autocast on CUDA),
takes `--warmup` untimed steps (Triton compiles, the allocator settles), then `--steps` timed ones:
forward + backward of the GRPO-shaped loss (a token log-prob sum), clip, optimizer step. Under QAT
the optimizer's step post-hook invalidates the effective-weight cache, so every timed step pays
one quantization of every weight (what the trainer pays), inside the step, on the GPU.
Printed per configuration: ms per step, tokens/s, the ratio to plain (issue 17's target: QAT
<= 1.3x plain, goal 1.1x), peak memory and its excess over plain (target: <= one copy of the
quantized weights), and a publish of the current version: the quantized parts from the QAT cache
(no second quantization) -> broker.frames (D2H into a pooled page-locked buffer laid out as the gRPC
messages, checksums in a thread pool) -> PolicyServer.publish, in seconds and GB/s.

Then publishing off the step, as the trainer does it (trainer.publisher): `--publish-steps` more steps,
each followed by a publish of its version in the background while the next step runs; printed: the
step time meanwhile (vs the timed steps above) and `publish_blocked_s`, the time the step's thread
spent on publishing: waiting for the previous publish (back-pressure: at most one in flight) plus
describing the quantized parts (`broker.frames.stage`); not the QAT cache refill, which the next
step's forward would do anyway.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--recipes", default="bf16,nvfp4_moe,int4_qat", help="bf16 = plain (no QAT)")
    parser.add_argument("--publish-steps", type=int, default=3, help="steps with a background publish after each")
    args = parser.parse_args(argv)

    from broker import frames
    from broker.policy_server import PolicyServer, PolicyServerConfig
    from policy import manifest as mf
    from policy import qat
    from policy.model import ModelConfig, Transformer
    from policy.recipe import Recipe
    from trainer.publisher import Publisher

    cuda = args.device.startswith("cuda")
    cfg = ModelConfig.preset(args.preset, n_layers=args.layers, max_seq_len=max(args.seq, 64))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(args.device)
    n_tokens = tokens.numel()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = {}
    for name in args.recipes.split(","):
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with torch.device(args.device):
            model = Transformer(cfg, seed=0)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=cuda)
        recipe = Recipe.load(name)
        if name != "bf16":
            qat.apply_qat(model, recipe, optimizer=opt)

        def step(model=model, opt=opt):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda):
                logp = model.token_logprobs(tokens[:, :-1], tokens[:, 1:])
            opt.zero_grad(set_to_none=True)
            (-logp.mean()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        for _ in range(args.warmup):
            step()
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        step_s = (time.perf_counter() - t0) / args.steps
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

        # Publish the current version: the quantized parts QAT already holds (plain: quantize now).
        def quantized(model=model, recipe=recipe):
            if model.quant_hook is None:
                return mf.quantize_params(dict(model.named_parameters()), recipe.plan(cfg))
            return model.quant_hook.quantized_params(model)

        sync()
        t0 = time.perf_counter()
        tensors = quantized()
        sync()
        quant_s = time.perf_counter() - t0
        contract = mf.contract_from_recipe(model_config=cfg, recipe=recipe)
        pool = frames.BufferPool(pin=cuda)
        server = PolicyServer(PolicyServerConfig(keep_versions=1))
        server.start()
        t0 = time.perf_counter()
        framed = frames.build_framed(version=1, parent_version=None, contract=contract, tensors=tensors, pool=pool)
        build_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.publish(framed)
        serve_s = time.perf_counter() - t0
        gb = framed.manifest.total_bytes / 1e9
        del framed, tensors

        async def overlapped(model=model, contract=contract, server=server, pool=pool):
            """Steps with a background publish after each (the trainer's loop, less Redis)."""
            publisher, times, blocked = Publisher(), [], []

            async def announce():
                pass

            for i in range(args.publish_steps):
                t0 = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - t0)
                waited = await publisher.idle()
                v, tensors = i + 2, quantized()  # the QAT cache refill the next forward would do anyway
                sync()
                t0 = time.perf_counter()
                staged = frames.stage(
                    version=v, parent_version=v - 1, contract=contract, tensors=tensors, pool=pool,
                    live=list(model.parameters()),
                )  # fmt: skip
                publisher.start(v, lambda staged=staged: server.publish(staged.run()), announce)
                blocked.append((waited + time.perf_counter() - t0, waited))
                await asyncio.sleep(0)  # the trainer's next await (collecting) starts the thread
            t0 = time.perf_counter()
            await publisher.idle()
            return times, blocked, time.perf_counter() - t0

        overlap = asyncio.run(overlapped()) if args.publish_steps else None
        server.stop()
        pool.close()
        results[name] = (step_s, peak)
        base_s, base_peak = results.get("bf16", (step_s, peak))
        print(
            f"{name:<10} {params / 1e9:.2f}B params  step {step_s * 1e3:8.1f} ms  {n_tokens / step_s:9.0f} tok/s"
            f"  {step_s / base_s:5.2f}x plain  peak {peak:6.1f} GiB (+{peak - base_peak:5.1f})"
            f"  publish {gb:.2f} GB: quantize/cache {quant_s:.2f}s manifest {build_s:.2f}s servable {serve_s:.2f}s"
            f" = {gb / (quant_s + build_s + serve_s):.2f} GB/s",
            flush=True,
        )
        if overlap:
            times, blocked, tail_s = overlap
            print(
                f"{name:<10} publishing off the step, {len(times)} steps: step {statistics.median(times) * 1e3:8.1f} ms"
                f" (median; {statistics.median(times) / step_s:.2f}x the steps above), publish_blocked_s per step "
                + ", ".join(f"{b:.3f} (wait {w:.3f})" for b, w in blocked)
                + f" (the first waits for none); last publish done {tail_s:.3f} s after the last step",
                flush=True,
            )
        del model, opt, server, pool
    return 0


if __name__ == "__main__":
    sys.exit(main())
