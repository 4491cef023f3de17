"""Delta versions on a trained model: how much of a version changes per optimizer step, and what the
XOR + zstd delta (broker/delta.py) costs against the full packed version, one run.

    python3 bench/bench_delta.py                       # demo preset, lr from configs/demo.yaml, 6 steps
    python3 bench/bench_delta.py --lr 1e-5 --steps 4   # another learning rate
    python3 bench/bench_delta.py --config configs/gpu-h200.yaml --device cuda   # the 4.36B fixture, 3 steps
    python3 bench/bench_delta.py --config configs/gpu-h200.yaml --layers 2 --override dim=128 \
        --override n_experts=8 --override expert_ffn_dim=128 --override vocab_size=1024 --steps 2  # CPU dry run

The model: the run config's (`--config`): its preset and overrides, or, for a config that trains a
Hugging Face folder (configs/gpu-h200.yaml's fixture, which bench/make_e2e_model.py writes), that
folder's dims as make_e2e_model.py builds them (`--preset`, default qwen3-30b-a3b, cut to `--layers`,
default 6: 4.36B parameters), RANDOM INIT either way; `--layers` and `--override FIELD=INT` replace
fields. The learning rate and trainer settings are the config's `trainer` section (`--lr` replaces
the rate), on `--device`; the recipes with the config's keep_bf16 overrides.
Per recipe (bf16, int4_qat, nvfp4_moe): the torch trainer backend (trainer/backends.py: AdamW, QAT
installed, bf16 autocast on CUDA as the config says), real optimizer steps of a GRPO-shaped
surrogate loss (-advantage * log p on random tokens, advantages +-1: AdamW's step size hardly depends
on the gradient's scale), the version packed after each step as a publish packs it. Per step: the
fraction of tensors with any changed byte, of changed bytes, the delta's payload bytes (what the
server sends) as % of the full version, and encode (XOR + zstd of every tensor) and decode (unzstd +
XOR of the changed tensors, copy of the rest, into memory touched before, as a client's reused
buffers are) speed in MB/s of the full version on `--threads` threads (tensors spread over them,
as the server encodes). The baseline, same run: sha256 of the
full version on one core (what a full fetch hashes anyway). Each decode is checked to rebuild the
version exactly. Prints the median step of each recipe and each step's delta %.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import gc
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from broker import delta as dl  # noqa: E402
from policy import manifest as mf  # noqa: E402
from policy.contract import contract_from_recipe  # noqa: E402
from policy.model import ModelConfig  # noqa: E402
from tandem import config as run_config  # noqa: E402
from tandem.services import load_recipe  # noqa: E402
from trainer.backends import make_backend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("bf16", "int4_qat", "nvfp4_moe")
FIXTURE_PRESET, FIXTURE_LAYERS = "qwen3-30b-a3b", 6  # bench/make_e2e_model.py's defaults


def model_config(cfg: run_config.RunConfig, args) -> tuple[ModelConfig, str]:
    """The model to train (random init) and a line saying where its dims come from."""
    fields = dict(cfg.model.overrides)
    if cfg.model.checkpoint:
        preset = args.preset or FIXTURE_PRESET
        fields["n_layers"] = args.layers or FIXTURE_LAYERS
        where = f"{cfg.model.checkpoint}'s dims (bench/make_e2e_model.py: {preset} x {fields['n_layers']} layers)"
    else:
        preset = args.preset or cfg.model.preset or "tiny"
        if args.layers:
            fields["n_layers"] = args.layers
        where = f"preset {preset}"
    for item in args.override:
        key, _, value = item.partition("=")
        if not value.lstrip("-").isdigit():
            raise SystemExit(f"bench_delta: --override {item!r} is not FIELD=INT")
        fields[key] = int(value)
    return ModelConfig.preset(preset, **fields), where


def packed(backend, contract) -> dict[str, np.ndarray]:
    """The version's packed contract bytes by tensor, in host memory (what a publish frames)."""
    entries, parts = mf.describe_tensors(contract, backend.quantized_params())
    out = {}
    for e, ps in zip(entries, parts):
        flat = [p.detach().contiguous().reshape(-1).view(torch.uint8) for p in ps]
        out[e.name] = torch.cat(flat).cpu().numpy() if len(flat) > 1 else flat[0].cpu().numpy()
    return out


def surrogate_step(backend, cfg: ModelConfig, rng: torch.Generator, batch: int, seq: int) -> None:
    device = backend.cfg.device
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=rng).to(device)
    adv = (torch.randint(0, 2, (batch, 1), generator=rng).float() * 2 - 1).to(device)
    with backend.autocast():
        logp = backend.token_logprobs(tokens[:, :-1], tokens[:, 1:])
        loss = -(adv * logp.float()).mean()
    backend.update(loss)


