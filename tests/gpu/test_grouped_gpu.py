"""The grouped-GEMM MoE and the batched expert quantizer on a GPU: the Triton stacked quantizer gives
the CPU reference's bytes per expert (edge cases included), the grouped forward/backward under bf16
autocast agrees with the loop over experts within bf16 noise (plain and QAT, both straight-through
modes, experts without tokens), and neither the grouped MoE nor the QAT group refill syncs with the
host. Runs on the device machine only (bench/run_trainer_device.sh)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run via bench/run_trainer_device.sh)", allow_module_level=True)
pytest.importorskip("triton")

from policy import formats, kernels  # noqa: E402
from policy.model import ModelConfig, MoE, Transformer  # noqa: E402
from policy.qat import apply_qat, bits  # noqa: E402
from policy.recipe import Recipe  # noqa: E402

# tiny's widths but 16 experts, 64 tokens per test batch: some experts get none at 2 x 4 tokens
CFG = ModelConfig.preset("tiny", n_layers=2, n_experts=16, top_k=4)


def _experts(e: int, m: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(e, m, k, generator=torch.Generator().manual_seed(0))
    x[1] = 0.0  # an all-zero expert
    x[2] *= 1e-38  # a tiny amax: subnormal scales
    x[3] *= 1e30
    x[4, :, :32] = 0.0
    return x.to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("fmt", "kw"),
    [("nvfp4", {"scope": "tensor"}), ("nvfp4", {"scope": "row"}), ("int4", {"group_size": 32}), ("mxfp8", {}),
     ("fp8_block", {"block": (128, 128)}), ("bf16", {})],
)  # fmt: skip
@pytest.mark.parametrize(("m", "k"), [(256, 2048), (2048, 768), (5, 64)])
def test_quantize_stacked_cuda_equals_the_cpu_reference(fmt, kw, dtype, m, k):
    if fmt == "fp8_block" and k % 128:
        pytest.skip("K not a multiple of the block")
    x = _experts(8, m, k, dtype)
    flat, qs = kernels.quantize_stacked(fmt, x, check_finite=False, **kw)
    for e, q in enumerate(qs):
        ref = formats.get(fmt).quantize(x[e].cpu(), **kw)
        for part, t in ref.parts().items():
            got = q.parts()[part]
            assert got.is_cuda and got.dtype == t.dtype
            assert torch.equal(bits(got.cpu()), bits(t)), (fmt, kw, e, part)
        assert torch.equal(bits(formats.operand(q).values.cpu()), bits(formats.operand(ref).values))


def test_quantize_stacked_cuda_flags_non_finite():
    x = _experts(4, 64, 128, torch.bfloat16)
    x[2, 5, 7] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        kernels.quantize_stacked("nvfp4", x)


def _run(model: Transformer, tokens: torch.Tensor, grouped: bool):
    for m in model.modules():
        if isinstance(m, MoE):
            m.grouped = grouped
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
    return logits.float(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize(
    ("recipe", "backward"), [(None, "hp"), ("nvfp4_moe", "hp"), ("nvfp4_moe", "dequant"), ("int4_qat", "hp")]
)
@pytest.mark.parametrize("n_tokens", [4, 64])
def test_grouped_moe_matches_the_loop_on_cuda(recipe, backward, n_tokens):
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    if recipe is not None:
        apply_qat(model, Recipe.load(recipe), backward)
    g = torch.Generator("cuda").manual_seed(3)
    tokens = torch.randint(0, CFG.vocab_size, (2, n_tokens), device="cuda", generator=g)
    ref_logits, ref_grads = _run(model, tokens, grouped=False)
    logits, grads = _run(model, tokens, grouped=True)
    # bf16 noise: the two paths sum in different orders (and, with nvfp4 scales, the grouped GEMM
    # rounds its accumulator to bf16 once more), and activation quantization amplifies a flipped bit
    err = (logits - ref_logits).abs().max().item()
    assert err <= 0.05 * ref_logits.abs().max().item(), err
    assert set(ref_grads) <= set(grads)
    assert all(not grads[n].any() for n in set(grads) - set(ref_grads))  # experts without tokens
    # expert weights (what the grouped path computes) tightly; the rest (router, attention) see the
    # experts' bf16 noise through the routing probabilities
    for n, ref in ref_grads.items():
        if ref.abs().max() > 0:
            assert _cos(grads[n], ref) > (0.99 if ".experts." in n else 0.95), n


def test_grouped_moe_and_refill_do_not_sync():
    """Forward and backward of the grouped MoE with an nvfp4 QAT refill inside: no host sync."""
    with torch.device("cuda"):
        model = Transformer(CFG, seed=0)
    hook = apply_qat(model, Recipe.load("nvfp4_moe"))
    moe = model.model.layers[0].mlp
    x = torch.randn(2, 64, CFG.dim, device="cuda", requires_grad=True)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = moe(x, hook)
        y.float().square().mean().backward()

    step()  # compiles the kernels
    hook.invalidate()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # refills the expert groups, routes, grouped GEMMs, grouped backward
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(g.stacked is not None for n, g in hook._groups.items() if n.startswith("model.layers.0."))
