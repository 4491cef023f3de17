"""The packed GPU rollout engine (rollout/packed_engine.py) on one CUDA device: decode, prefill, mismatch.

    python3 bench/bench_engine.py [--layers 6] [--batches 1,16,64,256] [--steps 64] [--json out.json]
    python3 bench/bench_engine.py --continuous [--recipes nvfp4_moe] [--groups 32 --group-size 8]

For each recipe (bf16, nvfp4_moe, int4_qat; the same random-init model), in one run: decode tok/s
and ms/step per batch, greedy and at T = 1 (graph replays timed with CUDA events); GPU busy (profiler
kernel time of 8 replays / their wall time) and one eager step at batch 64; the HBM roofline (the
bytes a step must read: dense weights, the experts a batch touches under uniform routing, the live
KV, over the copy bandwidth measured in the same run); sampling's share of a step; prefill tok/s;
and logp_abs_diff_quant against the trainer's QAT recompute (policy.qat, same GPU, same sequences).
Targets are printed met/missed at the end.

`--continuous`: continuous batching (rollout/batching.py) against static batches of 1 group and of
slots / group_size groups, on the same work at T = 1 (per-sample token budgets drawn from
[--min-new, --max-new] stand in for EOS); completion tok/s over wall time, GPU busy, and the
full-slot decode rate for scale."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
from targets import ENGINE_ROOFLINE, ENGINE_X, check  # bench/targets.py, beside this script

from policy import qat
from policy.model import ModelConfig, Transformer
from policy.recipe import Recipe
from rollout import sampling
from rollout.batching import ContinuousBatcher, PackedBackend
from rollout.packed_engine import EngineConfig, PackedEngine


def copy_bandwidth(device) -> float:
    """Bytes/s read + written by a 1 GiB device-to-device copy (median of 20)."""
    a = torch.empty(2**29, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    times = []
    for i in range(23):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        if i >= 3:
            times.append(e0.elapsed_time(e1) / 1e3)
    return 2 * a.numel() * 2 / statistics.median(times)


def events_ms(fn, repeats: int = 1) -> float:
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    e0.record()
    for _ in range(repeats):
        fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / repeats


def kernel_ms(fn, by_name: dict | None = None) -> float:
    """Summed device time of the CUDA kernels (and memcpy/memset) fn launches, by the profiler;
    with `by_name`, also {kernel name: [count, microseconds]}."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    total_us = 0.0
    for evt in prof.events():  # device-side events (kernels, memcpy, memset): their own intervals
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            us = evt.time_range.elapsed_us()
            total_us += us
            if by_name is not None:
                c = by_name.setdefault(evt.name[:90], [0, 0.0])
                c[0] += 1
                c[1] += us
    return total_us / 1e3


def expert_us(eng: PackedEngine, batch: int, gen) -> float:
    """GPU microseconds a decode step spends in its routed-expert blocks (`ExpertWeights`: routing
    metadata, both matmuls, the activation, the weighted sum) at this batch: every MoE layer's block
    replayed in one CUDA graph on random top-k routing (distinct experts per row)."""
    cfg = eng.cfg
    layers = [L.experts for L in eng.layers if L.experts is not None]
    if not layers:
        return 0.0
    x = torch.randn(batch, cfg.dim, generator=gen).to(eng.device, eng.embed.dtype)
    ids = torch.stack([torch.randperm(cfg.n_experts, generator=gen)[: cfg.top_k] for _ in range(batch)])
    ids = ids.to(eng.device)
    weights = torch.full(ids.shape, 1.0 / cfg.top_k, device=eng.device)

    def blocks():
        for ex in layers:
            ex(x, ids, weights, eng.ops)

    blocks()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        blocks()
    g.replay()
    return events_ms(g.replay, repeats=20) * 1e3