def measure(prev: dict[str, np.ndarray], cur: dict[str, np.ndarray], level: int, pool) -> dict[str, float]:
    """One step's figures (see the module docstring); encode and decode timed over `pool`'s threads."""
    names = list(cur)
    full = sum(a.nbytes for a in cur.values())
    changed = list(pool.map(lambda n: int(np.count_nonzero(prev[n] != cur[n])), names))
    t0 = time.perf_counter()
    payloads = dict(zip(names, pool.map(lambda n: dl.encode(cur[n], prev[n], level=level), names)))
    t1 = time.perf_counter()
    out = {n: np.empty_like(a) for n, a in cur.items()}
    list(pool.map(lambda n: out[n].fill(0), names))  # first touch outside the timing (reused buffers)

    def decode(n: str) -> None:
        if payloads[n] is None:
            np.copyto(out[n], prev[n])
        else:
            dl.decode(n, payloads[n], prev[n], out[n])

    t2 = time.perf_counter()
    list(pool.map(decode, names))
    t3 = time.perf_counter()
    bad = [n for n, same in zip(names, pool.map(lambda n: np.array_equal(out[n], cur[n]), names)) if not same]
    if bad:
        raise AssertionError(f"decode did not rebuild {bad[:3]}")
    return {
        "tensors_pct": 100 * sum(c > 0 for c in changed) / len(cur),
        "bytes_pct": 100 * sum(changed) / full,
        "delta_pct": 100 * sum(len(p) for p in payloads.values() if p is not None) / full,
        "encode_mbs": full / (t1 - t0) / 1e6,
        "decode_mbs": full / (t3 - t2) / 1e6,
    }


def sha256_mbs(version: dict[str, np.ndarray]) -> float:
    full = sum(a.nbytes for a in version.values())
    t0 = time.perf_counter()
    for a in version.values():
        hashlib.sha256(a).digest()
    return full / (time.perf_counter() - t0) / 1e6


def run_recipe(name: str, cfg: run_config.RunConfig, mc: ModelConfig, args) -> tuple[int, list[dict], float]:
    """`args.steps` steps under recipe `name`: the version's bytes, each step's figures, sha256 MB/s."""
    torch.manual_seed(0)
    recipe = load_recipe(cfg, name)
    trainer = dataclasses.replace(cfg.trainer, device=args.device, lr=args.lr or cfg.trainer.lr)
    backend = make_backend(trainer, mc, recipe, seed=cfg.loop.seed)
    backend.apply_qat()
    contract = contract_from_recipe(model_config=mc, recipe=recipe)
    rng = torch.Generator().manual_seed(1)
    prev = packed(backend, contract)
    rows = []
    with concurrent.futures.ThreadPoolExecutor(args.threads) as pool:
        for _ in range(args.steps):
            surrogate_step(backend, mc, rng, args.batch, args.seq)
            cur = packed(backend, contract)
            rows.append(measure(prev, cur, args.level, pool))
            prev = cur
    del backend
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next recipe's model and optimizer take its place
    return sum(a.nbytes for a in prev.values()), rows, sha256_mbs(prev)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.yaml"), help="run config: model, lr, trainer")
    p.add_argument("--device", default="cpu")
    p.add_argument("--lr", type=float, default=0.0, help="default: the config's trainer.lr")
    p.add_argument("--preset", default="", help="model preset (default: the config's)")
    p.add_argument("--layers", type=int, default=0, help="n_layers (default: the config's, or 6 for a fixture)")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=INT", help="a ModelConfig field")
    p.add_argument("--steps", type=int, default=0, help="default: 6 on the CPU, 3 on CUDA")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--level", type=int, default=dl.LEVEL, help="zstd level")
    p.add_argument(
        "--threads", type=int, default=0, help="encode/decode threads; default: 1 on the CPU, every core on CUDA"
    )
    p.add_argument("--recipes", default=",".join(RECIPES))
    args = p.parse_args()
    cpu = args.device == "cpu"
    args.steps = args.steps or (6 if cpu else 3)
    args.threads = args.threads or (1 if cpu else os.cpu_count() or 1)
    if cpu:
        torch.set_num_threads(1)  # one core: the CPU figures are per core
    cfg = run_config.load(args.config, [])
    mc, where = model_config(cfg, args)
    print(f"{where}: {mc.num_parameters() / 1e9:.3f}B parameters, random init, on {args.device}; "
          f"lr {args.lr or cfg.trainer.lr:g}, {args.steps} AdamW steps per recipe, zstd level {args.level}, "
          f"{args.threads} encode/decode thread(s)")  # fmt: skip
    print(
        f"{'recipe':<10} {'MB':>9} {'tensors%':>9} {'bytes%':>7} {'delta%':>7} {'enc MB/s':>9} {'dec MB/s':>9}"
        f" {'sha256 MB/s':>12}"
    )
    for name in args.recipes.split(","):
        nbytes, rows, sha = run_recipe(name, cfg, mc, args)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"{name:<10} {nbytes / 1e6:>9.2f} {med['tensors_pct']:>9.1f} {med['bytes_pct']:>7.2f} "
            f"{med['delta_pct']:>7.2f} {med['encode_mbs']:>9.0f} {med['decode_mbs']:>9.0f} {sha:>12.0f}",
            flush=True,
        )
        print("           per step delta%: " + " ".join(f"{r['delta_pct']:.2f}" for r in rows), flush=True)
    print(f"(cpu: {os.cpu_count()} cores visible)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
