"""Trainer step and publish on one GPU: plain bf16 vs QAT (nvfp4_moe, int4_qat), torch vs megatron-core
backend, same model, same batch.

    python bench/bench_trainer.py                          # Qwen3-30B-A3B widths, 6 layers (~4.4B), 8 x 1024 tokens
    python bench/bench_trainer.py --layers 2 --batch 2 --backends torch,megatron
    python bench/bench_trainer.py --device cpu --preset tiny --batch 8 --seq 64   # CPU smoke run (torch)

Each configuration builds the trainer's own backend (trainer/backends.py), takes `--warmup` untimed
steps, then `--steps` timed ones (`backend.update`: forward + backward of a token log-prob loss,
clip, optimizer step; under QAT each step pays the refill of the QAT cache, as the trainer does).
`--moe loop` times the loop over experts instead of the grouped GEMM. Printed per configuration:
ms per step, tokens/s, the ratio to plain (target: QAT <= 1.2x, met or missed at the end:
bench/targets.py), peak memory over plain (target: <= one copy of the quantized weights),
`quantized_params` after an invalidate (a refill plus every parameter's published object), and a
publish of the version (QAT cache parts -> broker.frames -> PolicyServer.publish) in seconds and GB/s.
`--publish-steps N`: N more steps, each followed by a background publish (trainer.publisher), with
the step time meanwhile and `publish_blocked_s` (the wait for the previous publish + staging)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from targets import trainer_targets  # noqa: E402  (bench/targets.py, beside this script)


def _python_profile(step, sync, backend) -> None:
    """Where one more step (cache emptied first) spends its host time: cProfile's top functions by
    own time (a QAT step the GPU waits for shows here, not in the kernel table)."""
    import cProfile
    import pstats

    if backend.qat_hook is not None:
        backend.qat_hook.invalidate()
    sync()
    prof = cProfile.Profile()
    prof.enable()
    step()
    sync()
    prof.disable()
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(25)


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
    parser.add_argument("--backends", default="torch", help="torch and/or megatron (CUDA, megatron-core)")
    parser.add_argument("--ckpt", action="store_true", help="trainer.activation_checkpointing")
    parser.add_argument("--no-publish", action="store_true", help="time the steps only")
    parser.add_argument(
        "--profile", default="", help="recipes to profile one step of (torch.profiler table, then cProfile's)"
    )
    parser.add_argument("--publish-steps", type=int, default=3, help="steps with a background publish after each")
    parser.add_argument("--moe", choices=("auto", "grouped", "loop"), default="auto", help="MoE expert dispatch")
    args = parser.parse_args(argv)

    from policy.model import ModelConfig
    from policy.recipe import Recipe
    from trainer.backends import make_backend
    from trainer.config import TrainerConfig

    cuda = args.device.startswith("cuda")
    cfg = ModelConfig.preset(args.preset, n_layers=args.layers, max_seq_len=max(args.seq, 64))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), generator=g).to(args.device)
    n_tokens = tokens.numel()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    results = {}
    for backend_name in args.backends.split(","):
        for name in args.recipes.split(","):
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            tcfg = TrainerConfig(
                device="cuda" if cuda else "cpu", backend=backend_name, lr=1e-5, activation_checkpointing=args.ckpt
            )
            recipe = Recipe.load(name)
            backend = make_backend(tcfg, cfg, recipe, seed=0)
            params = sum(p.numel() for p in backend.parameters())
            if args.moe != "auto":
                _set_moe(backend, args.moe == "grouped")
            if name != "bf16":
                backend.apply_qat()

            def step(backend=backend):
                with backend.autocast():
                    logp = backend.token_logprobs(tokens[:, :-1], tokens[:, 1:])
                backend.update(-logp.mean())

            for _ in range(args.warmup):
                step()
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step()
            sync()
            step_s = (time.perf_counter() - t0) / args.steps
            peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
            results[backend_name, name] = (step_s, peak)
            requant = ""
            if backend.qat_hook is not None:  # a refill plus every parameter's published object
                backend.qat_hook.invalidate()
                sync()
                t0 = time.perf_counter()
                backend.qat_hook.quantized_params(getattr(backend, "gpt", backend.module))
                sync()
                requant = f"  (quantized_params {(time.perf_counter() - t0) * 1e3:.0f} ms)"
            base_s, base_peak = results.get((backend_name, "bf16"), (step_s, peak))
            line = (
                f"{backend_name:<8} {name:<10} {params / 1e9:.2f}B params  step {step_s * 1e3:8.1f} ms"
                f"  {n_tokens / step_s:9.0f} tok/s  {step_s / base_s:5.2f}x plain"
                f"  peak {peak:6.1f} GiB (+{peak - base_peak:5.1f}){requant}"
            )
            if backend_name != "torch" and ("torch", name) in results:
                line += f"  {results['torch', name][0] / step_s:4.2f}x torch's tok/s"
            if name in args.profile.split(","):
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                if backend.qat_hook is not None:  # the refill timed above filled the cache: a step refills it
                    backend.qat_hook.invalidate()
                with profile(activities=acts) as prof:
                    step()
                    sync()
                key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=50), flush=True)
                _python_profile(step, sync, backend)
            overlap = None
            if not args.no_publish:
                published, overlap = _publish(args, backend, cfg, recipe, step, sync, step_s)
                line += "  " + published
            print(line, flush=True)
            if overlap:
                print(f"{backend_name:<8} {name:<10} {overlap}", flush=True)
            del backend, step
            gc.collect()  # megatron's modules hold reference cycles: free this model before the next
    print("targets (bench/targets.py):")
    for t in trainer_targets({key: step_s for key, (step_s, _) in results.items()}):
        print(t, flush=True)
    return 0


def _set_moe(backend, grouped: bool) -> None:
    """Force the MoE dispatch of either backend: grouped GEMMs or the loop over experts."""
    from policy.model import MoE

    for mod in getattr(backend, "gpt", backend.module).modules():
        if isinstance(mod, MoE):
            mod.grouped = grouped
        elif type(mod).__name__ == "SequentialMLP":
            mod.tandem_grouped = grouped


def _publish(args, backend, cfg, recipe, step, sync, step_s) -> tuple[str, str | None]:
    """Publish the current version: the quantized parts QAT already holds (plain: quantize now) ->
    broker.frames -> PolicyServer.publish; then `--publish-steps` steps with a background publish
    after each (the trainer's loop, less Redis). Returns the publish's and the overlap's lines."""
    import torch

    from broker import frames
    from broker.policy_server import PolicyServer, PolicyServerConfig
    from policy.contract import contract_from_recipe
    from policy.formats.params import quantize_params
    from trainer.publisher import Publisher

    cuda = args.device.startswith("cuda")

    def quantized():
        if backend.qat_hook is None:
            return quantize_params(backend.canonical(), recipe.plan(cfg))
        return backend.quantized_params()

    sync()
    t0 = time.perf_counter()
    tensors = quantized()
    sync()
    quant_s = time.perf_counter() - t0
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    pool = frames.BufferPool(pin=cuda and torch.cuda.is_available())
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

    async def overlapped():
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
                live=list(backend.parameters()),
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
    line = (
        f"publish {gb:.2f} GB: quantize/cache {quant_s:.2f}s manifest {build_s:.2f}s servable {serve_s:.2f}s"
        f" = {gb / (quant_s + build_s + serve_s):.2f} GB/s"
    )
    if not overlap:
        return line, None
    times, blocked, tail_s = overlap
    return line, (
        f"publishing off the step, {len(times)} steps: step {statistics.median(times) * 1e3:8.1f} ms"
        f" (median; {statistics.median(times) / step_s:.2f}x the steps above), publish_blocked_s per step "
        + ", ".join(f"{b:.3f} (wait {w:.3f})" for b, w in blocked)
        + f" (the first waits for none); last publish done {tail_s:.3f} s after the last step"
    )


if __name__ == "__main__":
    sys.exit(main())