def step_bytes(eng: PackedEngine, batch: int, ctx: float) -> float:
    """Bytes one decode step must read at this batch: dense weights, touched experts, live KV."""
    cfg = eng.cfg

    def nbytes(*ts):
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def op_bytes(o):
        return nbytes(o.values, o.scale, o.block_scale)

    def lin_bytes(lin):
        if lin.weight is not None:
            return nbytes(lin.weight)
        if lin.packed is None:
            return op_bytes(lin.w)
        p = lin.packed
        return nbytes(p.codes, p.scales, p.global_scale)

    total = nbytes(eng.norm) + lin_bytes(eng.lm_head) + batch * cfg.dim * eng.embed.element_size()
    touched = cfg.n_experts * (1 - (1 - cfg.top_k / cfg.n_experts) ** batch) if cfg.n_experts else 0
    for L in eng.layers:
        total += nbytes(L.ln1, L.ln2, L.q_norm, L.k_norm)
        total += sum(lin_bytes(x) for x in (L.q, L.k, L.v, L.o))
        if L.dense is not None:
            total += sum(lin_bytes(x) for x in L.dense)
            continue
        total += lin_bytes(L.gate)
        ex = L.experts
        if ex.kernel is not None:
            per = (nbytes(ex.gu.codes, ex.gu.scales, ex.gu.global_scale) + nbytes(ex.dn.codes, ex.dn.scales)) / (
                cfg.n_experts
            )
        elif ex.plain:
            per = nbytes(ex.w_gu, ex.w_dn) / cfg.n_experts
        else:
            per = sum(op_bytes(o) for o in ex.op_gu + ex.op_dn) / cfg.n_experts
        total += touched * per
        if L.shared is not None:
            total += sum(lin_bytes(x) for x in L.shared)
    kv = batch * ctx * cfg.n_layers * 2 * cfg.n_kv_heads * cfg.head_dim * eng.k_cache[0].element_size()
    return total + kv


