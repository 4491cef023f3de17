"""Delta versions on the demo model: how much of a version changes per optimizer step, and what the
XOR + zstd delta (broker/delta.py) costs against the full packed version, one run.

    python3 bench/bench_delta.py                       # demo preset, lr from configs/demo.yaml, 6 steps
    python3 bench/bench_delta.py --lr 1e-5 --steps 4   # another learning rate

Per recipe (bf16, int4_qat, nvfp4_moe): the demo model (configs/demo.yaml's `demo` preset) on the CPU
trainer backend (trainer/backends.py: AdamW, QAT installed), real optimizer steps of a GRPO-shaped
surrogate loss (-advantage * log p on random tokens, advantages +-1: AdamW's step size hardly depends
on the gradient's scale), the version packed after each step as a publish packs it. Per step: the
fraction of tensors with any changed byte, of changed bytes, the delta's payload bytes (what the
server sends) as % of the full version, and encode (XOR + zstd of every tensor) and decode (unzstd +
XOR of the changed tensors, copy of the rest) speed in MB/s of the full version on one core. The
baseline, same run: sha256 of the full version on one core (what a full fetch hashes anyway). Each
decode is checked to rebuild the version exactly. Prints the median step of each recipe.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from broker import delta as dl  # noqa: E402
from policy import manifest as mf  # noqa: E402
from policy.contract import contract_from_recipe  # noqa: E402
from policy.model import ModelConfig  # noqa: E402
from policy.recipe import Recipe  # noqa: E402
from trainer.backends import make_backend  # noqa: E402
from trainer.config import TrainerConfig  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ("bf16", "int4_qat", "nvfp4_moe")


def packed(backend, contract) -> dict[str, np.ndarray]:
    """The version's packed contract bytes by tensor (what a publish frames)."""
    entries, parts = mf.describe_tensors(contract, backend.quantized_params())
    out = {}
    for e, ps in zip(entries, parts):
        out[e.name] = np.concatenate([p.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for p in ps])
    return out


def surrogate_step(backend, cfg: ModelConfig, rng: torch.Generator, batch: int, seq: int) -> None:
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=rng)
    adv = torch.randint(0, 2, (batch, 1), generator=rng).float() * 2 - 1
    logp = backend.token_logprobs(tokens[:, :-1], tokens[:, 1:])
    backend.update(-(adv * logp).mean())


def measure(prev: dict[str, np.ndarray], cur: dict[str, np.ndarray], level: int) -> dict[str, float]:
    full = sum(a.nbytes for a in cur.values())
    changed_tensors = sum(not np.array_equal(prev[n], cur[n]) for n in cur)
    changed_bytes = sum(int(np.count_nonzero(prev[n] != cur[n])) for n in cur)
    t0 = time.perf_counter()
    payloads = {n: dl.encode(cur[n], prev[n], level=level) for n in cur}
    t1 = time.perf_counter()
    out = {n: np.empty_like(a) for n, a in cur.items()}
    t2 = time.perf_counter()
    for n, p in payloads.items():
        if p is None:
            np.copyto(out[n], prev[n])
        else:
            dl.decode(n, p, prev[n], out[n])
    t3 = time.perf_counter()
    bad = [n for n in cur if not np.array_equal(out[n], cur[n])]
    if bad:
        raise AssertionError(f"decode did not rebuild {bad[:3]}")
    return {
        "tensors_pct": 100 * changed_tensors / len(cur),
        "bytes_pct": 100 * changed_bytes / full,
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


def run_recipe(name: str, cfg: ModelConfig, args) -> tuple[int, list[dict[str, float]], float]:
    torch.manual_seed(0)
    recipe = Recipe.load(name)
    backend = make_backend(TrainerConfig(lr=args.lr), cfg, recipe, seed=0)
    backend.apply_qat()
    contract = contract_from_recipe(model_config=cfg, recipe=recipe)
    rng = torch.Generator().manual_seed(1)
    prev = packed(backend, contract)
    rows = []
    for _ in range(args.steps):
        surrogate_step(backend, cfg, rng, args.batch, args.seq)
        cur = packed(backend, contract)
        rows.append(measure(prev, cur, args.level))
        prev = cur
    return sum(a.nbytes for a in prev.values()), rows, sha256_mbs(prev)


def main() -> int:
    demo = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lr", type=float, default=float(demo["trainer"]["lr"]), help="default: configs/demo.yaml's")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--level", type=int, default=dl.LEVEL, help="zstd level")
    p.add_argument("--recipes", default=",".join(RECIPES))
    args = p.parse_args()
    torch.set_num_threads(1)  # one core: the figures are per core
    cfg = ModelConfig.preset(demo["model"]["preset"])
    print(f"demo preset, lr {args.lr:g}, {args.steps} AdamW steps per recipe, zstd level {args.level}, 1 core")
    print(
        f"{'recipe':<10} {'MB':>6} {'tensors%':>9} {'bytes%':>7} {'delta%':>7} {'enc MB/s':>9} {'dec MB/s':>9}"
        f" {'sha256 MB/s':>12}"
    )
    for name in args.recipes.split(","):
        nbytes, rows, sha = run_recipe(name, cfg, args)
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(
            f"{name:<10} {nbytes / 1e6:>6.2f} {med['tensors_pct']:>9.1f} {med['bytes_pct']:>7.2f} "
            f"{med['delta_pct']:>7.2f} {med['encode_mbs']:>9.0f} {med['decode_mbs']:>9.0f} {sha:>12.0f}",
            flush=True,
        )
        print(
            "           per step delta%: " + " ".join(f"{r['delta_pct']:.2f}" for r in rows),
            flush=True,
        )
    print(f"(cpu: {os.cpu_count()} cores visible)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
