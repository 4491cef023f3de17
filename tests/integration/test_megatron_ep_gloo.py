"""The megatron backend under real expert parallelism: 2 processes, gloo on 127.0.0.1, EP=2, TP=1.

Each rank builds the GPTModel with its half of the experts, loads the canonical weights (its shards
only), gathers them back (canonical_state all-gathers the experts) and installs QAT: the gathered
weights equal the canonical ones bitwise on every rank, each rank's QAT QuantizedParams are those of
its own experts under their global names, with the same bytes as the torch backend's."""

from __future__ import annotations

import multiprocessing as mp
import traceback

import gloo  # tests/gloo.py: conftest.py puts tests/ on sys.path
import pytest
import torch

WORLD = 2
TIMEOUT_S = 120


def _worker(rank: int, port: int, out: mp.Queue) -> None:
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        from policy.model import ModelConfig, Transformer
        from policy.qat import apply_qat as torch_apply_qat
        from policy.qat import bits
        from policy.recipe import Recipe
        from trainer import megatron_backend as mb

        gloo.init(rank, port, WORLD, timeout_s=60)
        mb.init_parallel(ep=WORLD)
        cfg = ModelConfig.preset("tiny", n_layers=2)
        ref = Transformer(cfg, seed=5).to(torch.bfloat16)
        gpt = mb.build_gpt_model(cfg, dtype=torch.bfloat16, ep=WORLD, cpu_init=True)
        mb.load_canonical(gpt, cfg, dict(ref.named_parameters()))
        result = {"local_experts": len(gpt.decoder.layers[0].mlp.experts.local_experts)}
        back = mb.canonical_state(gpt, cfg)
        result["gathered_equal"] = list(back) == [n for n, _ in ref.named_parameters()] and all(
            torch.equal(bits(back[n]), bits(p)) for n, p in ref.named_parameters()
        )
        recipe = Recipe.load("nvfp4_moe")
        t_q = torch_apply_qat(ref, recipe).quantized_params(ref)
        m_q = mb.apply_qat(gpt, cfg, recipe).quantized_params(gpt)
        result["expert_names"] = sorted(
            {int(n.split(".")[5]) for n in m_q if ".mlp.experts." in n and n.startswith("model.layers.0.")}
        )
        result["bytes_equal"] = all(
            m_q[n].value.parts().keys() == t_q[n].value.parts().keys()
            and all(torch.equal(bits(a), bits(t_q[n].value.parts()[k])) for k, a in m_q[n].value.parts().items())
            for n in m_q
        )
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        out.put((rank, result, None))
    except BaseException:
        out.put((rank, None, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.integration
def test_expert_parallel_load_gather_and_qat_bytes(free_port):
    pytest.importorskip("megatron.core")
    results = gloo.run_ranks(_worker, world=WORLD, port=free_port(), timeout_s=TIMEOUT_S, what="EP workers")
    for rank, res in results.items():
        assert res["local_experts"] == 4, res
        assert res["gathered_equal"], f"rank {rank}: gathered canonical weights differ"
        assert res["expert_names"] == list(range(4 * rank, 4 * rank + 4)), res
        assert res["bytes_equal"], f"rank {rank}: QAT bytes differ from the torch backend's"