def run_recipe(name, model, cfg, args, bw, gen) -> dict:
    dev = model.lm_head.weight.device
    plan = Recipe.load(name).plan(model)
    t0 = time.perf_counter()
    packed = qat.quantize_weights(model, plan)
    t_quant = time.perf_counter() - t0
    batches = [int(b) for b in args.batches.split(",")]
    cap = args.prompt_len + args.steps + 24
    ecfg = EngineConfig(
        max_batch=max(batches),
        max_seq_len=cap,
        graph_buckets=tuple(batches),
        fuse=not args.no_fuse,
        attention=args.attention,
    )
    t0 = time.perf_counter()
    eng = PackedEngine(cfg, plan, packed, device=dev, engine=ecfg)
    del packed
    torch.cuda.synchronize()
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng.capture()
    t_capture = time.perf_counter() - t0
    out = {"recipe": name, "quantize_s": t_quant, "load_s": t_load, "capture_s": t_capture, "decode": []}

    def prompts(B):
        return torch.randint(0, cfg.vocab_size, (B, args.prompt_len), generator=gen).tolist()

    for B in batches:
        for T in (0.0, 1.0):
            n = eng.prefill(prompts(B), seeds=list(range(B)), temperature=T, stop=set(), pad_id=0)
            eng.decode(n, 2, check_every=2)  # settle
            ms = events_ms(lambda n=n: eng.decode(n, args.steps, check_every=args.steps)) / args.steps
            row = {"batch": B, "temperature": T, "ms_step": ms, "tok_s": B * 1e3 / ms}
            if T == 1.0:
                wall = events_ms(lambda n=n: eng.decode(n, 8, check_every=8)) / 8
                names: dict = {}
                busy = kernel_ms(lambda n=n: eng.decode(n, 8, check_every=8), names) / 8
                row["gpu_busy"] = busy / wall
                row["kernels_per_step"] = sum(c for c, _ in names.values()) / 8
                if B == args.profile_batch:
                    row["expert_us"] = expert_us(eng, B, gen)
                    row["other_us"] = busy * 1e3 - row["expert_us"]
                    print(f"    routed experts {row['expert_us']:.1f} us/step, the rest {row['other_us']:.1f} us/step")
                    top = sorted(names.items(), key=lambda kv: -kv[1][1])[: args.profile_top]
                    row["top_kernels"] = [(k, c / 8, us / 8) for k, (c, us) in top]
                    print(f"    {row['kernels_per_step']:.0f} kernels/step; top by time (count/step, us/step):")
                    for k, c, us in row["top_kernels"]:
                        print(f"      {us:8.1f} us {c:5.0f}x  {k}")
                ctx = args.prompt_len + args.steps / 2
                row["roofline_ms"] = step_bytes(eng, B, ctx) / bw * 1e3
                row["pct_roofline"] = row["roofline_ms"] / ms
            out["decode"].append(row)
            print(
                f"  {name:10s} B={B:4d} T={T:.0f}: {ms:8.3f} ms/step {row['tok_s']:9.0f} tok/s"
                + (
                    f"  busy {row['gpu_busy']:.0%}  roofline {row['roofline_ms']:.3f} ms ({row['pct_roofline']:.0%})"
                    if T == 1.0
                    else ""
                ),
                flush=True,
            )
    # One eager step (no graph) at batch 64 (or the largest <= 64), for the graphs' effect.
    Be = max([b for b in batches if b <= 64] or batches[:1])
    n = eng.prefill(prompts(Be), seeds=list(range(Be)), temperature=1.0, stop=set(), pad_id=0)
    eng.decode(n, 2, check_every=2, graphs=False)
    wall = events_ms(lambda: eng.decode(n, 8, check_every=8, graphs=False)) / 8
    busy = kernel_ms(lambda: eng.decode(n, 4, check_every=4, graphs=False)) / 4
    out["eager"] = {"batch": Be, "ms_step": wall, "gpu_busy": busy / wall}
    print(f"  {name:10s} eager B={Be}: {wall:.3f} ms/step, busy {busy / wall:.0%}", flush=True)
    # Sampling alone at batch 64.
    logits = torch.randn(Be, cfg.vocab_size, device=dev) * 3
    seeds = torch.arange(Be, device=dev)
    step = torch.zeros(1, dtype=torch.int64, device=dev)
    temp = torch.ones(1, device=dev)
    sampling.sample(logits, seeds, step, temp)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()  # timed as in the decode graph: replays, no launch overhead
    with torch.cuda.graph(g):
        sampling.sample(logits, seeds, step, temp)
    t_s = events_ms(g.replay, repeats=50)
    ms64 = next(r["ms_step"] for r in out["decode"] if r["batch"] == Be and r["temperature"] == 1.0)
    out["sampling"] = {"batch": Be, "ms": t_s, "pct_step": t_s / ms64}
    print(f"  {name:10s} sampling B={Be}: {t_s * 1e3:.1f} us ({t_s / ms64:.1%} of a T=1 step)", flush=True)
    # Prefill: the largest batch, prompt_len tokens each, one forward.
    Bp = max(batches)
    pp = prompts(Bp)
    eng.prefill(pp, seeds=list(range(Bp)), temperature=1.0, stop=set(), pad_id=0)
    ms = events_ms(lambda: eng.prefill(pp, seeds=list(range(Bp)), temperature=1.0, stop=set(), pad_id=0))
    out["prefill"] = {"batch": Bp, "tokens": Bp * args.prompt_len, "ms": ms, "tok_s": Bp * args.prompt_len / ms * 1e3}
    print(f"  {name:10s} prefill {Bp}x{args.prompt_len}: {ms:.1f} ms, {out['prefill']['tok_s']:.0f} tok/s", flush=True)
    # Mismatch against the trainer's QAT recompute of the same sequences: every recipe gets the same
    # prompts and seeds (its own generator), so the recipes' medians compare like with like.
    Bm, new = args.mismatch_batch, args.mismatch_tokens
    pm = torch.randint(0, cfg.vocab_size, (Bm, args.prompt_len), generator=torch.Generator().manual_seed(7)).tolist()
    g = eng.generate(pm, max_new_tokens=new, temperature=1.0, seeds=list(range(1000, 1000 + Bm)))
    eng = None  # free its weights and KV cache before the QAT recompute
    torch.cuda.empty_cache()
    seq = torch.cat([torch.tensor(pm), g.tokens], dim=1).to(dev)
    hook = qat.apply_qat(model, plan)
    with torch.no_grad():
        lp = model.token_logprobs(seq[:, :-1], seq[:, 1:])[:, args.prompt_len - 1 :].float().cpu()
    qat.remove_qat(model)
    hook.invalidate()
    del hook
    torch.cuda.empty_cache()
    diff = (lp - g.logprobs).abs().flatten()
    out["logp_abs_diff_quant"] = {"median": diff.median().item(), "mean": diff.mean().item(), "max": diff.max().item()}
    print(
        f"  {name:10s} logp_abs_diff_quant vs QAT recompute: median {diff.median().item():.2e} "
        f"mean {diff.mean().item():.2e} max {diff.max().item():.2e}",
        flush=True,
    )
    return out


def run_continuous(name, model, cfg, args, gen) -> dict:
    """Continuous vs static batching on one engine (module docstring, `--continuous`)."""
    dev = model.lm_head.weight.device
    plan = Recipe.load(name).plan(model)
    packed = qat.quantize_weights(model, plan)
    n, G, inflight = args.group_size, args.groups, args.max_inflight_groups
    slots = args.slots or n * inflight
    work = []
    for _ in range(G):
        plen = int(torch.randint(16, 2 * args.prompt_len + 1, (1,), generator=gen))
        prompt = torch.randint(0, cfg.vocab_size, (plen,), generator=gen).tolist()
        work.append((prompt, torch.randint(args.min_new, args.max_new + 1, (n,), generator=gen).tolist()))
    cap = max(len(p) for p, _ in work) + args.max_new + 1
    buckets = tuple(b for b in (8, 16, 32, 64, 128, 256) if n <= b < slots) + (slots,)
    eng = PackedEngine(
        cfg, plan, packed, device=dev, engine=EngineConfig(max_batch=slots, max_seq_len=cap, graph_buckets=buckets)
    )
    del packed
    eng.capture()

    def seeds(g):
        return [1000 * g + i for i in range(n)]

    def continuous() -> int:
        b = ContinuousBatcher(
            PackedBackend(eng, temperature=1.0, stop=set(), pad_id=0, check_every=args.check_every),
            max_inflight_groups=inflight,
            version=0,
        )
        todo, tokens = list(range(G)), 0
        while todo or not b.idle:
            while todo and b.can_submit():
                g = todo.pop(0)
                b.submit(g, work[g][0], seeds(g), max_new_tokens=work[g][1])
            for r in b.step():
                tokens += sum(len(t) for t in r.tokens)
        return tokens

    def static(k: int) -> int:
        tokens = 0
        for g0 in range(0, G, k):
            chunk = range(g0, min(G, g0 + k))
            budgets = [m for g in chunk for m in work[g][1]]
            nb = eng.prefill(
                [work[g][0] for g in chunk],
                seeds=[s for g in chunk for s in seeds(g)],
                temperature=1.0,
                stop=set(),
                pad_id=0,
                n_samples=n,
                max_new_tokens=budgets,
            )
            eng.decode(nb, max(budgets) - 1)
            tokens += int(eng.lengths[: len(budgets)].sum())
        return tokens

    out = {"recipe": name, "groups": G, "group_size": n, "max_inflight_groups": inflight, "slots": slots, "modes": {}}
    ks = max(1, slots // n)  # static batches of as many whole groups as the slots hold
    for mode, fn in (("continuous", continuous), (f"static_{ks}_groups", lambda: static(ks)),
                     ("static_1_group", lambda: static(1))):  # fmt: skip
        if mode == "continuous":
            fn()  # warm: Triton kernels for the prefill shapes, allocator (the static runs reuse them)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tokens = fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        busy = kernel_ms(fn) / 1e3 / wall
        out["modes"][mode] = {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "gpu_busy": busy}
        print(f"  {name:10s} {mode:18s} {tokens:7d} tokens {wall:7.3f} s {tokens / wall:9.0f} tok/s busy {busy:.0%}",
              flush=True)  # fmt: skip
    nb = eng.prefill([work[0][0]] * slots, seeds=list(range(slots)), temperature=1.0, stop=set(), pad_id=0)
    eng.decode(nb, 2, check_every=2)
    ms = events_ms(lambda: eng.decode(nb, 32, check_every=32)) / 32
    out["full_slots_decode"] = {"batch": slots, "ms_step": ms, "tok_s": slots * 1e3 / ms}
    c = out["modes"]["continuous"]["tok_s"]
    print(f"  {name:10s} decode at batch {slots} (graph replays): {slots * 1e3 / ms:9.0f} tok/s; continuous is "
          f"{c / (slots * 1e3 / ms):.0%} of it, {c / out['modes']['static_1_group']['tok_s']:.2f}x static per group, "
          f"{c / out['modes'][f'static_{ks}_groups']['tok_s']:.2f}x static {ks} groups", flush=True)  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--dense", action="store_true", help="a dense model of Qwen3-8B widths instead (--layers of them)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--recipes", default="bf16,nvfp4_moe,int4_qat")
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--mismatch-batch", type=int, default=16)
    ap.add_argument("--mismatch-tokens", type=int, default=32)
    ap.add_argument("--profile-batch", type=int, default=64, help="print the top kernels at this batch")
    ap.add_argument("--profile-top", type=int, default=14)
    ap.add_argument("--no-fuse", action="store_true", help="decode glue unfused (EngineConfig.fuse=False)")
    ap.add_argument("--attention", default="auto", help="EngineConfig.attention: auto | triton | torch")
    ap.add_argument("--json", default="")
    ap.add_argument("--continuous", action="store_true", help="continuous vs static batching instead (docstring)")
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-inflight-groups", type=int, default=8)
    ap.add_argument("--min-new", type=int, default=16)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--check-every", type=int, default=8, help="continuous: decode steps between host looks")
    ap.add_argument("--slots", type=int, default=0, help="continuous: KV slots (0: group_size * max_inflight_groups)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.dense:  # Qwen3-8B widths (HF config.json), cut to --layers layers
        cfg = ModelConfig.preset(
            "tiny-dense",
            vocab_size=151936,
            dim=4096,
            n_layers=args.layers,
            n_heads=32,
            n_kv_heads=8,
            head_dim=128,
            ffn_dim=12288,
            tie_word_embeddings=False,
            rope_theta=1_000_000.0,
            max_seq_len=40960,
        )
        args.preset = "qwen3-8b-widths (dense)"
    else:
        cfg = ModelConfig.preset(args.preset, n_layers=args.layers)
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {args.preset} x{args.layers} layers", flush=True)
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth (read+write): {bw / 1e12:.2f} TB/s", flush=True)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(dev):
        model = Transformer(cfg, seed=0)
    torch.set_default_dtype(torch.float32)
    model.requires_grad_(False)
    print(f"model: {cfg.num_parameters() / 1e9:.2f}B parameters (bf16, random init)", flush=True)
    gen = torch.Generator().manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "copy_bw": bw, "args": vars(args), "recipes": []}
    for name in args.recipes.split(","):
        if args.continuous:
            results["recipes"].append(run_continuous(name, model, cfg, args, gen))
        else:
            results["recipes"].append(run_recipe(name, model, cfg, args, bw, gen))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    if not args.continuous:
        report(results)


def expert_bound(bf16: dict, quant: dict, name: str) -> str:
    """What the routed experts leave: the speed-up over bf16 (GPU time per step at the profiled batch)
    if the routed-expert blocks (`expert_us`; for nvfp4_moe the layer it keeps in bf16 too) cost
    nothing, and what they would have to cost for ENGINE_X."""
    b = next((d for d in bf16["decode"] if "expert_us" in d), None)
    q = next((d for d in quant["decode"] if "expert_us" in d and b and d["batch"] == b["batch"]), None)
    if b is None or q is None:
        return f"  {name}: no kernel profile at a batch both recipes ran"
    total_b = b["expert_us"] + b["other_us"]
    need = total_b / ENGINE_X - q["other_us"]
    if need <= 0:
        rest = q["other_us"]
        return f"  {name}: the kernels besides the experts ({rest:.0f} us) exceed bf16's {total_b:.0f} us / {ENGINE_X}"
    return (
        f"  {name} at B={q['batch']} (GPU time per step): experts {q['expert_us']:.0f} us + the rest "
        f"{q['other_us']:.0f} us against bf16's {b['expert_us']:.0f} + {b['other_us']:.0f}; with free experts "
        f"{total_b / q['other_us']:.3f}x; {ENGINE_X}x needs the experts at <= {need:.0f} us "
        f"({b['expert_us'] / need:.2f}x faster than bf16's)"
    )


def report(results: dict) -> None:
    by = {r["recipe"]: r for r in results["recipes"]}

    def tok(recipe, B, T):
        return next(
            (d["tok_s"] for d in by[recipe]["decode"] if d["batch"] == B and d["temperature"] == T), float("nan")
        )

    print("\nrecipe      batch  greedy tok/s   T=1 tok/s  ms/step(T=1)  busy  roofline%")
    for name, r in by.items():
        for d in r["decode"]:
            if d["temperature"] == 1.0:
                print(
                    f"{name:10s} {d['batch']:6d} {tok(name, d['batch'], 0.0):13.0f} {d['tok_s']:11.0f} "
                    f"{d['ms_step']:13.3f} {d['gpu_busy']:5.0%} {d['pct_roofline']:9.0%}"
                )
    print("\ntargets:")
    busy = [d["gpu_busy"] for r in by.values() for d in r["decode"] if d["temperature"] == 1.0 and d["batch"] >= 16]
    if busy:
        print(f"  GPU-busy >= 80% at batch >= 16: min {min(busy):.0%} -> {'met' if min(busy) >= 0.8 else 'missed'}")
    if "bf16" in by:
        for q in ("nvfp4_moe", "int4_qat"):
            if q in by:
                s = tok(q, 64, 1.0) / tok("bf16", 64, 1.0)
                if not math.isnan(s):
                    print(check(f"{q} vs bf16 at B=64, T=1", s, ENGINE_X))
                print(expert_bound(by["bf16"], by[q], q))
    for name, r in by.items():
        d64 = [d for d in r["decode"] if d["batch"] == 64 and d["temperature"] == 1.0]
        if d64 and name != "bf16":
            print(check(f"{name} roofline at B=64", d64[0]["pct_roofline"], ENGINE_ROOFLINE, pct=True))
    if "bf16" in by:
        base = by["bf16"]["logp_abs_diff_quant"]["median"]
        for q in ("nvfp4_moe", "int4_qat"):
            if q in by:
                m = by[q]["logp_abs_diff_quant"]["median"]
                ok = m <= 1.5 * base
                print(
                    f"  {q} median logp_abs_diff_quant {m:.2e} vs 1.5 x bf16's {base:.2e} -> {'met' if ok else 'missed'}"
                )
    for name, r in by.items():
        s = r["sampling"]["pct_step"]
        print(
            f"  {name} sampling at B={r['sampling']['batch']}: {s:.1%} of a step (<= 5%) -> {'met' if s <= 0.05 else 'missed'}"
        )


if __name__ == "__main__":
    main()
